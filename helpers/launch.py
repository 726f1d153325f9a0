"""The notebook-safe DDP launcher: the one way the notebooks start distributed workers.

``launch(fn, world_size, ...)`` starts ``world_size`` fresh processes, initialises the default
process group in each, calls ``fn(rank, world_size, *args, **kwargs)`` and returns the list of
return values in rank order. It is built on torch's elastic agent (the engine behind
``torchrun``, ``torch.distributed.launcher.api.elastic_launch``), which picks a free port through
a c10d rendezvous, sets the same environment variables torchrun sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and starts workers with ``spawn`` (never
``fork``: a forked child of a process that has touched CUDA fails with "Cannot re-initialize
CUDA in forked subprocess"). On top of it this module adds what a notebook needs:

- code written in a notebook cell runs: ``fn``, its arguments, and the functions, lambdas,
  closures and classes (an ``nn.Module`` subclass, a ``Dataset``) it uses that are defined in
  ``__main__`` (a cell, an interactive session) are sent to the ranks *by value* with
  ``cloudpickle`` (the library Dask, Ray and ipyparallel use for this); functions and classes of
  importable modules (``helpers``, ``torch``) go by reference, as plain ``pickle`` sends them;
- what cannot be sent to another process (an open file, a lock, a socket, a generator, a CUDA
  tensor) is refused before any process starts, naming the variable that holds it;
- worker stdout/stderr relayed into the calling cell line by line, prefixed ``[rank r]``;
- a worker error re-raised in the caller within seconds as :class:`WorkerError`, naming the
  rank, the original exception type and message, and the worker's traceback;
- ``timeout`` bounding the whole launch (gloo's default collective timeout is 30 minutes);
- no worker process left behind on success, error, timeout or KeyboardInterrupt ("interrupt
  kernel"), and the kernel's own signal handlers left untouched (the agent runs in a helper
  thread, so torchelastic never installs its SIGINT/SIGTERM handlers in the kernel); on Linux
  each rank also asks the kernel for a parent-death signal (``PR_SET_PDEATHSIG``), so the ranks
  die with the launching process even when it is SIGKILLed (the out-of-memory killer);
- bad input refused before any process starts, with a message saying what to do.

The same worker function, once moved into a module, runs unchanged under ``torchrun``: see
:func:`main_from_env`. :mod:`helpers.mp` runs code written for ``torch.multiprocessing.spawn``
(the official DDP tutorial's) on the same machinery.

Introduced in notebook 01. Reference: https://pytorch.org/docs/stable/elastic/run.html,
``torch/distributed/launcher/api.py`` and https://github.com/cloudpipe/cloudpickle.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
import warnings
from typing import Any, Callable

from helpers import procs
from helpers.procs import main_from_env

__all__ = [
    "launch",
    "main_from_env",
    "worker_device",
    "resolve_backend",
    "threads_per_rank",
    "LaunchError",
    "WorkerError",
    "LaunchTimeout",
    "OversubscriptionWarning",
    "MAX_RANKS_PER_CPU",
    "BACKENDS",
]

#: Backends :func:`launch` accepts (``None`` chooses one).
BACKENDS = procs.BACKENDS

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

def _check_world_size(world_size: Any, name: str = "world_size") -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise LaunchError(
            f"{name} must be a positive int (the number of processes), got {world_size!r} "
            f"of type {type(world_size).__name__}. Pass e.g. {name}=2."
        )
    if world_size < 1:
        raise LaunchError(f"{name} must be >= 1, got {world_size}. Pass e.g. {name}=2.")
    cpus = os.cpu_count() or 1
    if world_size > MAX_RANKS_PER_CPU * cpus:
        raise LaunchError(
            f"{name}={world_size} is more than {MAX_RANKS_PER_CPU} ranks per CPU core on this "
            f"machine ({cpus} cores); that many processes would thrash memory and the scheduler. "
            f"Use {name} <= {MAX_RANKS_PER_CPU * cpus}."
        )
    if world_size > cpus:
        warnings.warn(
            f"{name}={world_size} ranks on {cpus} CPU cores: ranks share cores. Results are "
            "correct, but timings are not meaningful (oversubscription).",
            OversubscriptionWarning,
            stacklevel=3,
        )
    return world_size


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise LaunchError(f"fn must be callable (a function), got {fn!r} of type {type(fn).__name__}.")


def _by_value(obj: Any) -> bool:
    """True when cloudpickle sends ``obj`` (a function or class) by value: it is defined in
    ``__main__`` (a notebook cell), inside another function, or is a lambda; False when the
    worker can import it by name (helpers, torch, a test module)."""
    import cloudpickle

    try:
        return not cloudpickle.cloudpickle._should_pickle_by_reference(obj)
    except Exception:  # noqa: BLE001 - an odd object: let the pickling attempt decide
        return False


def _code_names(code) -> set[str]:
    """Global names a code object (and the functions, lambdas, comprehensions nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _kind_of(value: Any) -> str | None:
    """Why ``value`` cannot be sent to another process, or None if nothing is known against it."""
    torch = sys.modules.get("torch")  # no torch imported: no tensor or module to check
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu" and value.device.type != "meta":
            return f"a {value.device.type.upper()} tensor on {value.device} (torch.Tensor)"
        return None
    if torch is not None and isinstance(value, torch.nn.Module):
        for what, tensors in (("parameters", value.parameters()), ("buffers", value.buffers())):
            for t in tensors:
                if t.device.type not in ("cpu", "meta"):
                    return f"an nn.Module ({type(value).__name__}) with {what} on {t.device}"
        return None
    if isinstance(value, (types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType)):
        return f"a generator ({type(value).__name__})"
    if isinstance(value, io.IOBase):
        return f"an open file ({type(value).__module__}.{type(value).__name__})"
    if isinstance(value, socket.socket):
        return f"a socket ({type(value).__module__}.{type(value).__name__})"
    if isinstance(value, _LOCK_TYPES):
        return f"a lock ({type(value).__module__}.{type(value).__name__})"
    return None


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Semaphore,
               threading.Event)

_SEND_ADVICE = {
    "tensor": "Move it to the CPU first (`x.cpu()`, `model.cpu()`) or create it inside the worker on "
              "`worker_device()`.",
    "other": "Open files, locks, sockets and generators belong to one process: create it inside the "
             "worker function (each rank opens its own) and pass plain data (a path, numbers, CPU "
             "tensors) instead.",
}


def _named_values(fn: Any, args: tuple, kwargs: dict):
    """``(where, value)`` for everything sent to the workers that a learner named: each argument,
    and, for a function sent by value, the globals it uses and its closure variables (recursively
    through the cell-defined functions and classes it uses)."""
    for i, a in enumerate(args):
        yield f"positional argument {i}", a
    for k, v in kwargs.items():
        yield f"keyword argument {k!r}", v
    seen: set[int] = set()

    def refs(obj: Any, owner: str, depth: int):
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            for i, a in enumerate(obj.args):
                yield f"argument {i} of the partial {owner}", a
            for k, v in obj.keywords.items():
                yield f"keyword {k!r} of the partial {owner}", v
            yield from refs(obj.func, owner, depth + 1)
            return
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    yield from refs(f, owner, depth + 1)
            return
        if isinstance(obj, types.MethodType):
            yield f"the object {owner} is bound to", obj.__self__
            obj = obj.__func__
        if isinstance(obj, types.FunctionType):
            if not _by_value(obj):
                return
            name = f"`{obj.__qualname__}`"
            code = obj.__code__
            for g in sorted(_code_names(code)):
                if g in obj.__globals__:
                    value = obj.__globals__[g]
                    yield f"the global `{g}` used by {name}", value
                    yield from refs(value, f"`{g}`", depth + 1)
            for var, cell in zip(code.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell (assigned later)
                    continue
                yield f"the closure variable `{var}` of {name}", value
                yield from refs(value, f"`{var}`", depth + 1)
            return
        if isinstance(obj, type):
            if not _by_value(obj):
                return
            for attr, value in vars(obj).items():
                if not (attr.startswith("__") and attr.endswith("__")):
                    yield f"the class attribute `{obj.__qualname__}.{attr}`", value
                yield from refs(value, f"`{obj.__qualname__}.{attr}`", depth + 1)
            return
        if _by_value(type(obj)):  # an instance of a cell-defined class: its class and attributes
            yield from refs(type(obj), owner, depth + 1)

    yield from refs(fn, "fn", 0)


def _walk(where: str, value: Any, depth: int = 0):
    """``value`` and the items of the lists, tuples, sets and dicts inside it (two levels)."""
    yield where, value
    if depth >= 2:
        return
    if isinstance(value, dict):
        for k, v in list(value.items())[:200]:
            yield from _walk(f"{where}[{k!r}]", v, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(value)[:200]):
            yield from _walk(f"{where}[{i}]" if not isinstance(value, (set, frozenset)) else f"an item of {where}",
                             v, depth + 1)


def _refuse(where: str, kind: str, fn_name: str) -> LaunchError:
    advice = _SEND_ADVICE["tensor" if "tensor" in kind or "nn.Module" in kind else "other"]
    return LaunchError(
        f"cannot send {where} to the worker processes: it is {kind}. {advice}"
        + (f" (fn: {fn_name})" if fn_name and fn_name not in where else "")
    )


def _serialise(fn: Any, args: tuple, kwargs: dict) -> bytes:
    """``cloudpickle.dumps((fn, args, kwargs))``, after refusing, with the variable named, what
    cannot be sent to another process.

    Raises:
        LaunchError: an argument, a global, a closure variable (or an item inside one) is an open
            file, a lock, a socket, a generator or a CUDA tensor, or cannot be pickled.
    """
    import cloudpickle

    fn_name = getattr(fn, "__qualname__", type(fn).__name__)
    named = list(_named_values(fn, args, kwargs))
    for where, value in named:
        for inner_where, inner in _walk(where, value):
            kind = _kind_of(inner)
            if kind:
                raise _refuse(inner_where, kind, fn_name)
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - find which named value is the culprit
        error = e
    for where, value in [("fn", fn), *named]:
        if isinstance(value, (types.FunctionType, type)):
            continue  # their contents are named separately
        try:
            cloudpickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            raise LaunchError(
                f"cannot send {where} ({type(value).__name__}) to the worker processes: it cannot be "
                f"pickled ({type(e).__name__}: {e}). {_SEND_ADVICE['other']}"
            ) from None
    raise LaunchError(
        f"cannot send fn {fn_name!r} and its arguments to the worker processes: "
        f"{type(error).__name__}: {error}. {_SEND_ADVICE['other']}"
    ) from None


def resolve_backend(backend: str | None, world_size: int) -> str:
    """Choose or check the process-group backend (the rule lives in :func:`helpers.procs.resolve_backend`).

    ``None`` gives ``"nccl"`` when CUDA has at least ``world_size`` GPUs, else ``"gloo"`` (CPU).

    Raises:
        LaunchError: unknown backend, or ``"nccl"`` without one GPU per rank.
    """
    return procs.resolve_backend(backend, world_size, error=LaunchError)


def threads_per_rank(world_size: int) -> int:
    """CPU threads each rank gets: ``max(1, os.cpu_count() // world_size)`` (ranks do not fight
    over cores). Applied with ``torch.set_num_threads`` unless ``OMP_NUM_THREADS`` is set."""
    return max(1, (os.cpu_count() or 1) // world_size)


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


def _write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


#: Environment variables the elastic agent gives a worker that ``torch.multiprocessing.spawn``
#: does not: cleared for :mod:`helpers.mp`'s drop-in, so code that calls ``init_process_group``
#: itself with its own ``MASTER_PORT`` (the DDP tutorial's ``setup``) does not find the agent's
#: store (``TORCHELASTIC_USE_AGENT_STORE`` makes env:// rendezvous connect to it as a client).
_AGENT_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, then close the race.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that created this process exits: the launcher's
    agent thread (which starts the workers through torch's ``start_processes``) lives until every
    worker has ended, so only the death of the launching process itself triggers it. If the
    parent already died before this call, ``getppid()`` no longer names it: exit at once.
    Elsewhere than Linux this is a no-op (the launcher's own clean-up still applies).
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_peers(run_dir: str, world_size: int, poll_s: float = 0.01) -> None:
    """Return once every rank has written its ``done`` marker (or any rank its ``error`` marker).

    Uses the run's marker files, not a collective, so it never pairs with a collective a rank's
    own code left unmatched. A rank that never finishes is ended by the launcher's timeout.
    """
    while True:
        if all(os.path.exists(os.path.join(run_dir, f"done.{r}")) for r in range(world_size)):
            return
        if glob.glob(os.path.join(run_dir, "error.*")):
            return
        time.sleep(poll_s)


def _worker_entry(payload: bytes, run_dir: str, parent_pid: int, backend: str | None,
                  timeout_s: float | None, threads: int, style: str) -> bytes:
    """What each spawned process runs (via the elastic agent): set up, call ``fn``, report.

    ``payload`` is ``cloudpickle.dumps((fn, args, kwargs))``. ``style`` is ``"launch"``
    (initialise the default group, call ``fn(rank, world_size, *args, **kwargs)``) or ``"spawn"``
    (``torch.multiprocessing.spawn``'s contract: no group, ``fn(rank, *args)``). Returns the
    cloudpickled result, so a cell-defined class can come back too.
    """
    _die_with_parent(parent_pid)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except Exception:  # noqa: BLE001 - not a TextIOWrapper: leave it
            pass
    _write_json(os.path.join(run_dir, f"pid.{rank}"), {"pid": os.getpid()})
    try:
        import cloudpickle
        import torch
        import torch.distributed as dist

        if threads and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(threads)
        fn, args, kwargs = cloudpickle.loads(payload)
        if style == "spawn":
            for name in _AGENT_ENV:
                os.environ.pop(name, None)
            for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
                os.environ.pop(name, None)
            result = fn(rank, *args, **kwargs)
        else:
            procs.init_process_group_from_env(backend, timeout_s)
            result = fn(rank, world_size, *args, **kwargs)
        try:
            data = cloudpickle.dumps(result)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"rank {rank} returned a {type(result).__name__} that cannot be pickled back to the "
                f"caller ({type(e).__name__}: {e}); return plain data or CPU tensors."
            ) from None
        _write_json(os.path.join(run_dir, f"done.{rank}"), {"time": time.time()})
        if dist.is_initialized():
            if style != "spawn":
                # no rank tears the group down while another is still in a collective. Not a
                # dist.barrier(): that would pair with a collective the user's code left unmatched
                # on another rank (`if rank == 0: dist.barrier()`) and turn a hang into a
                # misleading "Connection closed by peer"; the launcher's timeout names the rank.
                _wait_for_peers(run_dir, world_size)
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
    return data


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

    found = []
    for rank, info in _read_markers(run_dir, "pid").items():
        try:
            p = psutil.Process(info["pid"])
            found.append((rank, p))
            found.extend((rank, c) for c in p.children(recursive=True))
        except psutil.Error:
            pass
    return found


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


def _end_processes(found) -> None:
    """End ``(rank, psutil.Process)`` pairs: SIGTERM, a grace period, SIGKILL (helpers.procs)."""
    procs.end_processes([p for _, p in found], _KILL_GRACE_S)


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
        fn: any callable: a function of a module (``helpers``, ``torch``: sent by reference, the
            worker imports it) or a function, lambda, closure or callable object defined in a
            notebook cell (sent by value with cloudpickle, together with the cell-defined
            functions, classes and values it uses).
        world_size: number of processes (ranks), a positive int.
        *args, **kwargs: passed to ``fn`` after ``rank, world_size``; sent with cloudpickle.
            Tensors must be on the CPU.
        backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per rank) or ``None``: nccl when CUDA has at
            least ``world_size`` GPUs, else gloo.
        timeout: seconds for the whole launch, start-up included (``None``: no limit). It also
            bounds each collective inside the workers.

    Returns:
        list: ``fn``'s return value on each rank, in rank order (``results[r]`` from rank ``r``).

    Raises:
        LaunchError: bad input, before any process starts: ``world_size`` not a positive int or
            far above the core count, an unknown backend, ``nccl`` without one GPU per rank, a
            bad ``timeout``, ``fn`` not callable, or something that cannot be sent to another
            process (an open file, a lock, a socket, a generator, a CUDA tensor, anything
            unpicklable) in an argument, a global ``fn`` uses or a closure variable; the message
            names the variable and says what to do instead.
        WorkerError: a rank raised, exited without returning, or was killed; the other ranks
            are ended. Names the rank and carries its traceback.
        LaunchTimeout: the launch ran past ``timeout``; names the ranks that had not finished.
        KeyboardInterrupt: the caller was interrupted; every worker was ended first.

    Worker stdout and stderr appear in the caller's streams line by line, prefixed ``[rank r]``.
    """
    world_size, backend, payload = _validate(fn, world_size, args, kwargs, backend, timeout)
    return _run(payload, world_size, backend, timeout, style="launch")


def _check_timeout(timeout: Any) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise LaunchError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")


def _validate(fn, world_size, args, kwargs, backend, timeout) -> tuple[int, str, bytes]:
    """Every check before any process starts; returns ``(world_size, backend, payload)``."""
    world_size = _check_world_size(world_size)
    _check_callable(fn)
    backend = resolve_backend(backend, world_size)
    _check_timeout(timeout)
    return world_size, backend, _serialise(fn, args, kwargs)


def _configure(world_size: int, run_dir: str, timeout: float | None):
    """The elastic agent's configuration: one node, a fresh port, no restarts, ``spawn``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
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
        start_method="spawn",  # never fork: see the module docstring
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs"), redirects=Std.ALL),
        shutdown_timeout=int(_KILL_GRACE_S),
    )


def _run(payload: bytes, world_size: int, backend: str | None, timeout: float | None, style: str) -> list:
    """Start the ranks, supervise them, and return their results or raise (shared with helpers.mp)."""
    import cloudpickle
    import psutil

    threads = threads_per_rank(world_size)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with tempfile.TemporaryDirectory(prefix="ddp-lab-launch-") as run_dir, _QuietElastic():
        config = _configure(world_size, run_dir, timeout)
        entry_args = (payload, run_dir, os.getpid(), backend, timeout, threads, style)
        outcome, reason = _supervise(config, entry_args, run_dir, timeout, before)
        _raise_failure(outcome, reason, run_dir, world_size, timeout)
        results = outcome["results"]
        return [cloudpickle.loads(results[r]) for r in range(world_size)]


def _supervise(config, entry_args: tuple, run_dir: str, timeout: float | None, before: set[int]):
    """Run the elastic agent in a helper thread, relay output, watch the clock and the ranks.

    The agent thread is the one that starts the workers, so it is also the parent thread their
    ``PR_SET_PDEATHSIG`` watches: it must outlive them. It does: after the agent returns every
    worker has exited, and on a timeout, a vanished rank or an interrupt the workers are ended
    before the thread is joined.

    Returns:
        ``(outcome, reason)``: outcome holds ``"results"`` or ``"error"`` from the agent; reason is
        ``None`` or why the workers were ended here: ``("timeout",)``, ``("interrupt",)``,
        ``("vanished", rank)``.
    """
    from torch.distributed.launcher.api import elastic_launch

    outcome: dict[str, Any] = {}

    def agent() -> None:
        try:
            outcome["results"] = elastic_launch(config, _worker_entry)(*entry_args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=agent, name="ddp-lab-elastic-agent", daemon=True)
    relay = _Relay(os.path.join(run_dir, "logs"))
    reason: tuple | None = None
    vanished: dict[int, float] = {}  # rank -> when it was first seen gone without a result
    thread.start()
    try:
        while thread.is_alive():
            thread.join(_POLL_S)
            relay.poll()
            if timeout is not None and time.monotonic() - start > timeout:
                reason = ("timeout",)
                break
            # A rank gone without a marker: a non-zero exit or a signal is reported by the agent
            # within a monitor interval; exit code 0 never is, so after a grace period we report
            # it ourselves.
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
    return outcome, reason


def _raise_failure(outcome: dict, reason: tuple | None, run_dir: str, world_size: int,
                   timeout: float | None) -> None:
    """Raise the caller's exception for whatever went wrong (nothing if every rank returned)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    done = _read_markers(run_dir, "done")
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
        _raise_worker_error(outcome["error"], _read_markers(run_dir, "error"),
                            set(_read_markers(run_dir, "pid")), set(done), world_size, ChildFailedError)


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
