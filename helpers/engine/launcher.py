"""The notebook-safe DDP launcher: ``launch(fn, world_size, ...)``, the one way the notebooks start ranks.

Built on torch's elastic agent (``torchrun``'s engine, ``elastic_launch``): a c10d rendezvous picks a
free port, each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and is forked from :mod:`helpers.engine.fork_server`'s server
(``spawn`` where that is unavailable), never from the caller (a fork of a process that touched CUDA
fails). On top of it, what a notebook needs: cell-defined code sent by value with cloudpickle
(:mod:`~helpers.engine.by_value`), what cannot be sent refused before any process starts, output
relayed as ``[rank r]`` lines (:mod:`~helpers.engine.rank_output`), a rank's error re-raised within
seconds (:mod:`~helpers.engine.errors`), a ``timeout`` that says where each rank was
(:mod:`~helpers.engine.stacks`), and no process left behind, even when the caller is SIGKILLed
(``PR_SET_PDEATHSIG`` in :mod:`~helpers.engine.rank_main`, the reaper of :mod:`~helpers.engine.run_dir`).
The agent runs in a helper thread, so the kernel's signal handlers stay untouched.

``launch()`` reads as validate -> configure -> supervise -> raise; :func:`run_ranks` is shared with
:mod:`helpers.mp`. The same worker runs unchanged under ``torchrun`` (:func:`main_from_env`).
Reference: https://pytorch.org/docs/stable/elastic/run.html and ``torch/distributed/launcher/api.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any, Callable

import cloudpickle
import psutil
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.launcher import api as elastic_api  # looked up at call time (tests wrap it)

from helpers.engine import processes as procs
from helpers.engine import stacks
from helpers.engine.by_value import serialise_call
from helpers.engine.errors import (
    LaunchError,
    LaunchInterrupted,
    LaunchTimeout,
    OversubscriptionWarning,
    WorkerError,
    worker_error,
)
from helpers.engine.fork_server import fork_server, fork_server_pid, main_without_file, socket_folder
from helpers.engine.inputs import (
    MAX_RANKS_PER_CPU,
    DefaultTimeout,
    check_callable,
    check_timeout,
    check_world_size,
    temp_folder_full,
)
from helpers.engine.processes import main_from_env
from helpers.engine.rank_main import worker_device, worker_entry
from helpers.engine.rank_output import Relay
from helpers.engine.run_dir import read_markers, run_folder

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

_POLL_S = 0.05  # how often the caller relays output and checks the workers (seconds)
_KILL_GRACE_S = 3.0  # SIGTERM -> SIGKILL grace when ending workers (seconds)
_VANISH_GRACE_S = 1.0  # a rank gone without a result for this long is reported (seconds)
#: Start-up (the ranks' processes, unpickling ``fn`` and its arguments, the process group) may take
#: ``max(timeout, STARTUP_S)`` seconds before ``timeout`` starts counting (a loaded machine is slow).
STARTUP_S = 120.0


#: :func:`launch`'s default ``timeout``, in seconds.
DEFAULT_TIMEOUT_S = DefaultTimeout(300.0)


def launch(fn: Callable, world_size: int, *args, backend: str | None = None,
           timeout: float | None = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes: ``results[r]``
    is rank ``r``'s return value. Each rank gets torchrun's environment, a default group on
    ``backend`` (``None``: :func:`resolve_backend`) and :func:`threads_per_rank` CPU threads; its
    output shows as ``[rank r]`` lines. ``fn`` and its arguments go by reference (a module's) or by
    value (cloudpickle: a cell's function, lambda or closure; CPU tensors). ``timeout``: seconds
    once every rank runs ``fn`` (``None``: no limit); start-up may take ``max(timeout, STARTUP_S)``.

    Raises:
        LaunchError: before any process starts: bad input, something that cannot be sent (the
            variable named), or a full temp folder (also once it filled up during the launch).
        WorkerError: a rank raised, exited without returning or was killed; the others were ended.
        LaunchTimeout, LaunchInterrupted: past ``timeout``, or interrupted; every rank was ended,
            and ``e.stacks`` holds where each was.
    """
    default = isinstance(timeout, DefaultTimeout)
    world_size, backend, payload = _validate(fn, world_size, args, kwargs, backend, timeout)
    return run_ranks(payload, world_size, backend, None if timeout is None else float(timeout), style="launch",
                     default=default)


#: One launch at a time: a launch ends the ``multiprocessing`` processes that appeared below the caller
#: during it, so a second launch from another thread would lose its ranks.
_ONE_AT_A_TIME = threading.Lock()


def run_ranks(payload: bytes, world_size: int, backend: str | None, timeout: float | None, style: str,
              what: str = "launch", default: bool = False) -> list:
    """Start the ranks in a fresh run folder, supervise them, return their results or raise (also
    :mod:`helpers.mp`'s, ``style="spawn"``). ``what`` names the call in a timeout's message;
    ``default``: ``timeout`` is that call's default."""
    threads = threads_per_rank(world_size)
    if full := temp_folder_full():
        raise LaunchError(full)
    # the run folder first: the reaper removes it, and the fork server's socket folder, if this process is killed
    with _ONE_AT_A_TIME, run_folder(also=socket_folder()) as run_dir, fork_server() as server_pid, QuietElastic(), \
            main_without_file():
        # what runs below this process already (the fork server, the resource tracker) stays
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        config = _configure(world_size, run_dir, timeout, "spawn" if server_pid is None else "forkserver")
        # the ranks' parent: the fork server, or this process under spawn
        parent_pid = os.getpid() if server_pid is None else server_pid
        entry_args = (payload, run_dir, parent_pid, os.getpid(), backend, _group_timeout(timeout), threads, style)
        outcome, reason = _supervise(config, entry_args, run_dir, timeout, before)
        try:
            _raise_failure(outcome, reason, run_dir, world_size, timeout, what, default)
        except WorkerError as e:
            if server_pid is None or fork_server_pid() == server_pid:
                raise
            # its ranks die with it, with an exit code that says nothing about why
            raise e.with_note(f"the fork server (pid {server_pid}) that forked the ranks died during the launch; "
                              "the next launch starts a new one") from None
        except (LaunchTimeout, LaunchInterrupted):
            raise
        except Exception:  # a rank that could not write its output or error (torch's EOFError reading it)
            if full := temp_folder_full():
                raise LaunchError(full.replace("is full", "filled up during the launch")) from None
            raise
        results = outcome["results"]
        return [cloudpickle.loads(results[r]) for r in range(world_size)]


def _group_timeout(timeout: float | None) -> float | None:
    """The default group's timeout (seconds): longer than start-up and ``fn`` together may take."""
    return None if timeout is None else 2 * max(timeout, STARTUP_S)


# ---- validate: every check before any process starts -----------------------------------------

def _validate(fn, world_size, args, kwargs, backend, timeout) -> tuple[int, str, bytes]:
    """Every check before any process starts; returns ``(world_size, backend, payload)``."""
    world_size = check_world_size(world_size)
    check_callable(fn)
    backend = resolve_backend(backend, world_size)
    check_timeout(timeout)
    return world_size, backend, serialise_call(fn, args, kwargs)


def resolve_backend(backend: str | None, world_size: int) -> str:
    """``backend``, checked; ``None`` gives ``"nccl"`` when CUDA has ``world_size`` GPUs, else ``"gloo"``.

    Raises:
        LaunchError: unknown backend, or ``"nccl"`` without one GPU per rank.
    """
    return procs.resolve_backend(backend, world_size, error=LaunchError)


def threads_per_rank(world_size: int) -> int:
    """CPU threads each rank gets: ``max(1, os.cpu_count() // world_size)`` (ranks do not fight
    over cores). Applied with ``torch.set_num_threads`` unless ``OMP_NUM_THREADS`` is set."""
    return max(1, (os.cpu_count() or 1) // world_size)


# ---- configure: the elastic agent -----------------------------------------

def _configure(world_size: int, run_dir: str, timeout: float | None, start_method: str):
    """The elastic agent's configuration: one node, no restarts, ``start_method`` ``"forkserver"`` or ``"spawn"``."""
    return elastic_api.LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"ddp-lab-{uuid.uuid4().hex[:12]}",
        # the rendezvous in a file of the run folder: a TCPStore would listen on every interface
        rdzv_backend="c10d",
        rdzv_endpoint=os.path.join(run_dir, "rendezvous"),
        rdzv_configs={"timeout": int(min(max(timeout, STARTUP_S) if timeout else 900, 900)) + 1, "store_type": "file"},
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=_POLL_S,
        start_method=start_method,
        # no redirects (a no-op on macOS and Windows): each rank captures its own output (rank_output)
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs"), redirects=Std.NONE),
        shutdown_timeout=int(_KILL_GRACE_S),
    )


class QuietElastic:
    """torchelastic's and torch.multiprocessing's logging silenced for the block (we raise clearer
    errors); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (no agent store on every interface), and the
    ``os.environ`` names ``elastic_launch`` writes put back (a changed one restarts the fork server)."""

    NAMES = ("TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")

    def __enter__(self):
        self.loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
        self.levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.setLevel(logging.CRITICAL)
        self.env = {name: os.environ.get(name) for name in self.NAMES}
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return self

    def __exit__(self, *exc):
        for lg, level in zip(self.loggers, self.levels):
            lg.setLevel(level)
        for name, value in self.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        return False


# ---- supervise: relay output, watch the clock and the ranks, end them ------------------------

def _supervise(config, entry_args: tuple, run_dir: str, timeout: float | None, before: set[int]):
    """Run the elastic agent in a helper thread (under ``spawn`` the parent thread the ranks'
    ``PR_SET_PDEATHSIG`` watches: it outlives them), relay output, watch the clock and the ranks.

    Returns:
        ``(outcome, reason)``: outcome holds the agent's ``"results"`` or ``"error"``, ``"startup_s"``
        (until every rank ran ``fn``), ``"in_startup"`` (ranks not yet running it when start-up ran
        out), ``"stacks"``; reason: ``None``, ``("timeout",)``, ``("interrupt",)``, ``("vanished", rank)``.
    """
    outcome: dict[str, Any] = {}
    # never Thread.join: in Python 3.11 a KeyboardInterrupt in join() marks the thread stopped while it runs
    finished = threading.Event()

    def agent() -> None:
        try:
            outcome["results"] = elastic_api.elastic_launch(config, worker_entry)(*entry_args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = e
        finally:
            finished.set()

    start = time.monotonic()
    running_since: float | None = None  # when every rank was running fn
    world_size = config.nproc_per_node
    startup_limit = None if timeout is None else max(timeout, STARTUP_S)
    thread = threading.Thread(target=agent, name="ddp-lab-elastic-agent", daemon=True)
    relay = Relay(run_dir)
    reason: tuple | None = None
    vanished: dict[int, float] = {}  # rank -> when it was first seen gone without a result
    thread.start()
    try:
        while not finished.is_set():
            finished.wait(_POLL_S)
            relay.poll()
            if running_since is None and len(read_markers(run_dir, "started")) >= world_size:
                running_since = time.monotonic()
            now = time.monotonic()
            if running_since is not None and timeout is not None and now - running_since > timeout:
                reason = ("timeout",)
                break
            if running_since is None and startup_limit is not None and now - start > startup_limit:
                reason = ("timeout",)
                outcome["in_startup"] = sorted(set(range(world_size)) - set(read_markers(run_dir, "started")))
                break
            # the agent reports a non-zero exit or a signal, never an exit with code 0: we do
            gone = set(_vanished_ranks(run_dir))
            vanished = {r: vanished.get(r, time.monotonic()) for r in gone}
            late = sorted(r for r, t0 in vanished.items() if time.monotonic() - t0 > _VANISH_GRACE_S)
            if late:
                reason = ("vanished", late[0])
                break
    except KeyboardInterrupt:
        reason = ("interrupt",)
    finally:
        outcome["startup_s"] = (time.monotonic() if running_since is None else running_since) - start
        if reason in (("timeout",), ("interrupt",)):
            outcome["stacks"] = stacks.of_unfinished(run_dir)
        if reason is not None or not finished.is_set():
            _end(_worker_processes(run_dir))
        finished.wait(30.0)
        # anything still there, whatever happened (also workers that died before writing a pid file)
        _end(_worker_processes(run_dir) + _spawned_since(before))
        relay.poll(final=True)
    return outcome, reason


def _vanished_ranks(run_dir: str) -> list[int]:
    """Ranks whose process is gone without a done or error marker (``os._exit(0)``: the agent waits forever)."""
    finished = set(read_markers(run_dir, "done")) | set(read_markers(run_dir, "error"))
    return [r for r, info in read_markers(run_dir, "pid").items()
            if r not in finished and not procs.is_live(info["pid"])]


def _worker_processes(run_dir: str):
    """``(rank, psutil.Process)`` of the live ranks and what they started (in their sessions, even re-parented)."""
    pids = read_markers(run_dir, "pid")
    found = [(-1, p) for p in procs.in_sessions({info["pid"] for info in pids.values()})]
    for rank, info in pids.items():
        try:
            p = psutil.Process(info["pid"])
            found.append((rank, p))
            found.extend((rank, c) for c in p.children(recursive=True))
        except psutil.Error:
            pass
    return found


def _spawned_since(before: set[int]):
    """``multiprocessing`` processes below this one not in ``before`` (pids), the resource tracker aside."""
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


def _end(found) -> None:
    """End ``(rank, psutil.Process)`` pairs: SIGTERM, a grace period, SIGKILL."""
    procs.end_processes([p for _, p in found], _KILL_GRACE_S)


# ---- raise: the caller's exception -----------------------------------------------------------

def _raise_failure(outcome: dict, reason: tuple | None, run_dir: str, world_size: int,
                   timeout: float | None, what: str = "launch", default: bool = False) -> None:
    """Raise the caller's exception for whatever went wrong (nothing if every rank returned)."""
    done = read_markers(run_dir, "done")
    if reason == ("interrupt",):
        raise LaunchInterrupted(f"launch interrupted; all {world_size} workers were ended",
                                stacks=outcome.get("stacks"))
    if reason == ("timeout",):
        raise LaunchTimeout(float(timeout), [r for r in range(world_size) if r not in done],
                            stacks=outcome.get("stacks"), startup_s=outcome.get("startup_s"),
                            in_startup=outcome.get("in_startup", []), default=default, what=what)
    if reason is not None:  # a worker exited without a result or an error
        rank = reason[1]
        raise WorkerError(rank, "exited without returning a result",
                          "the process ended with exit code 0 before fn returned or raised (e.g. "
                          "os._exit(0)); the other ranks were ended", "",
                          {r: "ended by the launcher" for r in range(world_size) if r != rank})
    if "error" in outcome:
        raise worker_error(outcome["error"], read_markers(run_dir, "error"),
                           set(read_markers(run_dir, "pid")), set(done), world_size) from None
