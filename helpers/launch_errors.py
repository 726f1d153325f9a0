"""What :func:`helpers.launch.launch` raises, and the rule that picks the root-cause rank.

- :class:`LaunchError`: bad input, raised before any process starts (also by
  :func:`helpers.sending.serialise_call` for what cannot be sent to another process).
- :class:`WorkerError`: a rank raised, exited without a result, or was killed.
- :class:`LaunchTimeout`: the launch ran past its ``timeout``.
- :class:`OversubscriptionWarning`: more ranks than CPU cores.
- :func:`worker_error`: turn what the ranks left behind (their error markers, the elastic
  agent's failures) into one :class:`WorkerError` naming the rank that failed first.

All are importable from :mod:`helpers.launch`, where learners meet them.
"""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["LaunchError", "LaunchTimeout", "OversubscriptionWarning", "WorkerError", "worker_error"]


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

    def with_note(self, note: str | None) -> "WorkerError":
        """A fresh WorkerError with the same fields and ``note`` appended to its message."""
        new = WorkerError(self.rank, self.exc_type, self.message, self.traceback, self.other_ranks)
        if note:
            new.args = (f"{new.args[0]}\n({note})",)
        return new


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


#: Errors a rank raises because *another* rank died (it lost its peer), never a root cause.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def _is_secondary(err: dict) -> bool:
    return any(s in err["message"] for s in _SECONDARY)


def worker_error(error: BaseException, errors: dict[int, dict], started: set[int], done: set[int],
                 world_size: int) -> BaseException:
    """Turn what the ranks left behind into one :class:`WorkerError` naming the root-cause rank.

    Args:
        error: what the elastic agent raised (a ``ChildFailedError`` lists the ranks it saw die).
        errors: ``{rank: error marker}`` the ranks wrote (``type``, ``message``, ``traceback``,
            ``time``: seconds since the epoch).
        started: ranks that wrote their pid marker (``fn`` was reached).
        done: ranks that wrote their done marker (``fn`` returned).
        world_size: number of ranks.

    Root cause, in order: the earliest error a rank raised itself; else a rank the agent saw die
    (signal or exit code) without raising; else a started rank that vanished without a word
    while others lost their connection to it; else the earliest secondary error.

    Returns:
        the exception for the caller to raise: a :class:`WorkerError`, or ``error`` itself when
        no rank left a word and the agent names none.
    """
    failures = error.failures if isinstance(error, ChildFailedError) else {}
    primary = [e for e in errors.values() if not _is_secondary(e)]
    silent_dead = {r: f for r, f in failures.items() if r not in errors}
    vanished = sorted(r for r in started if r not in errors and r not in done)

    def others_except(rank):
        # a message's first line: a hint on the lines below is shown once, for the root-cause rank
        others = {r: f"{e['type']}: " + e["message"].partition("\n")[0][:200] for r, e in errors.items() if r != rank}
        others.update({r: "ended by the launcher" for r in range(world_size) if r != rank and r not in others})
        return others

    if primary:
        first = min(primary, key=lambda e: e["time"])
        return WorkerError(first["rank"], first["type"], first["message"], first["traceback"],
                           others_except(first["rank"]))
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
        return WorkerError(rank, kind, message, "", others_except(rank))
    if errors and vanished:
        rank = vanished[0]
        return WorkerError(rank, "exited without returning a result",
                           "the process ended without returning or raising (killed by a signal such as "
                           "SIGKILL, e.g. by the out-of-memory killer, or os._exit()); the other ranks "
                           "lost their connection to it", "", others_except(rank))
    if errors:
        first = min(errors.values(), key=lambda e: e["time"])
        return WorkerError(first["rank"], first["type"], first["message"], first["traceback"],
                           others_except(first["rank"]))
    return error
