"""Each rank's output: captured by the rank into the run folder, relayed to the caller as ``[rank r]`` lines.

:func:`capture_output` points a rank's file descriptors 1 and 2 at ``output/<rank>/std{out,err}.log``
in its run folder (:mod:`helpers.engine.run_dir`); :class:`Relay` copies those files into the
caller's streams line by line; :class:`CappedLines` caps what a stream shows and :func:`rank_lines`
formats a rank's line, for every launcher (warm and simulated ranks use them too);
:class:`TextRelay` relays what rank threads of this process write.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import glob
import os
import re
import shutil
import sys
import tempfile
import threading

__all__ = ["HEAD_LINES", "OUTPUT_DIR", "CappedLines", "Relay", "TAIL_LINES", "TextRelay",
           "capture_output", "rank_lines"]


#: Where :func:`capture_output` puts a rank's streams, below the run folder: ``output/<rank>/<name>.log``.
OUTPUT_DIR = "output"
_STREAMS = ((1, "stdout"), (2, "stderr"))


def capture_output(run_dir: str, rank: int) -> None:
    """In a rank, first thing: file descriptors 1 and 2 to ``run_dir/output/<rank>/stdout.log`` and
    ``stderr.log`` (``os.dup2``: C code's and subprocesses' output too), which :class:`Relay` copies to
    the launcher; ``sys.stdout``/``sys.stderr`` line-buffered, flushed at exit by a finaliser. Not the
    agent's ``redirects=``: a null context on macOS and Windows (``get_std_cm`` in elastic's ``api.py``)."""
    folder = os.path.join(run_dir, OUTPUT_DIR, str(rank))
    os.makedirs(folder, exist_ok=True)
    _flush_all()
    for fd, name in _STREAMS:
        target = os.open(os.path.join(folder, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
        stream = getattr(sys, name)
        if stream is None or _fileno(stream) != fd:  # no console (pythonw), or not the descriptor
            setattr(sys, name, open(fd, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False))
        else:
            with contextlib.suppress(Exception):  # not a TextIOWrapper: leave it
                stream.reconfigure(line_buffering=True)
    from multiprocessing import util  # a rank is a multiprocessing child: its finalisers run at its exit
    util.Finalize(None, _flush_all, exitpriority=-1000)


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except Exception:  # noqa: BLE001 - io.UnsupportedOperation, ValueError (closed)
        return None


def _flush_all() -> None:
    """Flush Python's ``sys.stdout``/``sys.stderr``, then C's stdio buffers (``fflush(NULL)``)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def rank_lines(rank: int, lines: list[str]) -> str:
    """``lines`` (without their newlines) as the caller is shown a rank's output: each prefixed
    ``[rank r]``, only what follows its last carriage return (a progress bar's final state), each
    ending in a newline."""
    return "".join(f"[rank {rank}] {line.rsplit(chr(13), 1)[-1]}\n" for line in lines)


#: What each rank's stdout (and stderr) relays into the cell: its first ``HEAD_LINES`` lines as they
#: come; past that, a note, and when the run ends how many lines were left out and the last
#: ``TAIL_LINES``. The whole stream is kept in a file the notes name (a 1,000,000-line print was 109 MB).
HEAD_LINES = TAIL_LINES = 2000


class CappedLines:
    """One rank's stream (``name``: ``"stdout"`` or ``"stderr"``) as the caller's ``out`` is shown it, for
    every launcher: the first :data:`HEAD_LINES` lines (str, without newlines) as they come, then a note
    naming ``kept``, and from :meth:`end` how many lines were left out and the last :data:`TAIL_LINES`.
    :meth:`add` serves streams held in memory (``simulate``, warm ranks): past the cap it writes the whole
    stream to a new ``ddp-lab-output-*-rank<r>.<name>.log`` in the temp directory. :class:`Relay`, whose
    streams are files already, calls :meth:`show` and :meth:`end` itself."""

    def __init__(self, rank: int, name: str, out, kept: str | None = None, ends: str = "launch", fmt=rank_lines):
        self.rank, self.name, self.out, self.kept, self.ends, self.fmt = rank, name, out, kept, ends, fmt
        self.shown, self.head, self.file, self.tail, self.hidden = 0, [], None, collections.deque(maxlen=TAIL_LINES), 0
        self.rest = ""  # feed's unended last line

    def show(self, lines: list[str]) -> int:
        """Writes the lines that fit under the cap, and the note when some do not; returns how many fit."""
        show = lines[:HEAD_LINES - self.shown]
        self.shown += len(show)
        text = show if len(show) == len(lines) else [*show, (
            f"... more than {HEAD_LINES:,} lines: the last {TAIL_LINES:,} come when the {self.ends} ends; "
            f"the whole output will be in {self.kept}")]
        if text:
            self.out.write(self.fmt(self.rank, text))
            self.out.flush()
        return len(show)

    def add(self, lines: list[str]) -> None:
        if self.file is None and self.shown + len(lines) <= HEAD_LINES:
            self.head += lines
            self.show(lines)
            return
        if self.file is None:
            fd, self.kept = tempfile.mkstemp(prefix="ddp-lab-output-", suffix=f"-rank{self.rank}.{self.name}.log")
            self.file = open(fd, "w", encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by end()
            n = self.show(lines)
            self.head, lines = self.head + lines[:n], lines[n:]
            self.file.write("".join(f"{line}\n" for line in self.head))
        self.file.write("".join(f"{line}\n" for line in lines))
        self.tail.extend(lines)
        self.hidden += len(lines)

    def feed(self, text: str, final: bool = False) -> None:
        """:meth:`add` for text in any pieces: whole lines now; with ``final``, the rest and :meth:`end`."""
        *lines, self.rest = (self.rest + text).split("\n")
        if final and self.rest:
            lines, self.rest = [*lines, self.rest], ""
        if lines:
            self.add(lines)
        if final:
            self.end()

    def end(self, count: int = 0, tail=()) -> None:
        """Writes how many of the lines past the cap (``count``; by default those :meth:`add` kept) were not
        shown, and the last of them (``tail``)."""
        if self.file is not None:
            self.file.close()
            count, tail = self.hidden, self.tail
        note = [f"... {count - len(tail):,} lines not shown here; the whole output ({self.shown + count:,} lines) "
                f"is in {self.kept}"] if count else []
        if note or tail:
            self.out.write(self.fmt(self.rank, [*note, *tail]))
            self.out.flush()


class Relay:
    """Copies each rank's ``output/<rank>/std{out,err}.log`` into the caller's ``sys.stdout``/``sys.stderr``
    as ``[rank r]`` lines, in order, capped by :class:`CappedLines` (the whole stream kept in a temp file)."""

    _pattern = re.compile(r"(\d+)/(stdout|stderr)\.log$")

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.output_dir = os.path.join(run_dir, OUTPUT_DIR)
        self.files: dict[str, list] = {}  # path -> [CappedLines, offset, pending bytes]

    def poll(self, final: bool = False) -> None:
        folder, run = os.path.split(self.run_dir.rstrip(os.sep))
        for path in glob.glob(os.path.join(self.output_dir, "*", "std*.log")):
            m = None if path in self.files else self._pattern.search(path.replace(os.sep, "/"))
            if m:
                rank, name = int(m.group(1)), m.group(2)
                kept = os.path.join(folder, f"ddp-lab-output-{run.rsplit('-', 1)[-1]}-rank{rank}.{name}.log")
                self.files[path] = [CappedLines(rank, name, getattr(sys, name), kept), 0, b""]
        for path, state in sorted(self.files.items(), key=lambda kv: (kv[1][0].rank, kv[1][0].name)):
            cap, offset, pending = state
            if cap.shown < HEAD_LINES:
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except OSError:
                    continue
                base = offset - len(pending)  # where the bytes held and read start in the file
                state[1] = offset + len(data)
                *lines, pending = (pending + data).split(b"\n")
                if final and pending:
                    lines.append(pending)
                    pending = b""
                state[2] = pending
                lines = lines[:HEAD_LINES - cap.shown + 1]  # one past the room: whether the cap applies
                n = cap.show([line.decode("utf-8", "replace") for line in lines])
                if n < len(lines):  # capped: the rest is read from the file at the end
                    state[1], state[2] = base + sum(len(x) + 1 for x in lines[:n]), b""
            if final and cap.shown >= HEAD_LINES and state[1] is not None:
                self._tail(path, state)

    @staticmethod
    def _tail(path: str, state: list) -> None:
        """After the cap, at the end: the lines past it counted, the last :data:`TAIL_LINES` shown, the
        file moved to where the note said."""
        cap, start, state[1] = state[0], state[1], None  # None: done
        tail, count = collections.deque(maxlen=TAIL_LINES), 0
        try:
            with open(path, "rb") as f:
                f.seek(start)
                for line in f:
                    count += 1
                    tail.append(line.rstrip(b"\n").decode("utf-8", "replace"))
            if count:  # not exactly HEAD_LINES lines, all shown
                shutil.move(path, cap.kept)
        except OSError as e:
            tail, count = [f"... the output past the first {HEAD_LINES:,} lines could not be read ({e})"], 0
        cap.end(count, tail)


class TextRelay:
    """Rank streams written in this process (simulated ranks are threads): :meth:`write` from any
    thread; :meth:`poll`, in the caller, relays whole lines into ``streams[name]`` as
    :class:`CappedLines` (``final``: the rest too). A rank for which ``shown(rank)`` is false is counted, not shown:
    :attr:`hidden_lines`, and in :attr:`hidden` each of its streams' unended line."""

    def __init__(self, streams: dict, ends: str, shown=lambda rank: True):
        self.streams, self.ends, self.shown, self.lock = streams, ends, shown, threading.Lock()
        self.pending: dict[tuple[int, str], str] = {}  # written, not yet relayed
        self.capped: dict[tuple[int, str], CappedLines] = {}
        self.hidden: dict[tuple[int, str], str] = {}
        self.hidden_lines = 0

    def write(self, rank: int, name: str, text: str) -> None:
        with self.lock:
            self.pending[(rank, name)] = self.pending.get((rank, name), "") + text

    def poll(self, final: bool = False) -> None:
        with self.lock:
            items, self.pending = sorted(self.pending.items()), {}
        for key, text in items:
            if self.shown(key[0]):
                capped = CappedLines(*key, self.streams[key[1]], ends=self.ends)
                self.capped.setdefault(key, capped).feed(text)
            else:
                *lines, self.hidden[key] = (self.hidden.get(key, "") + text).split("\n")
                self.hidden_lines += len(lines)
        for key in sorted(self.capped) if final else ():
            self.capped[key].feed("", final=True)
