"""From the notebook to a cluster: notebook 04's MNIST training under ``torchrun`` (notebook 07).

This module is two things:

1. **A torchrun entry point.** ``python -m helpers.cluster`` runs
   :func:`helpers.mnist_train.ddp_train_worker` -- the very worker notebook 04 starts with
   ``launch(ddp_train_worker, world_size, config)`` -- in a process started by ``torchrun``, and
   (with ``--output DIR``) writes each rank's history and what torchrun told it (``RANK``,
   ``LOCAL_RANK``, ``GROUP_RANK`` = node rank, ``WORLD_SIZE``, restart count, network namespace)
   to ``DIR/rank<RANK>.json``. For the same seed and configuration the loss history equals the
   notebook's ``launch`` run (asserted in notebook 07 and ``tests/test_cluster.py``).
2. **Helpers that start torchrun agents from Python** (a notebook cell or a test) as
   subprocesses, with a timeout, and leave no agent or worker behind: :func:`torchrun_command`,
   :func:`run_agents`, :func:`free_port`, and :class:`TwoNodeNetwork`, two Linux network
   namespaces joined by a veth pair so a two-"node" rehearsal on one host really crosses a
   network interface.

The commands (run from the repository root, after ``pip install -r requirements.txt``; add
``--output runs/job1`` to keep every rank's history as JSON):

One machine, 2 processes::

    torchrun --standalone --nproc-per-node=2 -m helpers.cluster --epochs 1

Several machines, 2 processes each, c10d rendezvous (run the same command on every node;
HOST0 is the address of the first node, reachable from all nodes; any free port)::

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 --rdzv-id=mnist-job1 -m helpers.cluster --epochs 1

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
    srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint="$head_node:29500" --rdzv-id="$SLURM_JOB_ID" -m helpers.cluster --epochs 1 --output "runs/$SLURM_JOB_ID"

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

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from helpers import REPO_ROOT
from helpers import procs as _procs

__all__ = [
    "ENV_KEYS",
    "InjectedFailure",
    "AgentRun",
    "TwoNodeNetwork",
    "NetnsUnavailable",
    "free_port",
    "torchrun_command",
    "run_agents",
    "read_rank_outputs",
    "cluster_commands",
    "netns_available",
    "failure_report",
    "processes_matching",
    "JobResult",
    "run_job",
    "threads_per_process",
    "cluster_train_worker",
    "main",
    "shell_join",
]

#: Environment variables torchrun sets in every worker, reported in each rank's output.
ENV_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")

_KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL grace for agents (they stop their workers on SIGTERM)
_POLL_S = 0.1


class InjectedFailure(RuntimeError):
    """The failure ``--fail-rank/--fail-at-step`` injects (teaching only)."""


# ----------------------------------------------------------------------------------------------
# the commands, as text
# ----------------------------------------------------------------------------------------------

def cluster_commands(nproc_per_node: int = 2, nnodes: int = 2, host: str = "HOST0", port: int = 29500,
                     rdzv_id: str = "mnist-job1", args: str = "--epochs 1") -> dict[str, str]:
    """The launch commands of this module's docstring, as text (for the notebook and docs).

    Args:
        nproc_per_node: workers per node (one per GPU on a GPU node).
        nnodes: number of machines.
        host: the rendezvous host, the first node's address (a placeholder by default).
        port: the rendezvous port on ``host``.
        rdzv_id: the job id every node must share (SLURM uses ``$SLURM_JOB_ID``).
        args: arguments for ``helpers.cluster`` (training options).

    Returns:
        ``{"single node": ..., "multi-node (run on every node)": ..., "SLURM batch script": ...}``.
    """
    entry = f"-m helpers.cluster {args}".rstrip()
    single = f"torchrun --standalone --nproc-per-node={nproc_per_node} {entry}"
    multi = (f"torchrun --nnodes={nnodes} --nproc-per-node={nproc_per_node} --rdzv-backend=c10d "
             f"--rdzv-endpoint={host}:{port} --rdzv-id={rdzv_id} {entry}")
    slurm = "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=ddp-lab-mnist",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nproc_per_node}",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=00:30:00",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=1",
        f'srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node={nproc_per_node} --rdzv-backend=c10d '
        f'--rdzv-endpoint="$head_node:{port}" --rdzv-id="$SLURM_JOB_ID" {entry} --output "runs/$SLURM_JOB_ID"',
    ])
    return {"single node": single, "multi-node (run on every node)": multi, "SLURM batch script": slurm}


# ----------------------------------------------------------------------------------------------
# starting torchrun agents
# ----------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (:func:`helpers.procs.free_port`). Pass it to
    the one agent that *hosts* the rendezvous store, which fails loudly if it is taken."""
    return _procs.free_port(host)


def torchrun_command(entry_args: Sequence[str], *, nproc_per_node: int = 1, nnodes: int = 1,
                     standalone: bool = False, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, is_host: bool | None = None,
                     local_addr: str | None = None, max_restarts: int = 0,
                     monitor_interval: float = 0.5, rdzv_timeout_s: int = 60,
                     log_dir: str | os.PathLike | None = None, module: str | None = "helpers.cluster",
                     prefix: Sequence[str] = ()) -> list[str]:
    """The argv of one torchrun agent: ``[*prefix, sys.executable, "-m", "torch.distributed.run", ...]``.

    ``python -m torch.distributed.run`` is ``torchrun`` with this very interpreter (so it works
    in a virtual environment without ``torchrun`` on ``PATH``).

    Args:
        entry_args: arguments after the module, e.g. ``["--max-steps", "50"]``.
        nproc_per_node: worker processes this agent starts.
        nnodes: agents (nodes) in the job; each runs this command.
        standalone: single node, a private c10d store on a free port (no endpoint needed).
        rdzv_endpoint: ``"HOST:PORT"`` of the c10d rendezvous store (multi-node).
        rdzv_id: job id shared by all agents of the job.
        is_host: ``True`` on the one agent that hosts the store (``--rdzv-conf is_host=1``),
            ``False`` on the others; ``None``: torchrun guesses from the host name.
        local_addr: the address this node advertises to the others (``--local-addr``).
        max_restarts: how often torchrun may restart the worker group after a failure.
        monitor_interval: seconds between the agent's checks of its workers.
        rdzv_timeout_s: seconds the agents wait for each other at the rendezvous.
        log_dir: where torchrun keeps its per-attempt files (workers' error files); default:
            a new ``/tmp/torchelastic_*`` folder that torchrun never removes.
        module: the entry module (``-m``); ``None`` means ``entry_args[0]`` is a script path.
        prefix: a command to run torchrun under, e.g. ``["ip", "netns", "exec", "ns0"]``.

    Raises:
        ValueError: ``standalone`` together with an endpoint, or a multi-node job without one.
    """
    if standalone and rdzv_endpoint:
        raise ValueError("standalone=True picks its own rendezvous; do not pass rdzv_endpoint")
    if not standalone and not rdzv_endpoint:
        raise ValueError("pass standalone=True (one node) or rdzv_endpoint='HOST:PORT' (c10d rendezvous)")
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run",
           f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
           f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval:g}"]
    if standalone:
        cmd.append("--standalone")
    else:
        conf = [f"join_timeout={rdzv_timeout_s}"]
        if is_host is not None:
            conf.append(f"is_host={int(is_host)}")
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id or 'ddp-lab-' + secrets.token_hex(4)}", f"--rdzv-conf={','.join(conf)}"]
    if local_addr:
        cmd.append(f"--local-addr={local_addr}")
    if log_dir is not None:
        cmd.append(f"--log-dir={log_dir}")
    if module:
        cmd += ["-m", module]
    return cmd + [str(a) for a in entry_args]


@dataclass
class AgentRun:
    """What one torchrun agent (one "node") did.

    Attributes:
        node: index of the agent in the list given to :func:`run_agents`.
        command: its argv.
        returncode: exit status (``None`` if it was still running at the timeout and killed).
        seconds: wall time from the start of all agents until this one exited (s).
        stdout, stderr: everything it and its workers printed.
        timed_out: killed at the timeout.
    """

    node: int
    command: list[str]
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def tail(self, lines: int = 20, stream: str = "stderr") -> str:
        """The last ``lines`` lines of ``stream`` ("stdout" or "stderr")."""
        return "\n".join(getattr(self, stream).rstrip().splitlines()[-lines:])


def _descendants(proc) -> list:
    import psutil

    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def _stop(processes: list, grace_s: float) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL whatever is left (:func:`helpers.procs.end_processes`)."""
    _procs.end_processes(processes, grace_s)


def run_agents(commands: Sequence[Sequence[str]], *, timeout: float = 180.0, env: dict[str, str] | None = None,
               cwd: str | os.PathLike | None = None, echo: bool = False) -> list[AgentRun]:
    """Start one torchrun agent per command (the "nodes"), wait for all, return what each did.

    Every agent starts at once, in its own session, with ``env`` added to this process's
    environment (plus ``PYTHONPATH`` = the repository root and ``PYTHONUNBUFFERED=1``) and
    ``cwd`` (default: the repository root). While they run, every descendant (the workers
    torchrun starts, each in a session of its own) is recorded, so that when the call ends --
    normally, at the timeout, or with an exception such as KeyboardInterrupt -- any agent or
    worker still alive gets SIGTERM (torchrun then stops its workers), then SIGKILL.

    Args:
        commands: one argv per agent (see :func:`torchrun_command`).
        timeout: seconds for the whole job; agents still running then are killed and reported
            with ``timed_out=True`` and ``returncode=None`` (no exception is raised).
        env: extra environment variables for every agent.
        cwd: working directory of the agents.
        echo: also print each agent's output when it ends (prefixed ``[node i]``).

    Returns:
        list of :class:`AgentRun`, in the order of ``commands``.
    """
    import psutil

    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base_env.get("PYTHONPATH", "")]))
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env.update(env or {})
    seen: dict[int, Any] = {}
    procs: list[subprocess.Popen] = []
    ended: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="ddp-lab-agents-") as logs:
        files = []
        t0 = time.monotonic()
        try:
            for i, cmd in enumerate(commands):
                out = open(os.path.join(logs, f"{i}.out"), "wb")
                err = open(os.path.join(logs, f"{i}.err"), "wb")
                files += [out, err]
                p = subprocess.Popen(list(cmd), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                     env=base_env, cwd=str(cwd or REPO_ROOT), start_new_session=True)
                procs.append(p)
                try:
                    seen[p.pid] = psutil.Process(p.pid)
                except psutil.Error:
                    pass
            while len(ended) < len(procs) and time.monotonic() - t0 < timeout:
                for i, p in enumerate(procs):
                    if i not in ended and p.poll() is not None:
                        ended[i] = time.monotonic() - t0
                    for c in _descendants(p):
                        seen.setdefault(c.pid, c)
                time.sleep(_POLL_S)
        finally:
            # agents first (a torchrun agent stops its own workers on SIGTERM), then anything left
            _stop([seen[p.pid] for p in procs if p.pid in seen and p.poll() is None], _KILL_GRACE_S)
            _stop(list(seen.values()), _KILL_GRACE_S)
            for p in procs:
                try:
                    p.wait(timeout=_KILL_GRACE_S)
                except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent above
                    pass
            for f in files:
                f.close()
        runs = []
        for i, (cmd, p) in enumerate(zip(commands, procs)):
            read = lambda s: Path(logs, f"{i}.{s}").read_bytes().decode("utf-8", "replace")  # noqa: E731
            timed_out = i not in ended
            runs.append(AgentRun(i, list(cmd), None if timed_out else p.returncode,
                                 ended.get(i, time.monotonic() - t0), read("out"), read("err"), timed_out))
    if echo:
        for r in runs:
            text = r.output.rstrip()
            if text:
                print("\n".join(f"[node {r.node}] {line}" for line in text.splitlines()))
    return runs


def read_rank_outputs(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every ``rank<R>.json`` written by ``python -m helpers.cluster --output DIR``, in rank order.

    Raises:
        FileNotFoundError: if the folder holds no rank output (the job failed before writing).
    """
    paths = sorted(Path(output_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not paths:
        raise FileNotFoundError(f"no rank*.json in {output_dir}: the job wrote no results (see its output)")
    return [json.loads(p.read_text()) for p in paths]


def failure_report(run: AgentRun) -> dict[str, Any] | None:
    """The root cause torchrun's agent printed when its job failed, parsed; ``None`` if it
    printed no failure report (e.g. the job succeeded).

    torchrun ends a failed job with a block like ``helpers.cluster FAILED ... Root Cause (first
    observed failure): [0]: time: ..., host: ..., rank: 1 (local_rank: 0), exitcode: 1 (pid: ...),
    error_file: ..., traceback: ...``. Returns ``{"rank": int, "local_rank": int, "exitcode": int,
    "error": the last line of the worker's traceback (exception type and message), "text": the
    whole block}``.
    """
    text = run.output
    start = text.rfind("Root Cause (first observed failure)")
    if start < 0:
        return None
    head = text.rfind("FAILED", 0, start)
    end = text.find("=" * 20, start)
    block = text[text.rfind("\n", 0, head) + 1 if head >= 0 else start: end if end >= 0 else len(text)]
    root = text[start: end if end >= 0 else len(text)]
    rank = re.search(r"rank\s*:\s*(-?\d+)\s*\(local_rank:\s*(\d+)\)", root)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    lines = [ln.strip() for ln in root.splitlines() if ln.strip()]
    return {
        "rank": int(rank.group(1)) if rank else None,
        "local_rank": int(rank.group(2)) if rank else None,
        "exitcode": int(code.group(1)) if code else None,
        "error": lines[-1] if lines else "",
        "text": block.rstrip(),
    }


def processes_matching(marker: str) -> list:
    """Every process on this machine whose command line contains ``marker`` (e.g. a job's
    unique output folder or rendezvous id), except this one: used to prove that nothing of a
    job is left running. Returns psutil.Process objects."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


@dataclass
class JobResult:
    """One torchrun job started by :func:`run_job`.

    Attributes:
        agents: one :class:`AgentRun` per node.
        ranks: each rank's ``rank<R>.json`` (history + ``"node"``), in rank order; ``[]`` if
            the job wrote none (it failed before the end).
        marker: a string unique to this job found in every agent's and worker's command line
            (for :func:`processes_matching`).
        commands: the agents' command lines, as shell text.
    """

    agents: list[AgentRun]
    ranks: list[dict[str, Any]]
    marker: str
    commands: list[str]

    @property
    def ok(self) -> bool:
        return all(a.returncode == 0 for a in self.agents)

    def leftovers(self) -> list:
        """Processes of this job still running anywhere on the machine (should be ``[]``)."""
        return processes_matching(self.marker)

    def node_table(self) -> list[dict[str, Any]]:
        """One row per rank: what torchrun told it and where it ran (for a DataFrame)."""
        rows = []
        for h in self.ranks:
            n = h["node"]
            rows.append({"RANK": int(n["RANK"]), "LOCAL_RANK": int(n["LOCAL_RANK"]),
                         "GROUP_RANK (node)": int(n["GROUP_RANK"]), "WORLD_SIZE": int(n["WORLD_SIZE"]),
                         "LOCAL_WORLD_SIZE": int(n["LOCAL_WORLD_SIZE"]), "MASTER_ADDR": n["MASTER_ADDR"],
                         "restart count": int(n["TORCHELASTIC_RESTART_COUNT"]),
                         "GLOO_SOCKET_IFNAME": n["GLOO_SOCKET_IFNAME"], "network namespace": n["net_namespace"],
                         "pid": n["pid"], "backend": h.get("backend"), "steps": h["steps"],
                         "test accuracy": h["test_accuracy"]})
        return rows


def threads_per_process(processes_on_host: int) -> int:
    """CPU threads per process when ``processes_on_host`` share this machine: the launcher's
    rule, ``max(1, cpu_count // processes)`` (set as ``OMP_NUM_THREADS`` for torchrun jobs)."""
    return max(1, (os.cpu_count() or 1) // max(1, processes_on_host))


def run_job(train_args: Sequence[str], *, nodes: int = 1, nproc_per_node: int = 2,
            network: "TwoNodeNetwork | None" = None, max_restarts: int = 0, timeout: float = 240.0,
            env: dict[str, str] | None = None) -> JobResult:
    """Run ``python -m helpers.cluster <train_args>`` under torchrun, as one or several "nodes"
    on this machine, and collect every rank's results.

    - ``nodes == 1``: ``torchrun --standalone --nproc-per-node=N`` (its own c10d store on a free
      port).
    - ``nodes >= 2``: ``nodes`` agents with ``--nnodes=nodes`` and a c10d rendezvous; agent 0
      hosts the store (``is_host=1``) on a free port. Without ``network``: everything on
      loopback (``127.0.0.1``, ``--local-addr=127.0.0.1``, ``GLOO_SOCKET_IFNAME=lo``). With a
      :class:`TwoNodeNetwork` (``nodes == 2``): agent ``i`` runs inside namespace ``i``,
      advertises ``network.addresses[i]``, the store is at ``addresses[0]`` and gloo uses the
      veth interface, so every byte between the nodes crosses it.

    Every agent gets ``OMP_NUM_THREADS`` = :func:`threads_per_process` of all processes on
    this host, plus ``env``. ``--output`` and torchrun's ``--log-dir`` are added (a temporary
    folder, read back and removed).

    Args:
        train_args: options for ``helpers.cluster`` (e.g. ``["--max-steps", "50"]``).
        nodes, nproc_per_node: the job's shape.
        network: run the nodes in these namespaces (requires ``nodes == 2``).
        max_restarts: torchrun's ``--max-restarts``.
        timeout: seconds for the whole job (see :func:`run_agents`).
        env: extra environment variables for every agent.

    Returns:
        :class:`JobResult`.

    Raises:
        ValueError: ``network`` with ``nodes != 2``, or ``nodes < 1``.
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if network is not None and nodes != 2:
        raise ValueError("a TwoNodeNetwork holds exactly 2 nodes")
    job_env = {"OMP_NUM_THREADS": str(threads_per_process(nodes * nproc_per_node))}
    with tempfile.TemporaryDirectory(prefix="ddp-lab-job-") as tmp:
        out, logs = os.path.join(tmp, "out"), os.path.join(tmp, "torchrun-logs")
        args = [*map(str, train_args), "--output", out]
        if nodes == 1:
            job_env["GLOO_SOCKET_IFNAME"] = "lo"
            commands = [torchrun_command(args, nproc_per_node=nproc_per_node, standalone=True,
                                         max_restarts=max_restarts, log_dir=logs)]
        else:
            rdzv_id = f"ddp-lab-{secrets.token_hex(4)}"
            if network is None:
                addrs, prefixes = ["127.0.0.1"] * nodes, [[]] * nodes
                job_env["GLOO_SOCKET_IFNAME"] = "lo"
                port = free_port("127.0.0.1")
            else:
                addrs, prefixes = list(network.addresses), [network.prefix(i) for i in range(2)]
                job_env["GLOO_SOCKET_IFNAME"] = network.interface
                port = free_port("127.0.0.1")  # a fresh namespace has no listeners: any port is free there
            commands = [torchrun_command(args, nnodes=nodes, nproc_per_node=nproc_per_node,
                                         rdzv_endpoint=f"{addrs[0]}:{port}", rdzv_id=rdzv_id,
                                         is_host=(i == 0), local_addr=addrs[i], max_restarts=max_restarts,
                                         log_dir=os.path.join(logs, f"node{i}"), prefix=prefixes[i])
                        for i in range(nodes)]
        job_env.update(env or {})
        agents = run_agents(commands, timeout=timeout, env=job_env)
        try:
            ranks = read_rank_outputs(out)
        except FileNotFoundError:
            ranks = []
    return JobResult(agents, ranks, tmp, [shell_join(c) for c in commands])


# ----------------------------------------------------------------------------------------------
# two "nodes" in two network namespaces
# ----------------------------------------------------------------------------------------------

class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not Linux, no ``ip``, or not permitted)."""


def netns_available() -> tuple[bool, str]:
    """Can this process create network namespaces? ``(ok, reason)``; tries for real (creates
    and deletes a namespace), since permission depends on capabilities, not only on the uid."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are a Linux feature; this is {sys.platform}"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    name = f"ddplab-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return False, f"`ip netns add` is not permitted here: {r.stderr.strip() or r.returncode}"
        r = subprocess.run(["ip", "netns", "exec", name, "true"], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return False, f"`ip netns exec` is not permitted here: {r.stderr.strip() or r.returncode}"
        # a veth pair with both ends inside the probe namespace (deleted with it)
        r = subprocess.run(["ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return False, f"creating a veth pair is not permitted here: {r.stderr.strip() or r.returncode}"
        return True, "ip netns works (root or CAP_SYS_ADMIN + CAP_NET_ADMIN)"
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"`ip netns` failed: {type(e).__name__}: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


@dataclass
class TwoNodeNetwork:
    """Two network namespaces (the "nodes") joined by one veth pair: a private two-host LAN.

    ::

        namespace <name>-n0                 namespace <name>-n1
        lo 127.0.0.1                         lo 127.0.0.1
        <veth0> 10.213.7.1/30  <-- veth -->  <veth1> 10.213.7.2/30

    Nothing is added to the host's own network: both ends of the veth pair live in the new
    namespaces, and the addresses exist only there. Use as a context manager; on exit (also on
    error) every process still inside the namespaces is killed and both namespaces are deleted
    (which deletes the veth pair).

    Attributes:
        addresses: ``[node0_ip, node1_ip]``.
        interfaces: ``[veth name in n0, veth name in n1]`` (also the ``GLOO_SOCKET_IFNAME``).
        names: the two namespace names (unique per instance: pid + random suffix).

    Raises:
        NetnsUnavailable: on entry, if a namespace or the veth pair cannot be created (the
            partial set-up is removed first).
    """

    addresses: tuple[str, str] = ("10.213.7.1", "10.213.7.2")
    prefix_len: int = 30
    interface: str = "veth-ddplab"  # <= 15 characters (IFNAMSIZ)
    names: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.names = [f"ddplab-{tag}-n0", f"ddplab-{tag}-n1"]
        # Both ends get the same name: each lives in its own namespace, so there is no clash, and
        # one GLOO_SOCKET_IFNAME serves both nodes.
        self.interfaces = [self.interface, self.interface]

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")

    def __enter__(self) -> "TwoNodeNetwork":
        try:
            for ns in self.names:
                self._ip("netns", "add", ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            a, b = self.interfaces
            self._ip("-n", self.names[0], "link", "add", a, "type", "veth", "peer", "name", b, "netns", self.names[1])
            for ns, dev, addr in zip(self.names, self.interfaces, self.addresses):
                self._ip("-n", ns, "addr", "add", f"{addr}/{self.prefix_len}", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.cleanup()
        return False

    def prefix(self, node: int) -> list[str]:
        """Run a command inside node ``node``'s namespace: ``prefix(node) + argv``."""
        return ["ip", "netns", "exec", self.names[node]]

    def counters(self, node: int) -> dict[str, int]:
        """Bytes and packets through node ``node``'s veth so far (the kernel's counters):
        ``{"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"}``."""
        r = subprocess.run(["ip", "-n", self.names[node], "-j", "-s", "link", "show", "dev", self.interfaces[node]],
                           capture_output=True, text=True, timeout=20, check=True)
        stats = json.loads(r.stdout)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def exists(self) -> list[str]:
        """The namespaces of this instance that still exist (``[]`` after cleanup)."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
        listed = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
        return [n for n in self.names if n in listed]

    def cleanup(self) -> None:
        """Kill every process left in the namespaces, then delete them (idempotent)."""
        import psutil

        for ns in self.names:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
            procs = []
            for pid in r.stdout.split():
                try:
                    procs.append(psutil.Process(int(pid)))
                except (psutil.Error, ValueError):
                    pass
            if procs:
                _stop(procs, 2.0)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


# ----------------------------------------------------------------------------------------------
# inside a worker
# ----------------------------------------------------------------------------------------------

def _install_failure(rank: int, fail_rank: int | None, fail_at_step: int, fail_attempts: int):
    """Make rank ``fail_rank`` raise in the forward of training step ``fail_at_step`` while
    ``TORCHELASTIC_RESTART_COUNT < fail_attempts``. Uses torch's global module forward
    pre-hook and counts only forwards through the DDP wrapper (training steps, not evaluation,
    which uses ``ddp.module``). Returns the hook handle, or ``None`` when nothing is injected."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if fail_rank is None or rank != fail_rank or restart >= fail_attempts:
        return None
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.nn.parallel import DistributedDataParallel

    steps = [0]

    def hook(module, inputs):
        if isinstance(module, DistributedDataParallel):
            steps[0] += 1
            if steps[0] == fail_at_step:
                raise InjectedFailure(f"injected failure: rank {rank}, training step {fail_at_step}, "
                                      f"restart count {restart} (--fail-rank/--fail-at-step)")

    return register_module_forward_pre_hook(hook)


def _net_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/net")  # e.g. "net:[4026531840]": one id per namespace
    except OSError:
        return "unknown"


def cluster_train_worker(rank: int, world_size: int, config, output_dir: str | None = None,
                         fail_rank: int | None = None, fail_at_step: int = 1,
                         fail_attempts: int = 10**9) -> dict[str, Any]:
    """One rank of notebook 04's DDP training, as started by torchrun (or :func:`helpers.launch.launch`).

    Runs :func:`helpers.mnist_train.ddp_train_worker` unchanged and adds to its history
    ``"node"``: what this process was told and where it ran (``{key: value}`` for
    :data:`ENV_KEYS`, ``hostname``, ``pid``, ``net_namespace``). With ``output_dir`` it writes the
    history (without ``snapshot``) as JSON to ``output_dir/rank<rank>.json``.

    Args:
        rank, world_size: this process's place in the default process group.
        config: a :class:`helpers.mnist_train.TrainConfig`.
        output_dir: folder for the JSON (created if missing); ``None``: write nothing.
        fail_rank, fail_at_step, fail_attempts: fault injection (see the module docstring).

    Returns:
        the history dict of :func:`ddp_train_worker` plus ``"node"``.

    Raises:
        InjectedFailure: on ``fail_rank`` at ``fail_at_step``, when injection is on.
    """
    from helpers.mnist_train import ddp_train_worker

    handle = _install_failure(rank, fail_rank, fail_at_step, fail_attempts)
    try:
        history = ddp_train_worker(rank, world_size, config)
    finally:
        if handle is not None:
            handle.remove()
    history["node"] = {
        **{k: os.environ.get(k) for k in ENV_KEYS},
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "net_namespace": _net_namespace(),
    }
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        payload = {k: v for k, v in history.items() if k != "snapshot"}
        tmp = out / f".rank{rank}.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, out / f"rank{rank}.json")
    return history


def _parse(argv: list[str] | None):
    import argparse

    from helpers.mnist_train import MODELS

    p = argparse.ArgumentParser(
        prog="python -m helpers.cluster",
        description="Notebook 04's MNIST DDP training as a torchrun entry point "
                    "(torchrun --standalone --nproc-per-node=2 -m helpers.cluster --epochs 1).")
    p.add_argument("--global-batch-size", type=int, default=64, help="samples per optimizer step, all ranks")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps; 0: full epochs")
    p.add_argument("--model", choices=MODELS, default="linear")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    p.add_argument("--output", default=None, help="folder for rank<R>.json (history and torchrun env)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when this node has a GPU per local rank, else gloo")
    p.add_argument("--fail-rank", type=int, default=None, help="(teaching) global rank that raises")
    p.add_argument("--fail-at-step", type=int, default=1, help="(teaching) 1-based training step to fail in")
    p.add_argument("--fail-attempts", type=int, default=10**9,
                   help="(teaching) fail only while TORCHELASTIC_RESTART_COUNT is below this")
    return p.parse_args(argv)


def _record(fn):
    """torchelastic's ``@record``: an uncaught exception in a worker is written to the error
    file torchrun reads, so the agent's failure summary shows the worker's traceback."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


@_record
def main(argv: list[str] | None = None) -> None:
    """``python -m helpers.cluster ...`` under torchrun: one rank of the MNIST training."""
    from helpers.launch import main_from_env
    from helpers.mnist_train import TrainConfig

    a = _parse(argv)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SystemExit(f"python -m helpers.cluster runs under torchrun, which sets {', '.join(missing)}. Start it "
                         "with e.g. `torchrun --standalone --nproc-per-node=2 -m helpers.cluster --epochs 1`, or "
                         "from a notebook with helpers.launch.launch(ddp_train_worker, 2, TrainConfig()).")
    config = TrainConfig(global_batch_size=a.global_batch_size, lr=a.lr, epochs=a.epochs,
                         max_steps=a.max_steps, model=a.model, seed=a.seed, progress=not a.no_progress)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except Exception:  # noqa: BLE001 - not a TextIOWrapper
            pass
    h = main_from_env(cluster_train_worker, config, a.output, a.fail_rank, a.fail_at_step, a.fail_attempts,
                      backend=a.backend)
    n = h["node"]
    print(f"[rank {h['rank']}/{h['world_size']}, node {n['GROUP_RANK']}, local rank {n['LOCAL_RANK']}] "
          f"{h['steps']} steps, final loss {h['losses'][-1]:.4f}, test accuracy {h['test_accuracy']:.4f}, "
          f"restart count {n['TORCHELASTIC_RESTART_COUNT']}")


def shell_join(argv: Sequence[str]) -> str:
    """``argv`` as one shell line (for printing a command a cell ran)."""
    return " ".join(shlex.quote(str(a)) for a in argv)


if __name__ == "__main__":
    main()
