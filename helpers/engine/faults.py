"""Deliberate faults, for the launcher's fault tests and the debugging lessons.

Each function is a worker for :func:`helpers.engine.launch` (``fn(rank, world_size, ...)``) that
misbehaves on purpose on one rank, in one of the ways DDP jobs really fail: an exception before,
during or after a collective, a rank that skips a collective (the classic hang), an exit without
a result, a SIGKILL (what the out-of-memory killer sends), an unpicklable return value, a slow
start-up (:class:`SlowStart`).
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

#: When a rank fails relative to the collectives of the others.
MOMENTS = ("before", "during", "after")


def _all_reduce_ones() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def ok(rank, world_size):
    """A trivial worker: one all_reduce, returns the rank (int)."""
    _all_reduce_ones()
    return rank


def fail_at(rank, world_size, bad_rank=1, moment="before"):
    """Rank ``bad_rank`` raises ``ValueError`` at ``moment``; the others run normally.

    moment: ``"before"`` its first collective; ``"during"``: after the others have entered an
    all_reduce (it sleeps 0.5 s first, then raises instead of joining); ``"after"`` the last
    collective (the others have returned from ``fn``).
    """
    if moment not in MOMENTS:
        raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}")
    if rank == bad_rank and moment == "before":
        raise ValueError(f"injected failure on rank {rank} before the first collective")
    if rank == bad_rank and moment == "during":
        time.sleep(0.5)  # the other ranks are now waiting inside all_reduce
        raise ValueError(f"injected failure on rank {rank} while the others wait in all_reduce")
    total = _all_reduce_ones()
    if rank == bad_rank:
        raise ValueError(f"injected failure on rank {rank} after the last collective")
    return total


def skip_collective(rank, world_size, skip_rank=0):
    """Rank ``skip_rank`` returns at once; the others wait forever in an all_reduce (a hang)."""
    if rank == skip_rank:
        return rank
    return _all_reduce_ones()


def sleep_then_all_reduce(rank, world_size, slow_rank=1, seconds=4.0):
    """Rank ``slow_rank`` sleeps ``seconds`` before the all_reduce the others already wait in (past a
    short ``timeout``, a rank too slow rather than one that skips)."""
    if rank == slow_rank:
        time.sleep(seconds)
    return _all_reduce_ones()


def barrier_on_one_rank(rank, world_size, lonely_rank=0):
    """Only rank ``lonely_rank`` calls ``dist.barrier()`` (the classic ``if rank == 0: save();
    dist.barrier()``); the others return at once. The lonely rank waits forever."""
    import torch.distributed as dist

    if rank == lonely_rank:
        dist.barrier()
    return rank


def exit_early(rank, world_size, bad_rank=1, how="os._exit"):
    """Rank ``bad_rank`` leaves without a result: ``how="os._exit"`` (code 0) or ``"sys.exit"`` (code 3)."""
    if rank == bad_rank:
        time.sleep(0.5)
        if how == "os._exit":
            os._exit(0)
        sys.exit(3)
    return _all_reduce_ones()


def sigkill_during_collective(rank, world_size, bad_rank=1):
    """Rank ``bad_rank`` SIGKILLs itself while the others wait in an all_reduce."""
    if rank == bad_rank:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    return _all_reduce_ones()


def unpicklable_result(rank, world_size, bad_rank=1):
    """Rank ``bad_rank`` returns a lock, which cannot be pickled back to the caller."""
    return threading.Lock() if rank == bad_rank else rank


def _slow_to_unpickle(seconds: float, slow_rank: int, value):
    if int(os.environ.get("RANK", "-1")) == slow_rank:
        time.sleep(seconds)
    return value


class SlowStart:
    """An argument for a worker that rank ``slow_rank`` takes ``seconds`` to unpickle: a slow start-up
    (a busy machine, a big argument, a slow import) before ``fn`` runs. Unpickles to ``value``."""

    def __init__(self, seconds: float, slow_rank: int = 1, value=None):
        self.seconds, self.slow_rank, self.value = seconds, slow_rank, value

    def __reduce__(self):
        return (_slow_to_unpickle, (self.seconds, self.slow_rank, self.value))
