"""Starting torchrun agents from Python (a notebook cell or a test), and reading what they did.

- :func:`cluster_commands`: the launch commands of an entry module (one node, several nodes, SLURM), as text.
- :func:`torchrun_command`: the argv of one torchrun agent (one "node").
- :func:`run_agents`: start agents as subprocesses, wait with a timeout, leave no agent or worker
  behind; :class:`AgentRun` is what one agent did, :func:`failure_report` parses the root cause
  torchrun prints when a job fails.
- :func:`run_job`: an entry module under torchrun, as one or several "nodes" on this machine
  (loopback, or a :class:`helpers.engine.cluster.netns.TwoNodeNetwork`), every rank's results read back
  (:class:`JobResult`); :func:`processes_matching` finds anything of a job still running.

Every function that starts or prints a job takes the entry module as ``module=``: the engine names
no course module; the course passes its own entry (notebook 07a does).

Free ports and ending process trees come from :mod:`helpers.engine.processes`.

References: torchrun https://pytorch.org/docs/stable/elastic/run.html; rendezvous
https://pytorch.org/docs/stable/elastic/rendezvous.html.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from helpers import REPO_ROOT
from helpers.engine.cluster.netns import TwoNodeNetwork
from helpers.engine.launcher import threads_per_rank
from helpers.engine.processes import descendants, end_processes, free_port, loopback_interface

__all__ = [
    "AgentRun",
    "JobResult",
    "cluster_commands",
    "failure_report",
    "processes_matching",
    "read_rank_outputs",
    "run_agents",
    "run_job",
    "shell_join",
    "torchrun_command",
]

_KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL grace for agents (they stop their workers on SIGTERM)
_POLL_S = 0.1


def cluster_commands(*, module: str, nproc_per_node: int = 2, nnodes: int = 2, host: str = "HOST0",
                     port: int = 29500, rdzv_id: str = "mnist-job1", args: str = "--epochs 1") -> dict[str, str]:
    """The torchrun commands that run ``module`` on one node, on several nodes and under SLURM, as text
    (for a notebook and the docs).

    Args:
        module: the entry module every rank runs (``torchrun ... -m module``).
        nproc_per_node: workers per node (one per GPU on a GPU node).
        nnodes: number of machines.
        host: the rendezvous host, the first node's address (a placeholder by default).
        port: the rendezvous port on ``host``.
        rdzv_id: the job id every node must share (SLURM uses ``$SLURM_JOB_ID``).
        args: arguments for ``module`` (e.g. training options).

    Returns:
        ``{"single node": ..., "multi-node (run on every node)": ..., "SLURM batch script": ...}``:
        shell text, long commands continued over several lines with `` \\``.
    """
    entry = f"-m {module} {args}".rstrip()
    single = f"torchrun --standalone --nproc-per-node={nproc_per_node} {entry}"
    multi = (f"torchrun --nnodes={nnodes} --nproc-per-node={nproc_per_node} --rdzv-backend=c10d "
             f"--rdzv-endpoint={host}:{port} \\\n    --rdzv-id={rdzv_id} {entry}")
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
        f'srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node={nproc_per_node} --rdzv-backend=c10d \\',
        f'    --rdzv-endpoint="$head_node:{port}" --rdzv-id="$SLURM_JOB_ID" \\',
        f'    {entry} --output "runs/$SLURM_JOB_ID"',
    ])
    return {"single node": single, "multi-node (run on every node)": multi, "SLURM batch script": slurm}


def torchrun_command(entry_args: Sequence[str], *, module: str | None, nproc_per_node: int = 1, nnodes: int = 1,
                     standalone: bool = False, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, is_host: bool | None = None,
                     local_addr: str | None = None, max_restarts: int = 0,
                     monitor_interval: float = 0.5, rdzv_timeout_s: int = 60,
                     log_dir: str | os.PathLike | None = None, prefix: Sequence[str] = ()) -> list[str]:
    """The argv of one torchrun agent: ``[*prefix, sys.executable, "-m", "helpers.engine.cluster.torchrun", ...]``.

    That is ``python -m torch.distributed.run`` (``torchrun`` with this very interpreter, so it works
    in a virtual environment without ``torchrun`` on ``PATH``) with its stores listening only on the
    addresses named here (:mod:`helpers.engine.cluster.torchrun`); ``standalone``: on 127.0.0.1.

    Args:
        entry_args: arguments after the module, e.g. ``["--max-steps", "50"]``.
        module: the entry module (``-m``), required; ``None`` means ``entry_args[0]`` is a script path.
        nproc_per_node: worker processes this agent starts.
        nnodes: agents (nodes) in the job; each runs this command.
        standalone: single node, a private c10d store on a free port (no endpoint needed).
        rdzv_endpoint: ``"HOST:PORT"`` of the c10d rendezvous store (multi-node).
        rdzv_id: job id shared by all agents of the job.
        is_host: ``True`` on the one agent that hosts the store (``--rdzv-conf is_host=1``),
            ``False`` on the others; ``None``: torchrun guesses from the host name.
        local_addr: the address this node advertises to the others (``--local-addr``) and where
            its workers' store listens (default with ``standalone``: ``127.0.0.1``).
        max_restarts: how often torchrun may restart the worker group after a failure.
        monitor_interval: seconds between the agent's checks of its workers.
        rdzv_timeout_s: seconds the agents wait for each other at the rendezvous.
        log_dir: where torchrun keeps its per-attempt files (workers' error files); default:
            a new ``/tmp/torchelastic_*`` folder that torchrun never removes.
        prefix: a command to run torchrun under, e.g. ``["ip", "netns", "exec", "ns0"]``.

    Raises:
        ValueError: ``standalone`` together with an endpoint, or a multi-node job without one.
    """
    if standalone and rdzv_endpoint:
        raise ValueError("standalone=True picks its own rendezvous; do not pass rdzv_endpoint")
    if not standalone and not rdzv_endpoint:
        raise ValueError("pass standalone=True (one node) or rdzv_endpoint='HOST:PORT' (c10d rendezvous)")
    cmd = [*prefix, sys.executable, "-m", "helpers.engine.cluster.torchrun",
           f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
           f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval:g}"]
    if standalone:
        cmd.append("--standalone")
        local_addr = local_addr or "127.0.0.1"  # else the workers' store is on the host name's address
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
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base_env.get("PYTHONPATH", "")]))
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env.update(env or {})
    seen: dict[int, psutil.Process] = {}
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
                    for c in descendants(p.pid):
                        seen.setdefault(c.pid, c)
                time.sleep(_POLL_S)
        finally:
            # agents first (a torchrun agent stops its own workers on SIGTERM), then anything left
            end_processes([seen[p.pid] for p in procs if p.pid in seen and p.poll() is None], _KILL_GRACE_S)
            end_processes(list(seen.values()), _KILL_GRACE_S)
            for p in procs:
                try:
                    p.wait(timeout=_KILL_GRACE_S)
                except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent above
                    pass
            for f in files:
                f.close()
        runs = []
        for i, (cmd, p) in enumerate(zip(commands, procs)):
            timed_out = i not in ended
            runs.append(AgentRun(i, list(cmd), None if timed_out else p.returncode,
                                 ended.get(i, time.monotonic() - t0), _read_log(logs, i, "out"),
                                 _read_log(logs, i, "err"), timed_out))
    if echo:
        for r in runs:
            text = r.output.rstrip()
            if text:
                print("\n".join(f"[node {r.node}] {line}" for line in text.splitlines()))
    return runs


def _read_log(folder: str, node: int, stream: str) -> str:
    """What agent ``node`` wrote to ``stream`` ("out" or "err"), decoded (bad bytes replaced)."""
    return Path(folder, f"{node}.{stream}").read_bytes().decode("utf-8", "replace")


def read_rank_outputs(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every ``rank<R>.json`` an entry module wrote with ``--output DIR``, in rank order.

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

    torchrun ends a failed job with a block like ``<entry module> FAILED ... Root Cause (first
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


def processes_matching(marker: str) -> list[psutil.Process]:
    """Every process on this machine whose command line contains ``marker`` (e.g. a job's
    unique output folder or rendezvous id), except this one: used to prove that nothing of a
    job is left running. Returns psutil.Process objects."""
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


def run_job(train_args: Sequence[str], *, module: str, nodes: int = 1, nproc_per_node: int = 2,
            network: "TwoNodeNetwork | None" = None, max_restarts: int = 0, timeout: float = 240.0,
            env: dict[str, str] | None = None) -> JobResult:
    """Run ``torchrun ... -m <module> <train_args> --output DIR`` as one or several "nodes" on this
    machine, and collect every rank's results (each rank writes ``DIR/rank<RANK>.json``).

    - ``nodes == 1``: ``torchrun --standalone --nproc-per-node=N`` (its own c10d store on a free
      port).
    - ``nodes >= 2``: ``nodes`` agents with ``--nnodes=nodes`` and a c10d rendezvous; agent 0
      hosts the store (``is_host=1``) on a free port. Without ``network``: everything on
      loopback (``127.0.0.1``, ``--local-addr=127.0.0.1``, ``GLOO_SOCKET_IFNAME`` =
      :func:`helpers.engine.loopback_interface`: ``lo``, ``lo0`` on macOS). With a
      :class:`TwoNodeNetwork` (``nodes == 2``): agent ``i`` runs inside namespace ``i``,
      advertises ``network.addresses[i]``, the store is at ``addresses[0]`` and gloo uses the
      veth interface, so every byte between the nodes crosses it.

    Every agent gets ``OMP_NUM_THREADS`` = :func:`helpers.engine.internal.threads_per_rank` of all
    processes on this host (the launcher's rule), plus ``env``. ``--output`` and torchrun's
    ``--log-dir`` are added (a temporary folder, read back and removed).

    Args:
        train_args: options for ``module`` (e.g. ``["--max-steps", "50"]``).
        module: the entry module every rank runs; it must accept ``--output DIR``.
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
    job_env = {"OMP_NUM_THREADS": str(threads_per_rank(nodes * nproc_per_node))}
    with tempfile.TemporaryDirectory(prefix="ddp-lab-job-") as tmp:
        out, logs = os.path.join(tmp, "out"), os.path.join(tmp, "torchrun-logs")
        args = [*map(str, train_args), "--output", out]
        if nodes == 1:
            job_env["GLOO_SOCKET_IFNAME"] = loopback_interface()
            commands = [torchrun_command(args, module=module, nproc_per_node=nproc_per_node, standalone=True,
                                         max_restarts=max_restarts, log_dir=logs)]
        else:
            rdzv_id = f"ddp-lab-{secrets.token_hex(4)}"
            if network is None:
                addrs, prefixes = ["127.0.0.1"] * nodes, [[]] * nodes
                job_env["GLOO_SOCKET_IFNAME"] = loopback_interface()
                port = free_port("127.0.0.1")
            else:
                addrs, prefixes = list(network.addresses), [network.prefix(i) for i in range(2)]
                job_env["GLOO_SOCKET_IFNAME"] = network.interface
                port = free_port("127.0.0.1")  # a fresh namespace has no listeners: any port is free there
            commands = [torchrun_command(args, module=module, nnodes=nodes, nproc_per_node=nproc_per_node,
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


def shell_join(argv: Sequence[str]) -> str:
    """``argv`` as one shell line (for printing a command a cell ran)."""
    return " ".join(shlex.quote(str(a)) for a in argv)
