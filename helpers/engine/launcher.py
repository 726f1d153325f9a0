"""The notebook-safe DDP launcher: the one way the notebooks start distributed workers.

``launch(fn, world_size, ...)`` starts ``world_size`` fresh processes, initialises the default
process group in each, calls ``fn(rank, world_size, *args, **kwargs)`` and returns the list of
return values in rank order. It is built on torch's elastic agent (the engine behind
``torchrun``, ``torch.distributed.launcher.api.elastic_launch``), which picks a free port through
a c10d rendezvous, sets the same environment variables torchrun sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and starts the workers, here forked from
:mod:`helpers.engine.fork_server`'s server (``spawn`` where that is unavailable), never from the caller
(a forked child of a process that has touched CUDA fails with "Cannot re-initialize CUDA in
forked subprocess"). On top of it this module adds what a notebook needs:

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
- ``timeout`` bounding the run of ``fn``, counted from when every rank is running it (start-up, slow
  on a loaded machine, has its own allowance, :data:`STARTUP_S`; gloo's default collective timeout
  is 30 minutes), and a timeout that says which rank was still in its own code and which waited in
  a collective;
- no worker process left behind on success, error, timeout or KeyboardInterrupt ("interrupt
  kernel"), and the kernel's own signal handlers left untouched (the agent runs in a helper
  thread, so torchelastic never installs its SIGINT/SIGTERM handlers in the kernel); on Linux
  each rank also asks the kernel for a parent-death signal (``PR_SET_PDEATHSIG``), so the ranks
  die with the launching process even when it is SIGKILLed (the out-of-memory killer), and a
  reaper removes the launch's temp folder then too;
- bad input refused before any process starts, with a message saying what to do.

The same worker function, once moved into a module, runs unchanged under ``torchrun``: see
:func:`main_from_env`. :mod:`helpers.mp` runs code written for ``torch.multiprocessing.spawn``
(the official DDP tutorial's) on the same machinery.

``launch()`` reads as validate -> configure -> supervise -> raise. The parts it is built from:

- :mod:`helpers.engine.errors`: the exceptions, and the rule naming the root-cause rank;
- :mod:`helpers.engine.by_value`: what may be sent (by value or by reference), the refusal walk;
- :mod:`helpers.engine.rank_main`: what runs inside each rank (parent-death signal, process group,
  ``fn``, markers), and :func:`worker_device`;
- :mod:`helpers.engine.run_dir`: the run folder the launcher and its ranks share, removed even if it is SIGKILLed;
- :mod:`helpers.engine.rank_output`: each rank's stdout/stderr captured there and relayed as ``[rank r]`` lines;
- :mod:`helpers.engine.stacks`: where each rank is stuck on a timeout or an interrupt (faulthandler);
- :mod:`helpers.engine.processes`: free ports, ending process trees, the backend rule, the torchrun entry.

Introduced in notebook 01. Reference: https://pytorch.org/docs/stable/elastic/run.html,
``torch/distributed/launcher/api.py`` and https://github.com/cloudpipe/cloudpickle.
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
        timeout: seconds ``fn`` may run, counted from when every rank is running it (``None``: no
            limit; the default is 300 s, and its message says so). Start-up before that may take
            ``max(timeout, STARTUP_S)`` seconds. The default group's own timeout (each collective,
            its rendezvous) is ``2 * max(timeout, STARTUP_S)``: longer, so that a rank waiting in a
            collective is still there when the launch times out and says where each rank was.

    Returns:
        list: ``fn``'s return value on each rank, in rank order (``results[r]`` from rank ``r``).

    Raises:
        LaunchError: a full temp folder (``TMPDIR``: before any process starts, or once it filled up
            during the launch), or bad input, before any process starts: ``world_size`` not a positive int or
            far above the core count, an unknown backend, ``nccl`` without one GPU per rank, a
            bad ``timeout``, ``fn`` not callable, or something that cannot be sent to another
            process (an open file, a lock, a socket, a generator, a CUDA tensor, anything
            unpicklable) in an argument, a global ``fn`` uses or a closure variable; the message
            names the variable and says what to do instead.
        WorkerError: a rank raised, exited without returning, or was killed; the other ranks
            are ended. Names the rank and carries its traceback.
        LaunchTimeout: ``fn`` ran past ``timeout`` (or start-up past its allowance: the message says
            so, with the seconds); names the ranks that had not finished, which was still in its own
            code and which waited in a collective, and where each was stuck in your code (``e.stacks``:
            each rank's full Python stack).
        LaunchInterrupted: (a ``KeyboardInterrupt``) the caller was interrupted; every worker was
            ended first; shows where each unfinished rank was, as ``LaunchTimeout`` does.

    Worker stdout and stderr appear in the caller's streams line by line, prefixed ``[rank r]``.
    Calls from several threads of one process run one after another.
    """
    default = isinstance(timeout, DefaultTimeout)
    world_size, backend, payload = _validate(fn, world_size, args, kwargs, backend, timeout)
    return run_ranks(payload, world_size, backend, None if timeout is None else float(timeout), style="launch",
                default=default)


#: One launch at a time per process: a launch ends whatever ``multiprocessing`` processes below
#: the caller appeared during it (a rank that died before writing its pid file included), so a
#: second launch from another thread would lose its ranks. Launches from several threads of one
#: process therefore run one after another (each one's ``timeout`` counts from its own ranks' start).
_ONE_AT_A_TIME = threading.Lock()


def run_ranks(payload: bytes, world_size: int, backend: str | None, timeout: float | None, style: str,
         what: str = "launch", default: bool = False) -> list:
    """Configure, supervise, raise: start the ranks in a fresh run folder, watch them, and return
    their results or raise (shared with :func:`helpers.mp.spawn`, ``style="spawn"``). ``what`` names
    the call in a timeout's message; ``default``: ``timeout`` is that call's default."""
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
    """The default process group's timeout for a launch's ``timeout`` (seconds): longer than start-up and
    ``fn`` together may take, so the group never times out a rank before the launcher asks for its stack."""
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
    """Choose or check the process-group backend (the rule lives in :func:`helpers.engine.resolve_backend`).

    ``None`` gives ``"nccl"`` when CUDA has at least ``world_size`` GPUs, else ``"gloo"`` (CPU).

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
    """The elastic agent's configuration: one node, a fresh port, no restarts, ranks started
    with ``start_method`` (``"forkserver"``, see :mod:`helpers.engine.fork_server`, or ``"spawn"``)."""
    return elastic_api.LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"ddp-lab-{uuid.uuid4().hex[:12]}",
        # the agent's rendezvous in a file of the private run folder: its TCPStore would listen on
        # every interface; rank 0 opens the group's store on 127.0.0.1 (QuietElastic, rank_main)
        rdzv_backend="c10d",
        rdzv_endpoint=os.path.join(run_dir, "rendezvous"),
        rdzv_configs={"timeout": int(min(max(timeout, STARTUP_S) if timeout else 900, 900)) + 1, "store_type": "file"},
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=_POLL_S,
        start_method=start_method,  # never fork: see the module docstring
        # no redirects: each rank captures its own stdout/stderr (helpers.engine.rank_output.capture_output),
        # since the agent's redirect is a no-op on macOS and Windows; log_dir keeps its error.json
        # files in the run folder
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs"), redirects=Std.NONE),
        shutdown_timeout=int(_KILL_GRACE_S),
    )


class QuietElastic:
    """Silence torchelastic's and torch.multiprocessing's own logging during a launch (we raise
    our own, clearer errors); set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's switch: no
    agent store listening on every interface; rank 0 opens the group's store, on loopback) and
    put back both it and the ``TORCHELASTIC_SIGNALS_TO_HANDLE`` that ``elastic_launch`` writes into
    the caller's ``os.environ`` (a changed environment would make the next launch start a fresh
    fork server, see :func:`helpers.engine.fork_server.environment`)."""

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
    """Run the elastic agent in a helper thread, relay output, watch the clock and the ranks.

    Under ``spawn`` the agent thread is the one that starts the workers, so it is also the parent
    thread their ``PR_SET_PDEATHSIG`` watches: it must outlive them. It does: after the agent
    returns every worker has exited, and on a timeout, a vanished rank or an interrupt the
    workers are ended before the thread is joined. (Under the fork server their parent is the
    server.)

    ``timeout`` counts from when every rank has its ``started`` marker (it is running ``fn``);
    before that, start-up may take ``max(timeout, STARTUP_S)`` seconds.

    Returns:
        ``(outcome, reason)``: outcome holds ``"results"`` or ``"error"`` from the agent, and
        ``"startup_s"``: seconds until every rank was running ``fn`` (until now if they never all
        did), and ``"in_startup"``: the ranks not yet running it when start-up ran past its
        allowance; reason is ``None`` or why the workers were ended here: ``("timeout",)``,
        ``("interrupt",)``, ``("vanished", rank)``.
    """
    outcome: dict[str, Any] = {}
    # The agent thread sets `finished` when it ends; the caller waits on it, never on
    # Thread.join: in Python 3.11 a KeyboardInterrupt that lands in join() marks the thread as
    # stopped while it still runs (threading._wait_for_tstate_lock releases the thread's own
    # lock), so a later join() returned at once and torchelastic logged into the next cell.
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
    """Ranks whose process is gone without a done or error marker (e.g. after ``os._exit(0)``).

    The elastic agent waits forever for such a rank's return value, so the caller must notice.
    """
    finished = set(read_markers(run_dir, "done")) | set(read_markers(run_dir, "error"))
    gone = []
    for rank, info in read_markers(run_dir, "pid").items():
        if rank not in finished:
            try:
                if psutil.Process(info["pid"]).status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                pass
            gone.append(rank)
    return gone


def _worker_processes(run_dir: str):
    """The live worker processes and anything they started (in their sessions, even re-parented: a
    ``subprocess``, a ``fork``), found through their pid files."""
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
    """Processes started by ``multiprocessing`` below this one since ``before`` (a pid set),
    except the resource tracker (one per caller process, shared by all launches)."""
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
