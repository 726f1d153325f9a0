"""What :func:`helpers.engine.launch`, warm ranks and ``simulate`` raise, and :func:`worker_error`,
the rule that picks the root-cause rank (hints: :data:`HINTS`, in :mod:`helpers.engine.hints`).

In IPython they show as a few lines (``_render_traceback_``, :class:`Readable`): the cell's frames,
the message, the failing rank's own frames (helpers, torch and other libraries hidden), what to do.
"""

from __future__ import annotations

import traceback

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from helpers.engine.hints import HINTS, hint_for
from helpers.engine.start_method import install_spawn_hint
from helpers.engine.tracebacks import Frame, format_frames, ipython, own_frames, parse_frames

__all__ = ["HINTS", "RESTART_NOTE", "LaunchError", "LaunchInterrupted", "LaunchTimeout", "NoRanks",
           "OversubscriptionWarning", "RanksStopped", "RanksTimeout", "Readable", "SimulationUnavailable",
           "WorkerError", "hint_for", "own_frames", "worker_error"]


class Readable:
    """Mixin: in IPython, :meth:`_render_traceback_` shows a few lines instead of dozens of helpers'
    frames: the cell's frames, ``Type: message``, a failing rank's own frames, what to do."""

    def _rendered_message(self, shell) -> str:
        return str(self)

    def _render_traceback_(self) -> list[str]:
        """The lines IPython shows instead of its traceback (IPython's hook). Never raises."""
        name = type(self).__name__
        try:
            shell = ipython()
            red, normal = ("\x1b[0;31m", "\x1b[0m") if shell is not None and str(
                getattr(shell, "colors", "nocolor")).lower() != "nocolor" else ("", "")
            caller = own_frames([Frame(fs.filename, fs.lineno or 0, fs.name, (fs.line or "").strip())
                                 for fs in traceback.extract_tb(self.__traceback__)])
            lines = [f"{red}{name}{normal}".ljust(42 + len(red) + len(normal)) + "Traceback (most recent call last)"]
            lines += format_frames(caller, shell)
            message = self._rendered_message(shell).splitlines() or [""]
            lines.append(f"{red}{name}{normal}: {message[0]}")
            lines += message[1:]
            return lines
        except Exception:  # noqa: BLE001 - IPython would print our failure instead of the error
            return [f"{name}: {super().__str__()}"]



class RanksStopped(Readable, RuntimeError):
    """A call on warm ranks that ``WarmRanks.stop`` ended; nothing ran. Says how to start more."""


class _Stuck:
    """Mixin: a message followed by where each unfinished rank was stuck (a few lines per rank,
    :func:`helpers.engine.stacks.summary`); ``stacks`` holds each rank's full Python stack dump."""

    stacks: dict[int, str] = {}
    cells: dict[str, tuple[str, str, int]] = {}  # warm ranks' %%px cells: stacks.summary's ``cells``

    def _stuck_text(self, shell, full: str = "the error's .stacks") -> str:
        from helpers.engine.stacks import summary  # stacks imports this module

        base = self.args[0] if self.args else ""
        try:
            return "\n".join([base, *summary(self.stacks, shell, full, cells=self.cells)])
        except Exception:  # noqa: BLE001 - a dump we cannot read: the message alone
            return base

    def __str__(self) -> str:
        return self._stuck_text(None)

    def _rendered_message(self, shell) -> str:
        return self._stuck_text(shell, "sys.last_value.stacks")


class LaunchInterrupted(_Stuck, Readable, KeyboardInterrupt):
    """The caller was interrupted ("interrupt kernel", Ctrl-C) during a launch or a warm-rank call;
    the message says which processes were ended and, for a launch, where each unfinished rank was
    (``stacks``: ``{rank: Python stack dump}``). A ``KeyboardInterrupt``, shown in a few lines."""

    def __init__(self, message: str = "", stacks: dict[int, str] | None = None,
                 cells: dict[str, tuple[str, str, int]] | None = None):
        super().__init__(message)
        self.stacks = dict(stacks or {})
        self.cells = dict(cells or {})

    def __reduce__(self):
        return (type(self), (self.args[0] if self.args else "", self.stacks, self.cells))


class LaunchError(Readable, ValueError):
    """Bad input to :func:`launch`, raised before any process starts (also: the temp folder is full)."""


class WorkerError(Readable, RuntimeError):
    """A worker raised, exited without a result, or was killed. ``str(e)``: the rank, the error, its own
    frames, the other ranks in one line, what to do (:data:`HINTS`).

    Attributes:
        rank: the rank that failed first (the root cause).
        exc_type: the original type name (``"ZeroDivisionError"``), or e.g. ``"killed by SIGKILL"``.
        message, traceback: the original message; the whole traceback (``""`` if none).
        other_ranks: ``{rank: summary}`` of the other ranks that failed or were ended.
        notes: lines the launcher adds; hint: from :data:`HINTS` worded for ``caller``, or ``None``.
    """

    def __init__(self, rank: int, exc_type: str, message: str, tb: str, other_ranks: dict | None = None,
                 notes: tuple[str, ...] = (), caller: str = "launch"):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback = tb
        self.other_ranks = dict(other_ranks or {})
        self.notes = tuple(notes)
        self.caller = caller
        self.hint = hint_for(f"{exc_type}: {message}", caller)
        super().__init__(self._text(None))

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.message, self.traceback, self.other_ranks, self.notes,
                             self.caller))

    def __str__(self) -> str:
        return self._text(None)

    def _rendered_message(self, shell) -> str:
        return self._text(shell, full="sys.last_value.traceback")

    def _text(self, shell, full: str = "the error's .traceback") -> str:
        """The message: in a script (``shell`` None) with Python's file paths, in IPython with its
        cell names (``Cell In[3]``); ``full`` says where the whole traceback is."""
        lines = [f"rank {self.rank} failed with {self.exc_type}: {self.message}"]
        frames = parse_frames(self.traceback)
        own = own_frames(frames)
        if own:
            how = "most recent call last" if len(own) == len(frames) else f"your code; the full one is in {full}"
            lines.append(f"Traceback from rank {self.rank} ({how}):")
            lines += format_frames(own, shell)
        if self.other_ranks:
            lines.append(f"(other ranks: {_other_ranks_line(self.other_ranks)})")
        lines += [f"({note})" for note in self.notes]
        if self.hint:
            lines.append(f"What to do: {self.hint}")
        return "\n".join(lines)

    def with_note(self, note: str | None) -> "WorkerError":
        """A fresh WorkerError with the same fields and ``note`` appended to its message."""
        return WorkerError(self.rank, self.exc_type, self.message, self.traceback, self.other_ranks,
                           self.notes + ((note,) if note else ()), self.caller)


class LaunchTimeout(_Stuck, Readable, TimeoutError):
    """The launch ran past its ``timeout``; every worker was ended. ``str(e)``: when the clock started,
    which rank was in its own code and which waited in a collective, what to do, where each was stuck.

    Attributes:
        timeout: the limit in seconds; ranks_not_finished: ranks whose ``fn`` had not returned.
        stacks: ``{rank: faulthandler dump}`` of those, taken before they were ended (``{}``: none came).
        startup_s: seconds until every rank ran your function (``None``: not measured).
        in_startup: ranks that never reached your function (start-up took the time).
        default: ``timeout`` was the default; what: ``"launch"``, ``"spawn"``, ``"Process.join"`` ...
    """

    def __init__(self, timeout: float, ranks_not_finished: list[int], stacks: dict[int, str] | None = None,
                 startup_s: float | None = None, in_startup: list[int] | tuple = (), default: bool = False,
                 what: str = "launch"):
        self.timeout = timeout
        self.ranks_not_finished = list(ranks_not_finished)
        self.stacks = dict(stacks or {})
        self.startup_s = startup_s
        self.in_startup = list(in_startup)
        self.default = default
        self.what = what
        from helpers.engine.stacks import ranks_phrase, spans, timeout_advice  # stacks imports this module

        listed = self.ranks_not_finished if len(self.ranks_not_finished) <= 8 else spans(self.ranks_not_finished)

        lift = (f"raise the timeout ({what}'s default timeout={timeout:g} s; pass timeout=None for no limit)"
                if default else "pass a larger timeout, or timeout=None for no limit")
        if self.in_startup:
            head = (f"{what} timed out in start-up: start-up took {startup_s or 0:.1f} s (timeout={timeout:g} s "
                    f"counts only from when every rank runs your function) and "
                    f"{ranks_phrase(self.in_startup, verb=False)} had not yet started your function "
                    f"(new processes, imports, unpickling its arguments, the process group: slow on a loaded "
                    f"machine); ranks not finished: {listed}. Close other heavy programs and "
                    f"rerun, or {lift}.")
        else:
            since = "" if startup_s is None else f" (start-up took {startup_s:.1f} s before that)"
            head = (f"{what} timed out after {timeout:g} s, counted from when every rank was running your "
                    f"function{since}; ranks not finished: {listed}. "
                    f"{timeout_advice(self.ranks_not_finished, self.stacks, lift)}")
        super().__init__(f"{head} All workers were ended.")

    def __reduce__(self):
        return (type(self), (self.timeout, self.ranks_not_finished, self.stacks, self.startup_s, self.in_startup,
                             self.default, self.what))


# ---- warm ranks' and simulated ranks' errors -------------------------------------------------

#: what a warm-rank error adds once the ranks were ended
RESTART_NOTE = ("All ranks were ended; fresh ones start by themselves on the next run or %%px cell "
                 "(names defined on the ranks are gone: run your set-up cells again).")


class NoRanks(Readable, RuntimeError):
    """A ``%%px`` cell (or a call) with no warm ranks running: the message says how to start them."""


class RanksTimeout(LaunchTimeout):
    """A ``run`` or ``%%px`` cell ran past its ``timeout``; the ranks were ended (fresh ones start on the
    next call). As :class:`LaunchTimeout`, and ``cells``: ``{file name: (label, code, lines above)}``."""

    def __init__(self, timeout: float, ranks_not_finished: list[int], what: str = "run",
                 stacks: dict[int, str] | None = None, cells: dict[str, tuple[str, str, int]] | None = None):
        super().__init__(timeout, ranks_not_finished, stacks)
        from helpers.engine.stacks import timeout_advice  # stacks imports this module

        self.what = what
        self.cells = dict(cells or {})
        self.args = (
            f"{what} timed out after {timeout:g} s; ranks not finished: {self.ranks_not_finished}. "
            f"{timeout_advice(self.ranks_not_finished, self.stacks, 'pass a larger timeout')} " + RESTART_NOTE,
        )

    def __reduce__(self):
        return (type(self), (self.timeout, self.ranks_not_finished, self.what, self.stacks, self.cells))


class SimulationUnavailable(LaunchError):
    """This torch lacks the private pieces :func:`simulate` is built on; raised before any thread starts."""


class OversubscriptionWarning(UserWarning):
    """More ranks than CPU cores: ranks share cores, so timings are not meaningful."""


#: Errors a rank raises because *another* rank died (it lost its peer), never a root cause.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def _is_secondary(err: dict) -> bool:
    return any(s in err["message"] for s in _SECONDARY)


def worker_error(error: BaseException | None, errors: dict[int, dict], started: set[int],
                 done: set[int], world_size: int, caller: str = "launch") -> BaseException | None:
    """One :class:`WorkerError` naming the root-cause rank (or ``error`` itself, when no rank left a word
    and the agent names none), from the agent's ``error`` (a ``ChildFailedError`` lists the ranks it
    saw die), the ranks' ``errors`` markers (``{rank: {type, message, traceback, time}}``) and the
    ``started``/``done`` rank sets. Root cause, in order: the earliest error a rank raised itself; a
    rank the agent saw die; a started rank that vanished while others lost it; the earliest secondary.
    ``caller``: ``"launch"`` or ``"simulate"``: who ended the other ranks, whom the hint is for."""
    failures = error.failures if isinstance(error, ChildFailedError) else {}
    primary = [e for e in errors.values() if not _is_secondary(e)]
    silent_dead = {r: f for r, f in failures.items() if r not in errors}
    vanished = sorted(r for r in started if r not in errors and r not in done)
    ended = "ended by the simulation" if caller == "simulate" else "ended by the launcher"

    def failed(rank: int, kind: str, message: str, tb: str = "") -> WorkerError:
        # a message's first line: a hint on the lines below is shown once, for the root cause
        others = {r: _short(f"{e['type']}: " + e["message"].partition("\n")[0]) for r, e in errors.items() if r != rank}
        others.update({r: ended for r in range(world_size)
                       if r != rank and r not in others and r not in done})
        return WorkerError(rank, kind, message, tb, others, caller=caller)

    if primary or (errors and not silent_dead and not vanished):
        first = min(primary or errors.values(), key=lambda e: e["time"])
        return failed(first["rank"], first["type"], first["message"], first["traceback"])
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
        return failed(rank, kind, message)
    if errors and vanished:
        return failed(vanished[0], "exited without returning a result",
                      "the process ended without returning or raising (killed by a signal such as "
                      "SIGKILL, or os._exit()); the other ranks lost their connection to it")
    return error


# torch.multiprocessing.spawn's crash in a notebook happens outside the engine: the kernel that imports
# these errors shows the hint under it (helpers.engine.start_method.install_spawn_hint)
install_spawn_hint()


def _short(text: str, limit: int = 160) -> str:
    """``text`` cut at a word before ``limit`` characters, with "..." where it was cut."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _other_ranks_line(other_ranks: dict[int, str]) -> str:
    """``"ranks 1-15: ended by the launcher; rank 3: ValueError: ..."``: ranks with the same summary
    together, four or more consecutive ranks as a span."""
    from helpers.engine.stacks import ranks_phrase  # stacks imports tracebacks, not this module

    groups: dict[str, list[int]] = {}
    for r, summary in sorted(other_ranks.items()):
        groups.setdefault(summary, []).append(r)
    return "; ".join(f"{ranks_phrase(ranks, verb=False)}: {summary}" for summary, ranks in groups.items())
