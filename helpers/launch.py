"""The notebook-safe DDP launcher: the one way the notebooks start distributed workers.

``launch(fn, world_size, ...)`` starts ``world_size`` fresh processes, initialises the default
process group in each, calls ``fn(rank, world_size, *args, **kwargs)`` and returns the list of
return values in rank order. It is built on torch's elastic agent (the engine behind
``torchrun``, ``torch.distributed.launcher.api.elastic_launch``), which picks a free port through
a c10d rendezvous, sets the same environment variables torchrun sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and starts workers with ``spawn``. On top of it
this module adds what a notebook needs:

- worker stdout/stderr relayed into the calling cell line by line, prefixed ``[rank r]``;
- a worker error re-raised in the caller within seconds as :class:`WorkerError`, naming the
  rank, the original exception type and message, and the worker's traceback;
- ``timeout`` bounding the whole launch (gloo's default collective timeout is 30 minutes);
- no worker process left behind on success, error, timeout or KeyboardInterrupt ("interrupt
  kernel"), and the kernel's own signal handlers left untouched (the agent runs in a helper
  thread, so torchelastic never installs its SIGINT/SIGTERM handlers in the kernel);
- bad input refused before any process starts, with a message saying what to do.

The same worker function runs unchanged under ``torchrun``: see :func:`main_from_env`.

Introduced in notebook 01. Reference: https://pytorch.org/docs/stable/elastic/run.html and
``torch/distributed/launcher/api.py``.
"""

from __future__ import annotations

import datetime
import glob
import importlib
import json
import logging
import os
import pickle
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from typing import Any, Callable

__all__ = [
    "launch",
    "main_from_env",
    "worker_device",
    "resolve_backend",
    "LaunchError",
    "WorkerError",
    "LaunchTimeout",
    "OversubscriptionWarning",
    "MAX_RANKS_PER_CPU",
    "BACKENDS",
]

#: Backends :func:`launch` accepts (``None`` chooses one).
BACKENDS = ("gloo", "nccl")

#: ``world_size`` above ``MAX_RANKS_PER_CPU * os.cpu_count()`` is refused; above the CPU count
#: it is allowed with an :class:`OversubscriptionWarning` (ranks share cores: correct results,
#: meaningless timings).
MAX_RANKS_PER_CPU = 8

_POLL_S = 0.05  # how often the caller relays output and checks the workers (seconds)
_KILL_GRACE_S = 3.0  # SIGTERM -> SIGKILL grace when ending workers (seconds)
_VANISH_GRACE_S = 1.0  # a rank gone without a result for this long is reported (seconds)


class LaunchError(ValueError):
    """Bad input to :func:`launch`, raised before any process starts."""


class WorkerError(RuntimeError):
    """A worker raised, exited without a result, or was killed.

    Attributes:
        rank: the rank that failed first (the root cause).
        exc_type: the original exception's type name (e.g. ``"ZeroDivisionError"``), or a
            description such as ``"killed by SIGKILL"``.
        message: the original exception's message.
        traceback: the worker's formatted traceback (``""`` if the worker died without one).
        other_ranks: ``{rank: summary}`` of the other ranks that failed or were ended.
    """

    def __init__(self, rank: int, exc_type: str, message: str, tb: str, other_ranks: dict | None = None):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback = tb
        self.other_ranks = dict(other_ranks or {})
        text = f"rank {rank} failed with {exc_type}: {message}"
        if self.other_ranks:
            others = "; ".join(f"rank {r}: {s}" for r, s in sorted(self.other_ranks.items()))
            text += f"\n(other ranks: {others})"
        if tb:
            text += f"\n\n--- traceback from rank {rank} ---\n{tb.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.message, self.traceback, self.other_ranks))


class LaunchTimeout(TimeoutError):
    """The launch ran past its ``timeout``; every worker was ended.

    Attributes:
        timeout: the limit in seconds.
        ranks_not_finished: ranks whose ``fn`` had not returned when time ran out.
    """

    def __init__(self, timeout: float, ranks_not_finished: list[int]):
        self.timeout = timeout
        self.ranks_not_finished = list(ranks_not_finished)
        super().__init__(
            f"launch timed out after {timeout:g} s; ranks not finished: {self.ranks_not_finished}. "
            "A rank that skips a collective (all_reduce, barrier, DDP's backward) leaves the others "
            "waiting forever: check that every rank makes the same collective calls in the same "
            "order, or raise `timeout` if the work is simply long. All workers were ended."
        )

    def __reduce__(self):
        return (type(self), (self.timeout, self.ranks_not_finished))


class OversubscriptionWarning(UserWarning):
    """More ranks than CPU cores: ranks share cores, so timings are not meaningful."""


# ----------------------------------------------------------------------------------------------
# input checks (all before any process starts)
# ----------------------------------------------------------------------------------------------

def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise LaunchError(
            f"world_size must be a positive int (the number of processes), got {world_size!r} "
            f"of type {type(world_size).__name__}. Pass e.g. world_size=2."
        )
    if world_size < 1:
        raise LaunchError(f"world_size must be >= 1, got {world_size}. Pass e.g. world_size=2.")
    cpus = os.cpu_count() or 1
    if world_size > MAX_RANKS_PER_CPU * cpus:
        raise LaunchError(
            f"world_size={world_size} is more than {MAX_RANKS_PER_CPU} ranks per CPU core on this "
            f"machine ({cpus} cores); that many processes would thrash memory and the scheduler. "
            f"Use world_size <= {MAX_RANKS_PER_CPU * cpus}."
        )
    if world_size > cpus:
        warnings.warn(
            f"world_size={world_size} ranks on {cpus} CPU cores: ranks share cores. Results are "
            "correct, but timings are not meaningful (oversubscription).",
            OversubscriptionWarning,
            stacklevel=3,
        )
    return world_size


def _check_importable(fn: Any) -> None:
    """Refuse functions a spawned process cannot import (lambdas, notebook functions, closures)."""
    if not callable(fn):
        raise LaunchError(f"fn must be a function, got {fn!r} of type {type(fn).__name__}.")
    target = getattr(fn, "func", fn)  # functools.partial: check the wrapped function
    name = getattr(target, "__qualname__", getattr(target, "__name__", repr(target)))
    module = getattr(target, "__module__", None)
    where = ("Put it in a module, e.g. helpers/my_workers.py, as a top-level `def`, then "
             "`from helpers.my_workers import my_fn` and launch that.")
    if getattr(target, "__name__", "") == "<lambda>":
        raise LaunchError(f"fn is a lambda; spawned worker processes can only run functions they can import. {where}")
    if module in (None, "__main__", "__mp_main__"):
        raise LaunchError(
            f"fn {name!r} is defined in __main__ (a notebook cell or an interactive session); spawned "
            f"worker processes start a fresh interpreter and cannot import it. {where}"
        )
    if "<locals>" in name:
        raise LaunchError(f"fn {name!r} is defined inside another function; workers cannot import it. {where}")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # noqa: BLE001 - any failure means "not importable"
        raise LaunchError(f"fn {module}.{name} cannot be imported ({type(e).__name__}: {e}). {where}") from None
    if obj is not target:
        raise LaunchError(f"{module}.{name} does not refer to the function passed (was it redefined?). {where}")


def _check_picklable(args: tuple, kwargs: dict) -> None:
    for where, value in [*((f"positional argument {i}", a) for i, a in enumerate(args)),
                         *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]:
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            raise LaunchError(
                f"{where} ({type(value).__name__}) cannot be pickled to send to the workers: "
                f"{type(e).__name__}: {e}. Pass plain data (numbers, strings, tensors, dataclasses) "
                "and build open files, locks, models on devices etc. inside the worker."
            ) from None


def resolve_backend(backend: str | None, world_size: int) -> str:
    """Choose or check the process-group backend.

    ``None`` gives ``"nccl"`` when CUDA has at least ``world_size`` GPUs, else ``"gloo"`` (CPU).

    Raises:
        LaunchError: unknown backend, or ``"nccl"`` without one GPU per rank.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= world_size else "gloo"
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise LaunchError(f"unknown backend {backend!r}; use one of {BACKENDS} or None to choose automatically.")
    backend = backend.lower()
    if backend == "nccl" and gpus < world_size:
        raise LaunchError(
            f"backend 'nccl' needs one CUDA GPU per rank: world_size={world_size} but this machine has "
            f"{gpus} GPU(s). Use backend='gloo' (runs on CPU) or backend=None to choose automatically."
        )
    return backend


# ----------------------------------------------------------------------------------------------
# inside a worker
# ----------------------------------------------------------------------------------------------

def worker_device():
    """The device this rank should use: ``cuda:<local_rank>`` under nccl, else ``cpu``.

    Returns:
        torch.device
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _init_process_group(backend: str | None, timeout_s: float | None) -> None:
    import torch
    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= int(
            os.environ.get("LOCAL_WORLD_SIZE", world_size)) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kw = {}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=max(1.0, float(timeout_s)))
    dist.init_process_group(backend=backend, **kw)


def main_from_env(fn: Callable, *args, backend: str | None = None, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` in a process started by ``torchrun``.

    Reads ``RANK`` and ``WORLD_SIZE`` set by torchrun, initialises the default process group
    (``backend=None``: nccl with enough GPUs, else gloo), calls ``fn`` and destroys the group.
    This is how a worker written for :func:`launch` runs unchanged on a cluster::

        torchrun --standalone --nproc-per-node=2 -m helpers.some_module

    Returns:
        whatever ``fn`` returns on this rank.
    """
    import torch.distributed as dist

    _init_process_group(backend, None)
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args, **kwargs)
    finally:
        dist.destroy_process_group()


def _write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _worker_entry(fn, args, kwargs, backend, run_dir, timeout_s, threads):
    """What each spawned process runs (via the elastic agent): set up, call ``fn``, report."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except Exception:  # noqa: BLE001 - not a TextIOWrapper: leave it
            pass
    _write_json(os.path.join(run_dir, f"pid.{rank}"), {"pid": os.getpid()})
    try:
        import torch
        import torch.distributed as dist

        if threads and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(threads)
        _init_process_group(backend, timeout_s)
        result = fn(rank, world_size, *args, **kwargs)
        try:
            pickle.dumps(result)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"rank {rank} returned a {type(result).__name__} that cannot be pickled back to the "
                f"caller ({type(e).__name__}: {e}); return plain data or CPU tensors."
            ) from None
        _write_json(os.path.join(run_dir, f"done.{rank}"), {"time": time.time()})
        if dist.is_initialized():
            dist.barrier()  # no rank tears the group down while another is still in a collective
            dist.destroy_process_group()
    except BaseException as e:
        _write_json(os.path.join(run_dir, f"error.{rank}"), {
            "rank": rank,
            "type": type(e).__name__,
            "message": str(e) if not isinstance(e, SystemExit) else f"sys.exit({e.code!r})",
            "traceback": traceback.format_exc(),
            "time": time.time(),
        })
        sys.stdout.flush()
        sys.stderr.flush()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    return result


# ----------------------------------------------------------------------------------------------
# in the caller
# ----------------------------------------------------------------------------------------------

class _Relay:
    """Copies worker stdout/stderr log files into the caller's streams, prefixed ``[rank r]``."""

    _pattern = re.compile(r"attempt_\d+/(\d+)/(stdout|stderr)\.log$")

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.files: dict[str, list] = {}  # path -> [rank, stream name, offset, pending bytes]

    def poll(self, final: bool = False) -> None:
        for path in glob.glob(os.path.join(self.log_dir, "*", "attempt_*", "*", "std*.log")):
            if path not in self.files:
                m = self._pattern.search(path.replace(os.sep, "/"))
                if m:
                    self.files[path] = [int(m.group(1)), m.group(2), 0, b""]
        for path, state in sorted(self.files.items(), key=lambda kv: (kv[1][0], kv[1][1])):
            rank, name, offset, pending = state
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            state[2] = offset + len(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            if final and pending:
                lines.append(pending)
                pending = b""
            state[3] = pending
            if lines:
                out = sys.stdout if name == "stdout" else sys.stderr
                text = "".join(
                    f"[rank {rank}] {line.decode('utf-8', 'replace').rsplit(chr(13), 1)[-1]}\n"
                    for line in lines
                )
                out.write(text)
                out.flush()


def _read_markers(run_dir: str, kind: str) -> dict[int, dict]:
    found = {}
    for path in glob.glob(os.path.join(run_dir, f"{kind}.*")):
        suffix = path.rsplit(".", 1)[-1]
        if suffix.isdigit():
            try:
                with open(path) as f:
                    found[int(suffix)] = json.load(f)
            except (OSError, ValueError):
                pass
    return found


def _worker_processes(run_dir: str):
    """The live worker processes (and anything they started), found through their pid files."""
    import psutil

    procs = []
    for rank, info in _read_markers(run_dir, "pid").items():
        try:
            p = psutil.Process(info["pid"])
            procs.append((rank, p))
            procs.extend((rank, c) for c in p.children(recursive=True))
        except psutil.Error:
            pass
    return procs


def _spawned_since(before: set[int]):
    """Processes started by ``multiprocessing`` below this one since ``before`` (a pid set),
    except the resource tracker (one per caller process, shared by all launches)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in before:
            continue
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing" in cmd and "resource_tracker" not in cmd:
            found.append((-1, p))
    return found


def _end_processes(procs) -> None:
    import psutil

    alive = []
    for _, p in procs:
        try:
            p.terminate()
            alive.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=_KILL_GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=_KILL_GRACE_S)


def _is_dead(p) -> bool:
    import psutil

    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class _QuietElastic:
    """Silence torchelastic's and torch.multiprocessing's own logging during a launch (we raise our own, clearer errors)."""

    def __enter__(self):
        self.loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
        self.levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.setLevel(logging.CRITICAL)
        self.env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
        return self

    def __exit__(self, *exc):
        for lg, level in zip(self.loggers, self.levels):
            lg.setLevel(level)
        if self.env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = self.env
        return False


def launch(fn: Callable, world_size: int, *args, backend: str | None = None,
           timeout: float | None = 300.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes.

    Each process gets the environment torchrun gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), a default process group already initialised with
    ``backend`` (destroyed after ``fn`` returns), and, unless ``OMP_NUM_THREADS`` is set,
    ``torch.set_num_threads(max(1, os.cpu_count() // world_size))`` so ranks do not fight over
    cores. Use :func:`worker_device` inside ``fn`` for the rank's device.

    Args:
        fn: an importable, top-level function (defined in a module such as ``helpers/...``,
            never in a notebook cell: spawned processes cannot import a notebook).
        world_size: number of processes (ranks), a positive int.
        *args, **kwargs: passed to ``fn`` after ``rank, world_size``; must be picklable.
        backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per rank) or ``None``: nccl when CUDA has at
            least ``world_size`` GPUs, else gloo.
        timeout: seconds for the whole launch, start-up included (``None``: no limit). It also
            bounds each collective inside the workers.

    Returns:
        list: ``fn``'s return value on each rank, in rank order (``results[r]`` from rank ``r``).

    Raises:
        LaunchError: bad input (before any process starts).
        WorkerError: a rank raised, exited without returning, or was killed; the other ranks
            are ended. Names the rank and carries its traceback.
        LaunchTimeout: the launch ran past ``timeout``; names the ranks that had not finished.
        KeyboardInterrupt: the caller was interrupted; every worker was ended first.

    Worker stdout and stderr appear in the caller's streams line by line, prefixed ``[rank r]``.
    """
    world_size = _check_world_size(world_size)
    _check_importable(fn)
    backend = resolve_backend(backend, world_size)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise LaunchError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")
    _check_picklable((fn,), {})
    _check_picklable(args, kwargs)

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    import psutil

    threads = max(1, (os.cpu_count() or 1) // world_size)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddp-lab-launch-") as run_dir, _QuietElastic():
        log_dir = os.path.join(run_dir, "logs")
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            run_id=f"ddp-lab-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # port 0: the OS picks a free port, never a fixed one
            rdzv_configs={"timeout": int(min(timeout or 900, 900)) + 1},
            local_addr="127.0.0.1",
            max_restarts=0,
            monitor_interval=_POLL_S,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL),
            shutdown_timeout=int(_KILL_GRACE_S),
        )
        outcome: dict[str, Any] = {}

        def agent() -> None:
            try:
                outcome["results"] = elastic_launch(config, _worker_entry)(
                    fn, args, kwargs, backend, run_dir, timeout, threads)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                outcome["error"] = e

        thread = threading.Thread(target=agent, name="ddp-lab-elastic-agent", daemon=True)
        relay = _Relay(log_dir)
        reason: tuple | None = None  # why we ended the workers ourselves
        vanished: dict[int, float] = {}  # rank -> when it was first seen gone without a result
        thread.start()
        try:
            while thread.is_alive():
                thread.join(_POLL_S)
                relay.poll()
                if timeout is not None and time.monotonic() - start > timeout:
                    reason = ("timeout",)
                    break
                # A rank gone without a marker: a non-zero exit or a signal is reported by the
                # agent within a monitor interval; exit code 0 never is, so after a grace period
                # we report it ourselves.
                gone = set(_vanished_ranks(run_dir))
                vanished = {r: vanished.get(r, time.monotonic()) for r in gone}
                late = sorted(r for r, t0 in vanished.items() if time.monotonic() - t0 > _VANISH_GRACE_S)
                if late:
                    reason = ("vanished", late[0])
                    break
        except KeyboardInterrupt:
            reason = ("interrupt",)
        finally:
            if reason is not None or thread.is_alive():
                _end_processes(_worker_processes(run_dir))
            thread.join(30.0)
            # anything still there, whatever happened (also workers that died before writing a pid file)
            _end_processes(_worker_processes(run_dir) + _spawned_since(before))
            relay.poll(final=True)
        done = _read_markers(run_dir, "done")
        errors = _read_markers(run_dir, "error")

        if reason == ("interrupt",):
            raise KeyboardInterrupt(f"launch interrupted; all {world_size} workers were ended")
        if reason == ("timeout",):
            raise LaunchTimeout(float(timeout), [r for r in range(world_size) if r not in done])
        if reason is not None:  # a worker exited without a result or an error
            rank = reason[1]
            raise WorkerError(rank, "exited without returning a result",
                              "the process ended with exit code 0 before fn returned or raised (e.g. "
                              "os._exit(0)); the other ranks were ended", "",
                              {r: "ended by the launcher" for r in range(world_size) if r != rank})
        if "error" in outcome:
            _raise_worker_error(outcome["error"], errors, set(_read_markers(run_dir, "pid")), set(done),
                                world_size, ChildFailedError)
        results = outcome["results"]
        return [results[r] for r in range(world_size)]


def _vanished_ranks(run_dir: str) -> list[int]:
    """Ranks whose process is gone without a done or error marker (e.g. after ``os._exit(0)``).

    The elastic agent waits forever for such a rank's return value, so the caller must notice.
    """
    import psutil

    finished = set(_read_markers(run_dir, "done")) | set(_read_markers(run_dir, "error"))
    gone = []
    for rank, info in _read_markers(run_dir, "pid").items():
        if rank not in finished:
            try:
                if psutil.Process(info["pid"]).status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                pass
            gone.append(rank)
    return gone


#: Errors a rank raises because *another* rank died (it lost its peer), never a root cause.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def _is_secondary(err: dict) -> bool:
    return any(s in err["message"] for s in _SECONDARY)


def _raise_worker_error(error: BaseException, errors: dict[int, dict], started: set[int], done: set[int],
                        world_size: int, child_failed):
    """Turn what the ranks left behind into one WorkerError naming the root-cause rank.

    Root cause, in order: the earliest error a rank raised itself; else a rank the agent saw die
    (signal or exit code) without raising; else a started rank that vanished without a word
    while others lost their connection to it; else the earliest secondary error.
    """
    failures = error.failures if isinstance(error, child_failed) else {}
    primary = [e for e in errors.values() if not _is_secondary(e)]
    silent_dead = {r: f for r, f in failures.items() if r not in errors}
    vanished = sorted(r for r in started if r not in errors and r not in done)

    def others_except(rank):
        others = {r: f"{e['type']}: {e['message'][:200]}" for r, e in errors.items() if r != rank}
        others.update({r: "ended by the launcher" for r in range(world_size) if r != rank and r not in others})
        return others

    if primary:
        first = min(primary, key=lambda e: e["time"])
        raise WorkerError(first["rank"], first["type"], first["message"], first["traceback"],
                          others_except(first["rank"])) from None
    if silent_dead:
        rank, failure = min(silent_dead.items(), key=lambda kv: kv[1].timestamp)
        if failure.exitcode is not None and failure.exitcode < 0:
            kind = f"killed by {failure.signal_name()}"
            message = f"the process received {failure.signal_name()} (exit code {failure.exitcode})"
        else:
            kind = "exited"
            message = f"the process exited with code {failure.exitcode} before fn returned"
        if rank not in started:
            message += (" while starting, before fn was called (its stderr above says why). From a "
                        "script, put the launch under `if __name__ == '__main__':`: spawned processes "
                        "re-import the main script.")
        raise WorkerError(rank, kind, message, "", others_except(rank)) from None
    if errors and vanished:
        rank = vanished[0]
        raise WorkerError(rank, "exited without returning a result",
                          "the process ended without returning or raising (killed by a signal such as "
                          "SIGKILL, e.g. by the out-of-memory killer, or os._exit()); the other ranks "
                          "lost their connection to it", "", others_except(rank)) from None
    if errors:
        first = min(errors.values(), key=lambda e: e["time"])
        raise WorkerError(first["rank"], first["type"], first["message"], first["traceback"],
                          others_except(first["rank"])) from None
    raise error
