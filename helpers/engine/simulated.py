"""Simulated ranks: ``fn(rank, world_size, ...)`` on threads of this process, for cluster-sized worlds.

Each rank is a thread with its own default group on torch's threaded backend: collectives, DDP and
``fully_shard`` give the values real ranks get; time and parallelism are not simulated (one GIL).
:class:`Turns` is the one interface between the rank threads and the caller's supervision.
Reference: ``torch/testing/_internal/distributed/multi_threaded_pg.py``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import inspect
import os
import random
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.utils.data.dataloader

from helpers.engine.errors import LaunchError, LaunchInterrupted, LaunchTimeout, SimulationUnavailable, worker_error
from helpers.engine.fork_server import fresh_random_state
from helpers.engine.inputs import DefaultTimeout, as_int, check_callable, check_timeout
from helpers.engine.rank_main import alone_note
from helpers.engine.rank_output import TextRelay
from helpers.engine.stacks import of_threads, ranks_phrase

__all__ = ["simulate", "SimulationUnavailable", "SUMMARY_FROM", "MAX_SIMULATED_RANKS", "SUPPORTED_TORCH"]

#: torch versions the private pieces were checked on (``requirements.txt`` pins one of them).
SUPPORTED_TORCH = ("2.14",)
#: From this many ranks on, ``output=None`` shows only rank 0's lines and counts the others'.
SUMMARY_FROM = 64
#: The largest ``world_size`` :func:`simulate` accepts (one thread per rank).
MAX_SIMULATED_RANKS = 1024
DEFAULT_TIMEOUT_S = DefaultTimeout(300.0)
BACKEND = "simulated"  # the name dist.get_backend() gives inside a simulated rank

_POLL_S = 0.05  # how often the caller relays output and checks the ranks (seconds)
_END_GRACE_S = 2.0  # after the ranks are told to end: how long before a running rank is interrupted
_LEFTOVER_S = 30.0  # ... and how long the caller waits for every rank thread to end (seconds)
_STARTUP_S = 120.0  # the ranks' process groups may take max(timeout, this) seconds to form

_ONE_AT_A_TIME = threading.Lock()
_leftovers: list[threading.Thread] = []  # rank threads a past run could not end in time


class _Local(threading.local):  # in a rank thread: its rank, its run, has the turn, in a collective
    rank: int | None = None
    run = None
    holding = in_collective = False


_local = _Local()


# ---- in the rank threads: turns and per-rank state ----------------------------------------------

def _random_state():
    np = sys.modules.get("numpy")
    return torch.default_generator.get_state(), random.getstate(), np and np.random.get_state()


def _set_random_state(state) -> None:
    """Put ``state`` back (:func:`_random_state`); ``None``: seeded afresh, as a new process is."""
    if state is None:
        return fresh_random_state()
    torch.default_generator.set_state(state[0])
    random.setstate(state[1])
    if state[2] is not None and (np := sys.modules.get("numpy")) is not None:
        np.random.set_state(state[2])


class Turns:
    """One rank runs at a time, in the order the ranks asked (at the start: rank order), each with its
    own random state from turn to turn. The whole interface supervision has to the rank threads:
    :meth:`enter`, :meth:`wait`, :meth:`give`, :meth:`leave`, :meth:`stop`."""

    def __init__(self, world_size: int):
        self.lock = threading.Lock()
        self.events = [threading.Event() for _ in range(world_size)]
        self.queue = collections.deque(range(world_size))  # ranks waiting for a turn, first first
        self.holder: int | None = None
        self.stopped = False
        self.states: dict[int, Any] = {}  # the random state of each rank that gave its turn

    def _hand_on(self) -> None:  # under self.lock
        if self.holder is None and self.queue and not self.stopped:
            self.holder = self.queue.popleft()
            self.events[self.holder].set()

    def enter(self, rank: int, run) -> None:
        """This thread becomes rank ``rank`` of ``run``, without the turn."""
        _local.rank, _local.run, _local.holding = rank, run, False

    def leave(self) -> None:
        """This thread is no rank any more."""
        _local.run = _local.rank = None

    def wait(self, rank: int) -> None:
        """Block until ``rank`` has the turn and its random state; SystemExit once the run ends."""
        with self.lock:
            if rank in self.states:  # it gave its turn; its first turn was queued at the start
                self.queue.append(rank)
            self._hand_on()
        self.events[rank].wait()
        self.events[rank].clear()
        if self.stopped:
            raise SystemExit("the simulation ended this rank")
        _set_random_state(self.states.get(rank))
        _local.holding = True

    def give(self, rank: int) -> None:
        """``rank`` gives its turn (if it has it) to the next rank waiting, keeping its random state."""
        if not _local.holding:
            return
        _local.holding = False
        self.states[rank] = _random_state()
        with self.lock:
            self.holder = None
            self._hand_on()

    def stop(self) -> None:
        """Free every rank: each waiting one raises SystemExit."""
        with self.lock:
            self.stopped = True
            for event in self.events:
                event.set()


@contextlib.contextmanager
def _turn_given():
    """In a rank thread that has the turn: give it up for the block (a wait for the other ranks)."""
    run, rank = _local.run, _local.rank
    if run is None or not _local.holding:
        yield
        return
    run.turns.give(rank)
    try:
        yield
    finally:
        run.turns.wait(rank)


class CollectiveMismatch(RuntimeError):
    """Simulated ranks called different collectives (or shapes) at the same point of a group's sequence."""


class _Calls:
    """The collectives each rank has called on each process group, in order: the n-th call of every
    rank must be the same operation, and an all-reduce or broadcast gets tensors of the same shape."""

    SAME_SHAPES = ("allreduce", "allreduce_coalesced", "broadcast")

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: dict[tuple[str, int], tuple[int, str, int]] = {}  # (group, n) -> (rank, signature, ranks in)
        self.counts: dict[tuple[str, int], int] = {}  # (group, rank) -> calls so far

    def check(self, group: str, rank: int, world_size: int, name: str, args) -> None:
        """Record ``rank``'s next call on ``group``; raise :class:`CollectiveMismatch` if an earlier
        rank's call at the same point differs."""
        if name in self.SAME_SHAPES:
            tensors = args[0] if args and isinstance(args[0], (list, tuple)) else []
            shapes = [list(t.shape) for t in tensors if isinstance(t, torch.Tensor)]
            name = f"{name} of shape {shapes[0] if len(shapes) == 1 else shapes}"
        with self.lock:
            n = self.counts[(group, rank)] = self.counts.get((group, rank), 0) + 1
            other, expected, arrived = self.seen.pop((group, n), (rank, name, 0))
            if arrived + 1 < world_size:
                self.seen[(group, n)] = (other, expected, arrived + 1)
        if name != expected:
            raise CollectiveMismatch(
                f"ranks called different collectives at the same point (call {n} on this "
                f"process group): rank {other} called {expected}, rank {rank} called {name}. Every "
                "rank must call the same collectives in the same order, with tensors of the same "
                "shape: look for a collective inside `if rank == ...:`, or a loop that runs a "
                "different number of times on some rank.")


def _gives_turn(method):
    """A collective that checks the call (:class:`_Calls`), then gives the turn up to wait."""
    @functools.wraps(method)
    def collective(self, *args, **kwargs):
        if _local.run is None or _local.in_collective:  # barrier() calls allreduce(): one call
            return method(self, *args, **kwargs)
        _local.run.calls.check(self.pg_name, self.rank(), self.size(), method.__name__, args)
        _local.in_collective = True
        try:
            with _turn_given():
                return method(self, *args, **kwargs)
        finally:
            _local.in_collective = False
    return collective


# ---- the threaded world: torch's private pieces, and what a simulation patches ------------------

@functools.lru_cache(maxsize=1)
def _pieces():
    """``(ProcessLocalGroup, install, uninstall, set_isolation)``, the simulated backend registered;
    raises :class:`SimulationUnavailable` naming what is missing."""
    missing, mtpg = [], None
    try:
        from torch.testing._internal.distributed import multi_threaded_pg as mtpg
    except Exception as e:  # noqa: BLE001 - ImportError, or a module that fails on import
        missing.append(f"torch.testing._internal.distributed.multi_threaded_pg "
                       f"({type(e).__name__}: {e})")
    plg, c10d = getattr(mtpg, "ProcessLocalGroup", None), torch._C._distributed_c10d
    needed = {"multi_threaded_pg": (mtpg, "ProcessLocalGroup", "_install_threaded_pg",
                                    "_uninstall_threaded_pg"),
              "ProcessLocalGroup": (plg, "exception_handle", "reset", "_terminate", "allreduce",
                                    "broadcast", "allgather"),
              "torch._C._distributed_c10d": (c10d, "_set_thread_isolation_mode"),
              "torch.distributed.distributed_c10d": (dist.distributed_c10d, "_store_based_barrier")}
    missing += [f"{owner}.{n}" for owner, (obj, *names) in needed.items() for n in names
                if obj is not None and not hasattr(obj, n)]
    if missing:
        raise SimulationUnavailable(
            f"simulate() needs a private part of torch that this torch ({torch.__version__}) "
            f"lacks: {', '.join(missing)}. It was checked on torch {', '.join(SUPPORTED_TORCH)} "
            "(the version requirements.txt pins). Install that version, or run the same function "
            "on real processes: helpers.engine.launch(fn, world_size) (a few ranks per CPU core).")
    group = type("SimulatedGroup", (plg,), {n: _gives_turn(f) for n, f in vars(plg).items()
                                            if callable(f) and not n.startswith("_")
                                            and not isinstance(f, (classmethod, staticmethod))
                                            and n not in ("size", "getBackendName")})

    def create(store, rank, world_size, timeout):
        pg = group(rank, world_size)
        with _turn_given():  # the store barrier waits for the other ranks
            dist.distributed_c10d._store_based_barrier(rank, store, "", world_size, timeout)
        return pg

    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, create, devices=["cpu"])
    return plg, mtpg._install_threaded_pg, mtpg._uninstall_threaded_pg, c10d._set_thread_isolation_mode


_NEW_GROUP, _EXIT = dist.distributed_c10d.new_group, os._exit
_WORKERS_ITER = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
_WORKERS_INIT = _WORKERS_ITER.__init__


@contextlib.contextmanager
def _threaded_world():
    """torch's threaded world installed for the block, everything it changes put back after."""
    plg, install, uninstall, isolation = _pieces()
    plg.reset()
    caller_random, excepthook = _random_state(), sys.excepthook  # init_process_group prefixes the hook "[rankN]"
    patches = ((dist, "new_group", _new_group), (dist.distributed_c10d, "new_group", _new_group),
               (os, "_exit", _exit), (_WORKERS_ITER, "__init__", _no_worker_processes))
    with contextlib.ExitStack() as undo:
        for owner, name, new in patches:
            undo.enter_context(mock.patch.object(owner, name, new))
        install()
        isolation(True)
        try:
            yield
        finally:
            isolation(False)
            uninstall()
            _set_random_state(caller_random)
            sys.excepthook = excepthook


def _no_worker_processes(self, loader):
    """``DataLoader(num_workers > 0)`` in a rank thread: forking from a process of many threads can
    deadlock, so it is refused at once."""
    if _local.run is None:
        return _WORKERS_INIT(self, loader)
    self._shutdown = True  # its __del__ then has no workers to end (and no AttributeError to print)
    raise RuntimeError(f"DataLoader(num_workers={loader.num_workers}) in a simulated rank: its worker processes "
                       "would be forked from a process of many threads, which can deadlock. Use num_workers=0 "
                       "under simulate, or real ranks: helpers.engine.launch")


def _exit(status):
    """``os._exit`` in a rank thread would end the caller's process and every rank: it raises."""
    if _local.run is None:
        _EXIT(status)
    raise SystemExit(f"os._exit({status!r}) in a simulated rank: it would end the notebook's process (every rank "
                     "shares it), so simulate refused it; return from your function instead, or run code that "
                     "must exit the process with helpers.engine.launch")


def _new_group(*args, **kwargs):
    """``dist.new_group`` in a rank thread without ``backend=`` and ``pg_options``: a gloo group (as
    Lightning's ``rank_zero_first`` makes) would wait forever for peers that are threads."""
    if _local.run is not None:
        bound = inspect.signature(_NEW_GROUP).bind(*args, **kwargs)
        bound.arguments.pop("backend", None)
        bound.arguments.pop("pg_options", None)
        args, kwargs = bound.args, bound.kwargs
    return _NEW_GROUP(*args, **kwargs)


# ---- supervision: in the caller ------------------------------------------------------------------

class _Run:
    def __init__(self, fn, world_size, args, kwargs, group_timeout, summary):
        self.fn, self.world_size, self.args, self.kwargs = fn, world_size, args, kwargs
        self.group_timeout, self.summary = group_timeout, summary
        self.turns, self.calls = Turns(world_size), _Calls()
        self.store = dist.HashStore()
        self.lock = threading.Lock()
        self.results: dict[int, Any] = {}
        self.errors: dict[int, dict] = {}  # the ranks' own errors, not those the ending caused
        self.phase = dict.fromkeys(range(world_size), "start")  # start, fn, after, ended
        self.stopping, self.changed = False, threading.Event()
        self.threads: list[threading.Thread] = []

    def error(self, rank: int, e: BaseException) -> None:
        if self.stopping and isinstance(e, SystemExit):
            return
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        with self.lock:
            self.errors[rank] = {"rank": rank, "type": type(e).__name__, "message": str(e), "traceback": tb,
                                 "time": time.time()}
        self.stop()

    def stop(self) -> None:
        """Free every rank: the turns stop, collectives end (torch raises SystemExit in their waits)."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        self.turns.stop()
        _pieces()[0].exception_handle(RuntimeError("simulation ended"))
        self.changed.set()


class _RankStream:
    """``sys.stdout``/``sys.stderr`` during a run: a rank thread's text is kept per rank for the relay."""

    def __init__(self, stream, name: str, run: _Run):
        self.stream, self.name, self.run = stream, name, run

    def write(self, text: str) -> int:
        if _local.run is not self.run:
            return self.stream.write(text)
        self.run.output.write(_local.rank, self.name, text)
        return len(text)

    def flush(self) -> None:
        if _local.rank is None:
            self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _run_rank(run: _Run, rank: int) -> None:
    """A rank thread: its default group, its turn, ``fn``; what happened goes to ``run``."""
    run.turns.enter(rank, run)
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=run.world_size, store=run.store,
                                timeout=run.group_timeout)
        run.phase[rank] = "fn"
        run.turns.wait(rank)
        run.results[rank] = run.fn(rank, run.world_size, *run.args, **run.kwargs)
        if rank == 0 and (note := alone_note(run.world_size, "simulate")):
            print(note, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        run.error(rank, e)
    finally:
        run.phase[rank] = "after"
        run.turns.give(rank)
        with contextlib.suppress(BaseException):
            if dist.is_initialized():
                dist.destroy_process_group()
        run.turns.leave()
        run.phase[rank] = "ended"
        run.changed.set()


def _end(run: _Run) -> list[int]:
    """Stop every rank, wait for their threads (one still in ``fn`` after :data:`_END_GRACE_S` gets
    SystemExit at its next Python line); the ranks whose thread still runs."""
    run.stop()
    start = time.monotonic()
    with contextlib.suppress(KeyboardInterrupt):  # a second interrupt: stop waiting
        for limit in (_END_GRACE_S, _LEFTOVER_S):
            while any(t.is_alive() for t in run.threads) and time.monotonic() - start < limit:
                time.sleep(_POLL_S)
            for r, t in enumerate(run.threads):
                if t.is_alive() and run.phase[r] == "fn":
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident),
                                                               ctypes.py_object(SystemExit))
    alive = [r for r, t in enumerate(run.threads) if t.is_alive()]
    _leftovers.extend(run.threads[r] for r in alive)
    return alive


def _supervise(run: _Run, timeout: float | None) -> tuple[str | None, float | None]:
    """Relay output, watch the ranks until they end: ``(reason, startup_s)``, reason ``None`` (all
    ended), ``"error"``, ``"timeout"`` or ``"interrupt"``."""
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    run.output = TextRelay(streams, "simulation", lambda rank: rank == 0 or not run.summary)
    start, running_since = time.monotonic(), None
    startup_limit = None if timeout is None else max(timeout, _STARTUP_S)
    sys.stdout, sys.stderr = (_RankStream(streams[name], name, run) for name in streams)
    try:
        run.threads = [threading.Thread(target=_run_rank, args=(run, r), name=f"simulated-rank-{r}",
                                        daemon=True) for r in range(run.world_size)]
        for t in run.threads:
            t.start()
        while True:
            run.changed.wait(_POLL_S)
            run.changed.clear()
            run.output.poll()
            phases, now = list(run.phase.values()), time.monotonic()
            if all(p == "ended" for p in phases):
                return ("error" if run.errors else None), (running_since or now) - start
            if run.stopping:
                return "error", None
            if running_since is None and all(p != "start" for p in phases):
                running_since = now
            since, limit = (running_since, timeout) if running_since else (start, startup_limit)
            if limit is not None and now - since > limit:
                return "timeout", (running_since or now) - start
    except KeyboardInterrupt:
        return "interrupt", None
    finally:
        sys.stdout, sys.stderr = streams["stdout"], streams["stderr"]


def simulate(fn: Callable, world_size: int, *args, timeout: float | None = DEFAULT_TIMEOUT_S,
             output: str | None = None, **kwargs) -> list:
    """``fn(rank, world_size, *args, **kwargs)`` on 1 to :data:`MAX_SIMULATED_RANKS` simulated ranks
    (threads, one at a time, ``args`` shared): the results in rank order. ``timeout``: seconds once
    every rank has its group (``None``: no limit); ``output``: ``"all"`` (``[rank r]`` lines),
    ``"summary"`` (rank 0's and a count), ``None`` (``"all"`` below :data:`SUMMARY_FROM` ranks).
    Raises :class:`SimulationUnavailable` and :class:`LaunchError` (bad input) before any thread
    starts; :class:`WorkerError`, :class:`LaunchTimeout` and :class:`LaunchInterrupted` after."""
    default = isinstance(timeout, DefaultTimeout)
    if _local.rank is not None:
        raise LaunchError("simulate() was called from inside a simulated rank; call it from the notebook cell.")
    if not 1 <= (as_int(world_size) or 0) <= MAX_SIMULATED_RANKS:
        raise LaunchError(f"world_size must be an int from 1 to {MAX_SIMULATED_RANKS}, got {world_size!r}.")
    world_size = as_int(world_size)
    check_callable(fn)
    timeout = check_timeout(timeout)
    if output not in (None, "all", "summary"):
        raise LaunchError(f"output must be 'all', 'summary' or None, got {output!r}.")
    _pieces()
    summary = output == "summary" or (output is None and world_size >= SUMMARY_FROM)
    group_timeout = timedelta(seconds=2 * max(timeout or 900.0, _STARTUP_S))
    with _ONE_AT_A_TIME:
        _leftovers[:] = [t for t in _leftovers if t.is_alive()]  # they never block this run
        if _leftovers:
            sys.stderr.write(f"Note: {len(_leftovers)} rank threads of an earlier simulate() are "
                             "still stuck in a call Python cannot interrupt (a sleep, a lock, C "
                             "code); this run goes on without them; they end when that call "
                             f"returns. {_STUCK_ADVICE}\n")
        run = _Run(fn, world_size, args, kwargs, group_timeout, summary)
        with _threaded_world():
            reason, startup_s = None, None
            try:
                reason, startup_s = _supervise(run, timeout)
            finally:
                unfinished = {r: t for r, t in enumerate(run.threads)
                              if run.phase[r] not in ("after", "ended")}
                stacks = of_threads(unfinished) if reason in ("timeout", "interrupt") else {}
                alive = _end(run)
                run.output.poll(final=True)
                out = run.output
                if hidden := out.hidden_lines + sum(map(bool, out.hidden.values())):
                    ranks = ranks_phrase(sorted({rank for rank, _ in out.hidden}), verb=False)
                    out.streams["stdout"].write(f"[{ranks}] {hidden} more lines not shown ({world_size} "
                                                "ranks: only rank 0's are); simulate(..., "
                                                "output='all') shows every rank's\n")
        still = (f"the threads of ranks {alive} still run (Python cannot stop a thread inside a "
                 "sleep, a lock or C code); they end when that call returns, and the next "
                 f"simulate() runs without them. {_STUCK_ADVICE}") if alive else None
        if reason == "interrupt":
            raise LaunchInterrupted(f"simulate interrupted; all {world_size} ranks were ended"
                                    + (f"; {still}" if still else ""), stacks=stacks)
        if reason == "timeout":
            err = LaunchTimeout(timeout, sorted(set(range(world_size)) - set(run.results)), stacks,
                                startup_s, default=default, what="simulate")
            err.args = (f"{err.args[0]} ({still})",) if still else err.args
            raise err
        if run.errors:
            err = worker_error(None, run.errors, set(), set(run.results), world_size, "simulate")
            raise err.with_note(still)
        return [run.results[r] for r in range(world_size)]


_STUCK_ADVICE = ("Restart the kernel to end them now; code that blocks like that runs better under "
                 "helpers.engine.launch, whose ranks are processes that can be ended.")
