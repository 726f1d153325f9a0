"""Starting torchrun agents from Python (a notebook cell or a test), and reading what they did.

- :func:`cluster_commands`: the launch commands of an entry module (one node, several nodes, SLURM), as text.
- :func:`torchrun_command`: the argv of one torchrun agent (one "node").
- :func:`run_agents`: start agents as subprocesses, wait with a timeout, leave no agent or worker
  behind; :class:`AgentRun` is what one agent did, :func:`failure_report` parses the root cause
  torchrun prints when a job fails.
- :func:`run_job`: an entry module under torchrun, as one or several "nodes" on this machine
  (loopback, or a :class:`helpers.engine.cluster.netns.TwoNodeNetwork`), every rank's results read back
  (:class:`JobResult`); :func:`processes_matching` finds anything of a job still running.

Every function that starts or prints a job takes the entry module as ``module=`` (the engine names
no course module). References: torchrun https://pytorch.org/docs/stable/elastic/run.html; rendezvous
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
    """The torchrun commands that run ``module`` (``-m``, with ``args``) as shell text: ``{"single node": ...,
    "multi-node (run on every node)": ..., "SLURM batch script": ...}``. ``host``, ``port``: the first
    node's rendezvous store; ``rdzv_id``: the job id every node shares (SLURM: ``$SLURM_JOB_ID``)."""
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
    """The argv of one torchrun agent: ``[*prefix, sys.executable, "-m", "helpers.engine.cluster.torchrun", ...]``
    (torchrun with this interpreter, its stores only on the addresses named here).

    Args:
        entry_args: arguments after ``module`` (``None``: ``entry_args[0]`` is a script path).
        standalone: one node, a private c10d store on 127.0.0.1; else ``rdzv_endpoint`` ``"HOST:PORT"``.
        is_host: whether this agent hosts the store (``None``: torchrun guesses from the host name).
        local_addr: the address this node advertises (``--local-addr``) and its workers' store uses.
        rdzv_timeout_s: seconds the agents wait for each other; ``monitor_interval``: seconds.
        log_dir: torchrun's per-attempt files (default: a ``/tmp/torchelastic_*`` it never removes).
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
    """What one torchrun agent (one "node") did: ``returncode`` (``None``: killed at the timeout,
    ``timed_out``), ``seconds`` from the start of all agents to its exit, ``stdout``, ``stderr``."""

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
    """Start one torchrun agent per argv of ``commands`` at once, each in its own session (``env``
    added, ``PYTHONPATH`` the repository root, ``cwd`` default the root); one :class:`AgentRun` each.

    Every descendant is recorded while they run, so however the call ends (``timeout`` seconds:
    killed, ``timed_out=True``, no exception; an interrupt) nothing is left: SIGTERM, then SIGKILL.
    ``echo``: print each agent's output, prefixed ``[node i]``."""
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
    """Every ``rank<R>.json`` an entry module wrote with ``--output DIR``, in rank order; FileNotFoundError
    if there is none (the job failed before writing)."""
    paths = sorted(Path(output_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not paths:
        raise FileNotFoundError(f"no rank*.json in {output_dir}: the job wrote no results (see its output)")
    return [json.loads(p.read_text()) for p in paths]


def failure_report(run: AgentRun) -> dict[str, Any] | None:
    """torchrun's ``Root Cause (first observed failure)`` block parsed: ``{"rank", "local_rank",
    "exitcode", "error"`` (the traceback's last line), ``"text"`` (the block)}; ``None`` if none."""
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
    """Every other process on this machine whose command line contains ``marker`` (psutil.Process)."""
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
    """One job of :func:`run_job`: ``agents`` (:class:`AgentRun` per node), ``ranks`` (each rank's
    ``rank<R>.json``; ``[]`` if none), ``marker`` (in every command line of the job), ``commands`` (shell text)."""

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
    """Run ``torchrun ... -m <module> <train_args> --output DIR`` as ``nodes`` "nodes" on this machine; every
    rank's ``DIR/rank<RANK>.json`` read back (:class:`JobResult`).

    One node: ``--standalone``. Several: a c10d rendezvous, agent 0 hosting the store, on loopback
    (``GLOO_SOCKET_IFNAME`` = :func:`~helpers.engine.processes.loopback_interface`), or with ``network``
    (2 nodes) agent ``i`` in namespace ``i`` at ``network.addresses[i]``, gloo on the veth, so every byte
    between the nodes crosses it. Each agent gets ``OMP_NUM_THREADS`` by the launcher's rule and ``env``;
    ``timeout``: seconds (:func:`run_agents`).

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
