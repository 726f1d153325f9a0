r"""From the notebook to a cluster: notebook 04's MNIST training under ``torchrun`` (notebook 07a).

This package is the engine's side: an entry point and two modules, one job each; their public names are
importable from here:

1. ``__main__`` -- **what every rank runs.** ``python -m helpers.engine.cluster`` runs the course module
   :mod:`helpers.mnist_torchrun` by name (its ``main()``), which runs
   :func:`helpers.mnist_train.ddp_train_worker` -- the very worker notebook 04 starts with
   ``launch(ddp_train_worker, world_size, config)`` -- in a process started by ``torchrun``, and
   (with ``--output DIR``) writes each rank's history and what torchrun told it (``RANK``,
   ``LOCAL_RANK``, ``GROUP_RANK`` = node rank, ``WORLD_SIZE``, restart count, network namespace)
   to ``DIR/rank<RANK>.json``; it can also inject a failure (below). For the same seed and
   configuration the loss history equals the notebook's ``launch`` run (asserted in notebook 07a
   and ``tests/engine/test_cluster.py``).
2. :mod:`helpers.engine.cluster.agents` -- **starting torchrun agents from Python** (a notebook cell or
   a test) as subprocesses, with a timeout, leaving no agent or worker behind:
   :func:`torchrun_command`, :func:`run_agents`, :func:`run_job`, :func:`failure_report`.
3. :mod:`helpers.engine.cluster.netns` -- :class:`TwoNodeNetwork`, two Linux network namespaces joined
   by a veth pair, so a two-"node" rehearsal on one host really crosses a network interface.

Free ports, ending process trees and the backend rule come from :mod:`helpers.engine.processes`.

The commands (run from the repository root, after ``pip install -r requirements.txt``; add
``--output runs/job1`` to keep every rank's history as JSON):

One machine, 2 processes::

    torchrun --standalone --nproc-per-node=2 -m helpers.engine.cluster --epochs 1

Several machines, 2 processes each, c10d rendezvous (run the same command on every node;
HOST0 is the address of the first node, reachable from all nodes; any free port)::

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \
        --rdzv-id=mnist-job1 -m helpers.engine.cluster --epochs 1

SLURM batch script (``sbatch mnist.sbatch``; one torchrun agent per node, which starts one
worker per GPU)::

    #!/bin/bash
    #SBATCH --job-name=ddp-lab-mnist
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=2
    #SBATCH --cpus-per-task=8
    #SBATCH --time=00:30:00
    set -euo pipefail
    head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export OMP_NUM_THREADS=1
    srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint="$head_node:29500" --rdzv-id="$SLURM_JOB_ID" \
        -m helpers.engine.cluster --epochs 1 --output "runs/$SLURM_JOB_ID"

Add ``--max-restarts=3`` to let torchrun restart the whole worker group after a failure
(training restarts from step 0: this entry point does not checkpoint). With GPUs each rank uses
``cuda:<LOCAL_RANK>`` and nccl; without, gloo on the CPU. :func:`cluster_commands` returns
exactly these texts (a test checks that this docstring and ``docs/CLUSTER.md`` hold them).

Fault injection for teaching (never on by default): ``--fail-rank R --fail-at-step S`` makes
global rank ``R`` raise :class:`InjectedFailure` in the forward pass of training step ``S``
(1-based) while ``TORCHELASTIC_RESTART_COUNT < --fail-attempts`` (default: always).

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
