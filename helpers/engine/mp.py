"""A notebook-safe drop-in for ``torch.multiprocessing``'s process starting: ``import helpers.mp as mp``.

Code written for ``torch.multiprocessing.spawn``, such as the official DDP tutorial's
(https://pytorch.org/tutorials/intermediate/ddp_tutorial.html), fails in a notebook: a cell's
function cannot be imported by a spawned process ("Can't get attribute 'demo_basic' on <module
'__main__'>"). With ``import helpers.mp as mp`` it runs (on CPU without the tutorial's CUDA lines,
docs/OWN_CODE.md lists them): ``fn`` goes by value with cloudpickle, and the ranks are started,
supervised and ended by :mod:`helpers.engine.launcher`'s machinery (forked from the fork server,
never from the kernel): ``[rank r]`` output, :class:`~helpers.engine.WorkerError` naming a failing
rank, nothing left behind. :func:`spawn` and :meth:`Process.join` wait as long as the processes run,
as torch's do; an optional ``timeout`` raises :class:`~helpers.engine.LaunchTimeout`.

Covered (what tutorials use): :func:`spawn`, :class:`Process` (``start``/``join``, dist_tuto's loop),
:func:`set_start_method`, :func:`get_start_method`, :func:`get_context`. Any other name (``Queue``,
``Pool``, ...) raises ``AttributeError`` with the one-line rewrite.

Unlike ``launch``, no process group is made for ``fn`` (the code makes its own), and the agent's
variables (``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``: ``init_process_group`` would join the agent's
store) are cleared in the rank; those the caller had set at :func:`spawn` are put back, as
``torch.multiprocessing.spawn`` passes them on. A fixed ``MASTER_PORT`` works for runs one after
another; two at the same time collide, as under torch (``launch`` picks a free port each time).
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
    ``torch.multiprocessing.spawn`` (``fn`` may be a cell's); ``fn``'s return values in index order
    (torch's returns ``None``). ``join`` must be ``True``; ``daemon`` is accepted and ignored;
    ``start_method`` ``"spawn"`` or ``"forkserver"`` (either way forked from the fork server);
    ``timeout``: ``None`` (no limit, as torch's) or seconds once every process runs ``fn``.

    Raises:
        LaunchError: bad input, before any process starts (``join=False``, ``start_method``, ``nprocs``,
            ``timeout``, ``args`` not a tuple) or something in ``fn``/``args`` that cannot be sent.
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
    """``multiprocessing.Process`` for notebook-defined targets (or a subclass's ``run()``):
    ``p = mp.Process(target=fn, args=(...)); p.start(); ...; p.join()``.

    ``start()`` checks what would be sent and queues the process; the first ``join()`` (or
    ``is_alive()``) runs every queued process together, as the ranks of one launch, so processes
    that rendezvous (dist_tuto's ``init_process``) meet. Then ``exitcode`` (``n`` for
    ``sys.exit(n)``) and ``pid``. Unlike ``multiprocessing``: nothing runs before that ``join()``;
    a process that raises makes it raise :class:`~helpers.engine.WorkerError` and ends the others
    (``exitcode`` ``-15``); ``join(timeout)`` bounds the batch and leaves nothing running.
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
        """Queue the process for the first ``join()``. Raises LaunchError: started twice, ``target`` not
        callable, or something it needs cannot be sent (named)."""
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
        """Run every queued process (this one among them) and wait; ``timeout``: seconds once all run.

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
def _warn_never_joined() -> None:
    if _pending:
        print(f"helpers.mp: {len(_pending)} process(es) started but never joined did not run; "
              "they run together at the first join(): call p.join() for each", file=sys.stderr)


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
    """A context with ``Process`` (``mp.get_context("spawn").Process(...)``); LaunchError for ``"fork"``."""
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
