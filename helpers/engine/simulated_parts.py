"""The parts of :mod:`helpers.engine.simulated` that run inside the rank threads: the turns (one rank
at a time, each with its own random state) and the streams that keep each rank's output apart."""

from __future__ import annotations

import collections
import contextlib
import functools
import random
import sys
import threading
from typing import Any

import torch

__all__ = ["CollectiveMismatch", "_RankStream", "_Stopped", "_Turns", "_calls", "_gives_turn", "_local",
           "_random_state", "_set_random_state", "_turn_given"]

_local = threading.local()  # in a rank thread: .rank, .run, .holding (it has the turn)


class _Stopped(BaseException):
    """Raised in a rank thread the simulation ends (a peer failed, a timeout, an interrupt)."""


# ---- random state: torch's CPU generator, Python's random, numpy's (when imported) ---------------

def _random_state():
    np = sys.modules.get("numpy")
    return (torch.default_generator.get_state(), random.getstate(), np.random.get_state() if np else None)


def _set_random_state(state) -> None:
    torch.default_generator.set_state(state[0])
    random.setstate(state[1])
    np = sys.modules.get("numpy")
    if np is not None and state[2] is not None:
        np.random.set_state(state[2])


def _fresh_random_state() -> None:
    """What a new process starts with: generators seeded from the operating system."""
    torch.default_generator.seed()
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


# ---- turns: one rank at a time --------------------------------------------------------------------

class _Turns:
    """One rank runs at a time, in the order the ranks asked (at the start: rank order); a rank gives
    its turn up while it waits in a collective and keeps its own random state from turn to turn."""

    def __init__(self, world_size: int):
        self._lock = threading.Lock()
        self._events = [threading.Event() for _ in range(world_size)]
        self._queue = collections.deque(range(world_size))  # ranks waiting for a turn, first first
        self._queued = set(self._queue)
        self._holder: int | None = None
        self._stopped = False
        self._states: dict[int, Any] = {}

    def _hand_on(self) -> None:  # under self._lock
        if self._holder is None and self._queue and not self._stopped:
            self._holder = self._queue.popleft()
            self._queued.discard(self._holder)
            self._events[self._holder].set()

    def _wait_turn(self, rank: int) -> None:
        with self._lock:
            if rank not in self._queued and self._holder != rank:
                self._queue.append(rank)
                self._queued.add(rank)
            self._hand_on()
        self._events[rank].wait()
        self._events[rank].clear()
        if self._stopped:
            raise _Stopped("the simulation ended this rank")
        state = self._states.get(rank)
        if state is None:
            _fresh_random_state()
        else:
            _set_random_state(state)

    def give(self, rank: int) -> None:
        self._states[rank] = _random_state()
        with self._lock:
            self._holder = None
            self._hand_on()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for event in self._events:
                event.set()


@contextlib.contextmanager
def _turn_given():
    """In a rank thread that has the turn: give it up for the block (a wait for the other ranks)."""
    run, rank = getattr(_local, "run", None), getattr(_local, "rank", None)
    if run is None or not getattr(_local, "holding", False):
        yield
        return
    run.turns.give(rank)
    _local.holding = False
    try:
        yield
    finally:
        run.turns._wait_turn(rank)
        _local.holding = True


class CollectiveMismatch(RuntimeError):
    """Simulated ranks called different collectives, or one with tensors of different shapes, at the
    same point of a process group's sequence (real ranks would hang there, or fail inside gloo)."""


class _Calls:
    """The collectives each rank has called on each process group, in order: the n-th call of every
    rank must be the same operation, and an all-reduce or broadcast gets tensors of the same shape."""

    SAME_SHAPES = ("allreduce", "allreduce_coalesced", "broadcast")

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], tuple[int, str, int]] = {}  # (group, n) -> (rank, signature, ranks in)
        self._counts: dict[tuple[str, int], int] = {}  # (group, rank) -> calls so far

    @staticmethod
    def _signature(name: str, args) -> str:
        if name not in _Calls.SAME_SHAPES:
            return name
        tensors = args[0] if args and isinstance(args[0], (list, tuple)) else []
        shapes = [list(t.shape) for t in tensors if isinstance(t, torch.Tensor)]
        return f"{name} of shape {shapes[0] if len(shapes) == 1 else shapes}"

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()
            self._counts.clear()

    def check(self, group: str, rank: int, world_size: int, name: str, args) -> None:
        """Record ``rank``'s next call on ``group``; raise :class:`CollectiveMismatch` if an earlier
        rank's call at the same point differs."""
        signature = self._signature(name, args)
        with self._lock:
            n = self._counts.get((group, rank), 0) + 1
            self._counts[(group, rank)] = n
            first = self._seen.get((group, n))
            if first is None:
                self._seen[(group, n)] = (rank, signature, 1)
                return
            other, expected, arrived = first
            if signature == expected:
                if arrived + 1 == world_size:
                    del self._seen[(group, n)]
                else:
                    self._seen[(group, n)] = (other, expected, arrived + 1)
                return
        raise CollectiveMismatch(
            f"ranks called different collectives at the same point (call {n} on this process group): "
            f"rank {other} called {expected}, rank {rank} called {signature}. Every rank must call the same "
            "collectives in the same order, with tensors of the same shape: look for a collective inside "
            "`if rank == ...:`, or a loop that runs a different number of times on some rank.")


_calls = _Calls()


def _gives_turn(method):
    """A process group's collective that gives the rank's turn up while it waits for the others, after
    checking that every rank makes the same call at this point (:class:`_Calls`)."""
    @functools.wraps(method)
    def collective(self, *args, **kwargs):
        if getattr(_local, "in_collective", False):  # barrier() calls allreduce(): one call
            return method(self, *args, **kwargs)
        if getattr(_local, "run", None) is not None:
            _calls.check(self.pg_name, self.rank(), self.size(), method.__name__, args)
        _local.in_collective = True
        try:
            with _turn_given():
                return method(self, *args, **kwargs)
        finally:
            _local.in_collective = False
    return collective


# ---- output: each rank's lines, kept apart --------------------------------------------------------

class _RankStream:
    """Stands in for ``sys.stdout`` or ``sys.stderr`` during a run: what a rank thread of ``run``
    writes is kept per rank until the caller relays it; what any other thread writes goes straight
    through."""

    def __init__(self, stream, name: str, run):
        self._stream, self._name, self._run = stream, name, run

    def write(self, text: str) -> int:
        rank = getattr(_local, "rank", None)
        if rank is None or getattr(_local, "run", None) is not self._run:
            return self._stream.write(text)
        with self._run.lock:
            key = (rank, self._name)
            self._run.pending[key] = self._run.pending.get(key, "") + text
        return len(text)

    def flush(self) -> None:
        if getattr(_local, "rank", None) is None:
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)
