"""From the notebook to a cluster: starting ``torchrun`` jobs from Python (notebook 07a).

This package is the engine's side of torchrun: two modules, one job each; their public names are
importable from here. What every rank runs is not here: torchrun runs an entry module by its own
name (``torchrun ... -m <module>``), and every function below that starts or prints a job takes
that module as ``module=``. The engine names no course module; notebook 07a passes the course's
MNIST entry, whose docstring and ``docs/CLUSTER.md`` hold its commands.

1. :mod:`helpers.engine.cluster.agents` -- **starting torchrun agents from Python** (a notebook cell or
   a test) as subprocesses, with a timeout, leaving no agent or worker behind:
   :func:`torchrun_command`, :func:`run_agents`, :func:`run_job`, :func:`failure_report`, and
   :func:`cluster_commands`, the commands for one node, several nodes (c10d rendezvous) and SLURM
   as text.
2. :mod:`helpers.engine.cluster.netns` -- :class:`TwoNodeNetwork`, two Linux network namespaces joined
   by a veth pair, so a two-"node" rehearsal on one host really crosses a network interface.

Free ports, ending process trees and the backend rule come from :mod:`helpers.engine.processes`.

References: torchrun https://pytorch.org/docs/stable/elastic/run.html; rendezvous
https://pytorch.org/docs/stable/elastic/rendezvous.html; errors and ``@record``
https://pytorch.org/docs/stable/elastic/errors.html.
"""

# REPO_ROOT: notebook 07a shortens the command lines it prints with ``cluster.REPO_ROOT``
from helpers import REPO_ROOT
from helpers.engine.cluster.agents import (
    AgentRun,
    JobResult,
    cluster_commands,
    failure_report,
    processes_matching,
    read_rank_outputs,
    run_agents,
    run_job,
    shell_join,
    torchrun_command,
)
from helpers.engine.cluster.netns import NetnsUnavailable, TwoNodeNetwork, netns_available

__all__ = [
    "REPO_ROOT",
    "AgentRun",
    "JobResult",
    "NetnsUnavailable",
    "TwoNodeNetwork",
    "cluster_commands",
    "failure_report",
    "netns_available",
    "processes_matching",
    "read_rank_outputs",
    "run_agents",
    "run_job",
    "shell_join",
    "torchrun_command",
]
