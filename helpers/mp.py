"""A notebook-safe drop-in for ``torch.multiprocessing.spawn``: ``import helpers.mp as mp``.

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
unchanged: ``fn`` and what it uses are sent by value with cloudpickle, and the ranks are
started, supervised and ended by :mod:`helpers.launch`'s machinery (torch's elastic agent; ranks
forked from :mod:`helpers.fork_server`'s server, never from the kernel, which is what ``spawn``
guarantees, without every rank importing torch), so worker output appears in the cell prefixed ``[rank r]``, a failing
rank raises :class:`~helpers.launch.WorkerError` naming it, ``timeout`` raises
:class:`~helpers.launch.LaunchTimeout`, and no process is left behind.

Unlike :func:`helpers.launch.launch`, no process group is initialised for ``fn`` (the code does it
itself, as it would under ``torch.multiprocessing.spawn``), and the worker's environment has none
of the agent's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_*``): with ``TORCHELASTIC_USE_AGENT_STORE`` set, ``init_process_group``'s env://
rendezvous would connect to the agent's store instead of creating its own on the code's
``MASTER_PORT``. Those the *caller* had set in ``os.environ`` when it called :func:`spawn` are put
back, as ``torch.multiprocessing.spawn`` passes the parent's environment on: a script that sets
``MASTER_ADDR``/``MASTER_PORT`` before ``mp.spawn`` and calls
``init_process_group("gloo", rank=rank, world_size=world_size)`` in the worker works.

A fixed ``MASTER_PORT`` (the tutorial's ``"12355"``) works for runs one after another (the
group's store is closed when the code destroys its group or, at the latest, when its process
ends, and the port is reusable at once); two such runs *at the same time* on one machine collide,
exactly as they would with ``torch.multiprocessing.spawn``. :func:`helpers.launch.launch`
chooses a free port for every launch instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import cloudpickle

from helpers.launch import (
    LaunchError,
    _check_callable,
    _check_timeout,
    _check_world_size,
    _run,
)
from helpers.rank_entry import _AGENT_ENV
from helpers.sending import serialise_call

__all__ = ["spawn"]


def _caller_env() -> dict[str, str]:
    """The variables of the agent's (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...) that the
    caller itself has set: the ranks get these back after the agent's own are cleared."""
    return {name: os.environ[name] for name in _AGENT_ENV if name in os.environ}


def _spawn_entry(rank: int, env: dict, call: bytes):
    """In the rank: the caller's variables back into ``os.environ``, then ``fn(rank, *args)``."""
    os.environ.update(env)
    fn, args, kwargs = cloudpickle.loads(call)
    return fn(rank, *args, **kwargs)


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn", *, timeout: float | None = 300.0) -> list:
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
            :mod:`helpers.fork_server`'s server (never from the kernel).
        timeout: seconds for the whole run (not in ``torch.multiprocessing.spawn``, which waits
            forever); ``None``: no limit.

    Returns:
        list: ``fn``'s return value in each process, in index order (``torch.multiprocessing.spawn``
        returns ``None``; the values are an addition).

    Raises:
        LaunchError: bad input, before any process starts: ``join=False``, a ``start_method``
            other than ``"spawn"`` or ``"forkserver"``, a bad ``nprocs`` or ``timeout``, ``args`` not a tuple, or
            something in ``fn``/``args`` that cannot be sent to another process.
        WorkerError: a process raised, exited or was killed; the others are ended.
        LaunchTimeout: the run took longer than ``timeout``.
    """
    if join is not True:
        raise LaunchError(
            "join=False is not supported: in a notebook the processes must be supervised by the call "
            "(output relayed, errors raised, nothing left behind), so spawn() returns only when every "
            "process has finished. Use join=True; for ranks that live across cells see the warm ranks."
        )
    if start_method not in ("spawn", "forkserver"):
        raise LaunchError(
            f"start_method={start_method!r} is not supported, only 'spawn' or 'forkserver': a process "
            "forked from a kernel that has touched CUDA fails with 'Cannot re-initialize CUDA in forked "
            "subprocess', and forking a multi-threaded kernel can deadlock. Use start_method='spawn' "
            "(the default; the ranks come from helpers.fork_server either way)."
        )
    if not isinstance(args, tuple):
        raise LaunchError(f"args must be a tuple (as for torch.multiprocessing.spawn), got {type(args).__name__}; "
                          f"e.g. args=(world_size,).")
    nprocs = _check_world_size(nprocs, "nprocs")
    _check_callable(fn)
    _check_timeout(timeout)
    call = serialise_call(fn, args, {})
    payload = cloudpickle.dumps((_spawn_entry, (_caller_env(), call), {}))
    return _run(payload, nprocs, None, timeout, style="spawn")
