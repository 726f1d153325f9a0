"""A notebook-safe drop-in for ``torch.multiprocessing``'s process starting: ``import helpers.mp as mp``.

Code written for ``torch.multiprocessing.spawn``, such as the official PyTorch DDP tutorial's
(https://pytorch.org/tutorials/intermediate/ddp_tutorial.html)::

    def setup(rank, world_size):
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "12355"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    mp.spawn(demo_basic, args=(world_size,), nprocs=world_size, join=True)

fails in a notebook with ``torch.multiprocessing``: a function defined in a cell cannot be
imported by a spawned process ("Can't get attribute 'demo_basic' on <module '__main__'>").
With ``import helpers.mp as mp`` instead of ``import torch.multiprocessing as mp`` it runs
(on CPU with the tutorial's CUDA lines removed too: docs/OWN_CODE.md's "Code from tutorials" lists
them): ``fn`` and what it uses are sent by value with cloudpickle, and the ranks are started,
supervised and ended by :mod:`helpers.engine.launcher`'s machinery (torch's elastic agent; ranks forked
from :mod:`helpers.engine.fork_server`'s server, never from the kernel, which is what ``spawn``
guarantees, without every rank importing torch), so worker output appears in the cell prefixed
``[rank r]``, a failing rank raises :class:`~helpers.engine.WorkerError` naming it, and no process is
left behind. Like torch's, :func:`spawn` and :meth:`Process.join` wait as long as the processes run;
an optional ``timeout`` raises :class:`~helpers.engine.LaunchTimeout`.

What it covers of ``torch.multiprocessing`` (the subset tutorials use): :func:`spawn`,
:class:`Process` with ``start``/``join`` (the loop of
https://pytorch.org/tutorials/intermediate/dist_tuto.html), :func:`set_start_method`,
:func:`get_start_method` and :func:`get_context`. Any other name (``Queue``, ``Pool``,
``cpu_count``, ...) raises ``AttributeError`` with the one-line rewrite.

Unlike :func:`helpers.engine.launch`, no process group is initialised for ``fn`` (the code does it
itself, as it would under ``torch.multiprocessing.spawn``), and the worker's environment has none
of the agent's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_*``): with ``TORCHELASTIC_USE_AGENT_STORE`` set, ``init_process_group``'s env://
rendezvous would connect to the agent's store instead of creating its own on the code's
``MASTER_PORT``. Those the *caller* had set in ``os.environ`` when it called :func:`spawn` (or
:meth:`Process.start`) are put back, as ``torch.multiprocessing.spawn`` passes the parent's
environment on: a script that sets ``MASTER_ADDR``/``MASTER_PORT`` before ``mp.spawn`` and calls
``init_process_group("gloo", rank=rank, world_size=world_size)`` in the worker works.

A fixed ``MASTER_PORT`` (the tutorial's ``"12355"``) works for runs one after another (the
group's store is closed when the code destroys its group or, at the latest, when its process
ends, and the port is reusable at once); two such runs *at the same time* on one machine collide,
exactly as they would with ``torch.multiprocessing.spawn``. :func:`helpers.engine.launch`
chooses a free port for every launch instead.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable

import cloudpickle

from helpers.engine.by_value import serialise_call
from helpers.engine.fork_server import AGENT_ENV
from helpers.engine.inputs import check_callable, check_timeout, check_world_size
from helpers.engine.launcher import (
    LaunchError,
    LaunchTimeout,
    WorkerError,
    run_ranks,
)

__all__ = ["Process", "get_context", "get_start_method", "set_start_method", "spawn"]

_START_METHODS = ("spawn", "forkserver")


def _check_start_method(method, argument: str = "start_method") -> str:
    if method not in _START_METHODS:
        raise LaunchError(
            f"{argument}={method!r} is not supported, only 'spawn' or 'forkserver': a process "
            "forked from a kernel that has touched CUDA fails with 'Cannot re-initialize CUDA in forked "
            "subprocess', and forking a multi-threaded kernel can deadlock. Use 'spawn' "
            "(the default; the ranks come from helpers.engine.fork_server either way)."
        )
    return method


def _caller_env() -> dict[str, str]:
    """The variables of the agent's (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...) that the
    caller itself has set: the ranks get these back after the agent's own are cleared."""
    return {name: os.environ[name] for name in AGENT_ENV if name in os.environ}


def _spawn_entry(rank: int, env: dict, call: bytes):
    """In the rank: the caller's variables back into ``os.environ``, then ``fn(rank, *args)``."""
    os.environ.update(env)
    fn, args, kwargs = cloudpickle.loads(call)
    return fn(rank, *args, **kwargs)


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn", *, timeout: float | None = None) -> list:
    """Run ``fn(i, *args)`` for ``i`` in ``range(nprocs)``, each in a new process, like
    ``torch.multiprocessing.spawn``; cell-defined ``fn`` allowed.

    Args:
        fn: the function each process calls as ``fn(i, *args)``, ``i`` being the process index
            (the rank, in the DDP tutorial). May be defined in a notebook cell.
        args: extra positional arguments for ``fn`` (a tuple); sent with cloudpickle.
        nprocs: number of processes, a positive int.
        join: must be ``True`` (the call returns when every process has finished).
        daemon: accepted for compatibility; the processes are always ended with the call.
        start_method: ``"spawn"`` or ``"forkserver"``; either way the ranks are forked from
            :mod:`helpers.engine.fork_server`'s server (never from the kernel).
        timeout: ``None`` (the default): no limit, as ``torch.multiprocessing.spawn`` (which has no
            ``timeout``); else seconds ``fn`` may run, counted from when every process is running it.

    Returns:
        list: ``fn``'s return value in each process, in index order (``torch.multiprocessing.spawn``
        returns ``None``; the values are an addition).

    Raises:
        LaunchError: bad input, before any process starts: ``join=False``, a ``start_method``
            other than ``"spawn"`` or ``"forkserver"``, a bad ``nprocs`` or ``timeout``, ``args`` not a tuple, or
            something in ``fn``/``args`` that cannot be sent to another process.
        WorkerError: a process raised, exited or was killed; the others are ended.
        LaunchTimeout: ``fn`` ran longer than ``timeout`` (only when one is given).
    """
    if join is not True:
        raise LaunchError(
            "join=False is not supported: in a notebook the processes must be supervised by the call "
            "(output relayed, errors raised, nothing left behind), so spawn() returns only when every "
            "process has finished. Use join=True; for ranks that live across cells see the warm ranks."
        )
    _check_start_method(start_method)
    if not isinstance(args, tuple):
        raise LaunchError(f"args must be a tuple (as for torch.multiprocessing.spawn), got {type(args).__name__}; "
                          f"e.g. args=(world_size,).")
    nprocs = check_world_size(nprocs, "nprocs")
    check_callable(fn)
    check_timeout(timeout)
    call = serialise_call(fn, args, {})
    payload = cloudpickle.dumps((_spawn_entry, (_caller_env(), call), {}))
    return run_ranks(payload, nprocs, None, timeout, style="spawn", what="spawn")


# ---- Process: dist_tuto's loop ------------------------------------------------------------------

_pending: list[Process] = []  # started, not yet run: they run together at the first join()
_pending_lock = threading.Lock()
_names = itertools.count(1)
_start_method: str | None = None


def _process_entry(index: int, envs: list, calls: list):
    """In the rank: process ``index`` of the batch, as ``multiprocessing``'s bootstrap runs it.
    Returns ``(pid, exitcode)``; ``sys.exit(n)`` is exit code ``n``, not an error."""
    os.environ.update(envs[index])
    fn, args, kwargs = cloudpickle.loads(calls[index])
    try:
        fn(*args, **kwargs)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return os.getpid(), e.code or 0
        print(e.code, file=sys.stderr)
        return os.getpid(), 1
    return os.getpid(), 0


def _no_target():
    pass


class Process:
    """``torch.multiprocessing.Process`` (``multiprocessing.Process``) for notebook-defined
    targets: ``p = mp.Process(target=fn, args=(...)); p.start(); ...; p.join()``.

    ``start()`` checks that ``target`` and its arguments can be sent to another process (by value
    with cloudpickle, as :func:`spawn` does) and queues the process; the first ``join()`` (or
    ``is_alive()``) runs *every* process started and not yet run, together, as the ranks of one
    launch, so processes that rendezvous with each other (dist_tuto's ``init_process`` on
    ``MASTER_ADDR``/``MASTER_PORT``) run at the same time. A subclass that overrides ``run()``
    works too. After the run, ``exitcode`` is 0 (``n`` for ``sys.exit(n)``) and ``pid`` the pid the
    process had.

    Differences from ``multiprocessing``: nothing runs between ``start()`` and the first
    ``join()``; a process that raises makes that ``join()`` raise
    :class:`~helpers.engine.WorkerError` naming it (instead of printing and setting ``exitcode``
    1) and ends the others of its batch (their ``exitcode``: ``-15``); ``join(timeout)`` bounds
    the whole batch (:class:`~helpers.engine.LaunchTimeout`, nothing left running, where
    ``multiprocessing`` would return with the processes still running); ``join()`` waits as long
    as they run, as ``multiprocessing``'s does.
    """

    def __init__(self, group=None, target: Callable | None = None, name: str | None = None,
                 args: tuple = (), kwargs: dict | None = None, *, daemon: bool | None = None):
        if group is not None:
            raise LaunchError("group must be None (as for multiprocessing.Process)")
        self._target = target
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self.name = name or f"Process-{next(_names)}"
        self.daemon = bool(daemon)
        self.exitcode: int | None = None
        self.pid: int | None = None
        self._state = "initial"  # initial -> started (queued) -> running -> finished
        self._call: bytes | None = None
        self._env: dict = {}

    def run(self) -> None:
        """What the process runs: ``target(*args, **kwargs)``; a subclass may override it."""
        if self._target is not None:
            self._target(*self._args, **self._kwargs)

    def start(self) -> None:
        """Queue the process for the first ``join()``.

        Raises:
            LaunchError: started twice, ``target`` not callable, or something in it or its
                arguments cannot be sent to another process (named).
        """
        if self._state != "initial":
            raise LaunchError(f"{self.name} was already started: a process can be started once")
        if type(self).run is Process.run:
            fn, args, kwargs = self._target or _no_target, self._args, self._kwargs
        else:  # a subclass's run(): the process object goes along by value
            fn, args, kwargs = self.run, (), {}
        check_callable(fn)
        self._call = serialise_call(fn, args, kwargs)
        self._env = _caller_env()
        with _pending_lock:
            _pending.append(self)
        self._state = "started"

    def join(self, timeout: float | None = None) -> None:
        """Run every started process not yet run (this one among them) and wait for them.

        Args:
            timeout: seconds for that run, counted from when every process of it is running
                (``None``, the default: no limit, as ``multiprocessing``'s ``join()``).

        Raises:
            LaunchError: the process was never started.
            WorkerError: a process of the run raised or was killed; every other one was ended.
            LaunchTimeout: the run took longer than a given ``timeout``.
        """
        if self._state == "initial":
            raise LaunchError(f"{self.name} was not started: call {self.name}.start() before join()")
        if self._state == "started":
            _run_pending(timeout)

    def is_alive(self) -> bool:
        """False once the process has run; a started process is run first (as by ``join()``)."""
        if self._state == "started":
            _run_pending(None)
        return False

    def terminate(self) -> None:
        """A started process that has not run yet is dropped (``exitcode`` ``-15``)."""
        self._drop(-signal.SIGTERM)

    def kill(self) -> None:
        """A started process that has not run yet is dropped (``exitcode`` ``-9``)."""
        self._drop(-signal.SIGKILL)

    def close(self) -> None:
        """Nothing to release (accepted for compatibility)."""

    def _drop(self, code: int) -> None:
        with _pending_lock:
            if self in _pending:
                _pending.remove(self)
                self._state, self.exitcode = "finished", int(code)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_call"] = None  # in the rank the process object itself is what runs
        return state

    def __repr__(self) -> str:
        shown = {"initial": "initial", "started": "started", "running": "started",
                 "finished": f"stopped exitcode={self.exitcode}"}[self._state]
        return f"<{type(self).__name__} name={self.name!r} {shown}>"


def _run_pending(timeout: float | None) -> None:
    """Run the queued processes together (process ``i`` is rank ``i``), set their exit codes."""
    with _pending_lock:
        batch = list(_pending)
        _pending.clear()
    if not batch:
        return
    for p in batch:
        p._state = "running"
    try:
        check_timeout(timeout)
        n = check_world_size(len(batch), "the number of started processes")
        payload = cloudpickle.dumps((_process_entry, ([p._env for p in batch], [p._call for p in batch]), {}))
        outcome = run_ranks(payload, n, None, timeout, style="spawn", what="Process.join")
    except WorkerError as e:
        for i, p in enumerate(batch):
            ended = i != e.rank and e.other_ranks.get(i, "ended by the launcher") == "ended by the launcher"
            p.exitcode = -signal.SIGTERM if ended else 1
        raise
    except LaunchTimeout as e:
        for i, p in enumerate(batch):
            p.exitcode = -signal.SIGTERM if i in e.ranks_not_finished else 0
        raise
    except BaseException:
        for p in batch:
            p.exitcode = -signal.SIGTERM
        raise
    finally:
        for p in batch:
            p._state = "finished"
    for p, (pid, code) in zip(batch, outcome):
        p.pid, p.exitcode = pid, int(code)


@atexit.register
def set_start_method(method: str, force: bool = False) -> None:
    """Accepted as in ``torch.multiprocessing``: ``"spawn"`` or ``"forkserver"`` (the ranks come
    from :mod:`helpers.engine.fork_server` either way); may be called again (no ``RuntimeError``).

    Raises:
        LaunchError: ``"fork"`` or an unknown method.
    """
    global _start_method
    _start_method = _check_start_method(method, "method")


def get_start_method(allow_none: bool = False) -> str | None:
    """The method :func:`set_start_method` set, else ``"spawn"`` (``None`` with ``allow_none``)."""
    return _start_method if _start_method is not None or allow_none else "spawn"


class _Context:
    """What :func:`get_context` returns: ``ctx.Process``, ``ctx.get_start_method()``."""

    Process = Process

    def __init__(self, method: str):
        self._method = method

    def get_start_method(self, allow_none: bool = False) -> str:
        return self._method

    def __getattr__(self, name: str):
        return __getattr__(name)

    def __repr__(self) -> str:
        return f"<helpers.mp context {self._method!r}>"


def get_context(method: str | None = None) -> _Context:
    """A context with ``Process`` (``mp.get_context("spawn").Process(...)``).

    Raises:
        LaunchError: ``"fork"`` or an unknown method.
    """
    return _Context(_check_start_method(method or get_start_method(), "method"))


_SHARE = ("return the value from the function instead: `results = mp.spawn(fn, args=(...), nprocs=n)` "
          "gives each process's return value in rank order (between ranks: a torch.distributed collective)")
_REWRITES = {
    **dict.fromkeys(("Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Manager", "Value", "Array", "Lock",
                     "RLock", "Event", "Condition", "Semaphore", "BoundedSemaphore", "Barrier"), _SHARE),
    "Pool": "`results = mp.spawn(fn, args=(...), nprocs=n)` runs fn(i, *args) in n processes and returns "
            "the values in rank order",
    "start_processes": "`mp.spawn(fn, args=(...), nprocs=n)`",
    "cpu_count": "`os.cpu_count()`",
    **dict.fromkeys(("ProcessRaisedException", "ProcessExitedException", "ProcessException"),
                    "`except helpers.engine.WorkerError` (helpers.mp raises it, naming the rank)"),
}


def __getattr__(name: str):
    """Any name of ``torch.multiprocessing`` not covered: an ``AttributeError`` with the rewrite."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    rewrite = _REWRITES.get(name, f"`torch.multiprocessing.{name}` (import torch.multiprocessing), which works "
                                  "with functions of an importable module, not ones defined in a notebook cell")
    raise AttributeError(f"helpers.mp has no {name!r} (it covers spawn, Process, set_start_method, "
                         f"get_start_method, get_context); instead: {rewrite}")
