"""Threads per rank: what each launcher leaves a rank (torchrun, mp.spawn, elastic_launch,
helpers.engine.launch), measured in real processes (notebook 05a)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from helpers.bench.launch_overhead import spawn_launch
from helpers.engine import launch
from helpers.engine.internal import QuietElastic

#: What :func:`bench_threads_by_launcher` runs in each rank (and in the plain process): prints
#: one JSON line with the rank, ``torch.get_num_threads()`` and ``OMP_NUM_THREADS`` as it found it.
THREADS_REPORT_CODE = ("import json, os, torch; print('THREADS ' + json.dumps({"
                       "'rank': int(os.environ.get('RANK', 0)), 'torch_threads': torch.get_num_threads(), "
                       "'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS')}))")


def threads_worker(rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """One rank's ``{"rank", "torch_threads", "OMP_NUM_THREADS"}`` (``None`` when unset): what
    the launcher that started this process left it. Works under ``launch``, ``mp.spawn`` and
    ``elastic_launch`` (which passes no arguments: the rank comes from ``RANK``)."""
    return {"rank": int(os.environ.get("RANK", rank)), "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def _threads_lines(text: str) -> list[dict[str, Any]]:
    """The ``THREADS {...}`` report lines of ONE process's output (never a stream that several
    processes share: their lines could run together)."""
    rows = [json.loads(line.split("THREADS ", 1)[1]) for line in text.splitlines() if line.startswith("THREADS ")]
    return sorted(rows, key=lambda r: r["rank"])


def bench_threads_by_launcher(world_size: int = 2, timeout: float = 300.0) -> dict[str, Any]:
    """Threads per rank as four launchers leave them, each measured in real processes.

    With ``OMP_NUM_THREADS`` removed from the environment the children inherit (restored after);
    the two command-line runs (plain python, torchrun) run while the other three launch:

    * ``"plain python"``: one fresh ``python -c`` (torch's own default, no launcher);
    * ``"torchrun"``: ``python -m torch.distributed.run --standalone --nproc-per-node
      world_size --no-python python -c ...`` (torchrun's CLI, ``torch/distributed/run.py``, sets
      ``OMP_NUM_THREADS=1`` when it starts more than one process per node and the variable is
      unset, and prints a warning saying so);
    * ``"torch.multiprocessing.spawn"``: :func:`spawn_launch` of :func:`threads_worker`;
    * ``"elastic_launch"``: ``torch.distributed.launcher.api.elastic_launch`` (the engine
      behind torchrun, called from Python) of :func:`threads_worker`;
    * ``"helpers.engine.launch"``: :func:`helpers.engine.launch` of :func:`threads_worker`.

    Returns:
        ``{"rows": [{"launcher", "rank", "torch_threads", "OMP_NUM_THREADS"}, ...],
        "torchrun_stderr": str, "cpu_count": int}``.

    Raises:
        subprocess.CalledProcessError / TimeoutExpired: a child failed or hung (it is killed).
    """
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    children: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ddp-lab-threads-") as log_dir:
            # the two command-line runs start first and import torch while this process runs the
            # three in-process launchers below (no launcher's result depends on another's)
            plain = _start([sys.executable, "-c", THREADS_REPORT_CODE], env, children)
            # --redirects 3: each rank's stdout/stderr go to its own file under --log-dir
            # (<log_dir>/<run id>/attempt_0/<rank>/stdout.log), so no two ranks share a stream
            tr = _start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={world_size}", f"--log-dir={log_dir}", "--redirects=3",
                         "--no-python", sys.executable, "-c", THREADS_REPORT_CODE], env, children)
            spawned = spawn_launch(threads_worker, world_size)
            # without a log_dir the agent makes a torchelastic_* folder in the temp directory and
            # leaves it there: this one is removed with the TemporaryDirectory
            with tempfile.TemporaryDirectory(prefix="ddp-lab-threads-") as elastic_logs:
                config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size,
                                      run_id=f"threads-{os.getpid()}-{time.monotonic_ns()}", rdzv_backend="c10d",
                                      rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
                                      monitor_interval=0.1, start_method="spawn",
                                      logs_specs=DefaultLogsSpecs(log_dir=elastic_logs))

                # elastic_launch installs its own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers in the calling
                # process (a notebook kernel here); put the caller's back afterwards (only the main
                # thread can change them)
                sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
                in_main = threading.current_thread() is threading.main_thread()
                handlers = {sig: signal.getsignal(sig) for sig in sigs} if in_main else {}
                try:
                    with QuietElastic():  # also puts back the TORCHELASTIC_SIGNALS_TO_HANDLE it sets in os.environ
                        got = elastic_launch(config, threads_worker)()
                finally:
                    for sig, h in handlers.items():
                        signal.signal(sig, h)
            launched = launch(threads_worker, world_size, timeout=timeout)
            plain_out = _finish(plain, timeout)
            tr_out = _finish(tr, timeout)
            rows += [{"launcher": "plain python", **r} for r in _threads_lines(plain_out.stdout)]
            logs = sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "stdout.log")))
            if len(logs) != world_size:
                raise RuntimeError(f"torchrun left {len(logs)} rank stdout logs for world_size={world_size}: {logs}")
            for path in logs:
                with open(path) as f:
                    rows += [{"launcher": "torchrun", **r} for r in _threads_lines(f.read())]
        rows += [{"launcher": "torch.multiprocessing.spawn", **r} for r in spawned]
        rows += [{"launcher": "elastic_launch", **got[r]} for r in sorted(got)]
        rows += [{"launcher": "helpers.engine.launch", **r} for r in launched]
    finally:
        for child in children:  # only after an error: a child still running is killed
            if child.poll() is None:
                child.kill()
                child.wait()
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
    return {"rows": rows, "torchrun_stderr": tr_out.stderr, "cpu_count": os.cpu_count()}


def _start(cmd: list[str], env: dict[str, str], children: list[subprocess.Popen]) -> subprocess.Popen:
    """Start ``cmd`` with its stdout and stderr captured as text; remember it in ``children``."""
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.append(child)
    return child


def _finish(child: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a child of :func:`_start`, as ``subprocess.run(..., check=True)`` would (one still
    running after ``timeout`` raises ``TimeoutExpired``; the caller kills it)."""
    out, err = child.communicate(timeout=timeout)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, child.args, out, err)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)
