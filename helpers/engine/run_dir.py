"""Temp folders: the run folder one launch shares with its ranks (and the reaper that removes it),
and :func:`socket_dir`, a temp folder short enough to hold a Unix socket.

:func:`helpers.engine.launch` makes a fresh folder ``ddp-lab-launch-*`` in the temp directory
for each launch. The ranks and the launcher talk through it with small JSON marker files, each
written atomically (a temp file, then ``os.replace``):

- ``pid.<rank>``: ``{"pid": int}``, written when the rank starts (before ``fn``);
- ``done.<rank>``: ``{"time": float}`` (seconds since the epoch), when ``fn`` returned;
- ``error.<rank>``: ``{"rank", "type", "message", "traceback", "time"}``, when ``fn`` raised;

and each rank points its own stdout and stderr (file descriptors 1 and 2) at
``output/<rank>/std{out,err}.log`` (:func:`capture_output`), which :class:`Relay` copies into the
caller's streams line by line. (torch's elastic agent writes its ``error.json`` files under ``logs/``.)

:func:`run_folder` removes the folder when the launch ends, and, through a tiny reaper process
(``sh`` blocked reading a pipe only the launcher holds open), also when the launcher itself is
SIGKILLed (the out-of-memory killer): the kernel closes the pipe, the reaper reads end-of-file
and deletes the folder. Whoever ends a launcher's process tree from outside (the notebook runner
after a cell timeout) must leave the reaper alone (:func:`is_reaper`): it exits by itself once
the launcher is gone, and killing it first leaves the folder behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["REAPER_NAME", "SUN_PATH_MAX", "Relay", "capture_output", "is_reaper", "rank_lines", "read_markers",
           "run_folder", "socket_dir", "write_marker"]

#: Bytes in a Unix socket's path, its final NUL included (``sun_path`` in ``<sys/un.h>``): 108 on
#: Linux, 104 on macOS and the BSDs (man 7 unix). ZeroMQ's ``ipc://`` endpoints are such sockets.
SUN_PATH_MAX = 108 if sys.platform.startswith("linux") else 104
#: Where :func:`socket_dir` looks when the temp directory's path is too long (CPython's choice, below).
SYSTEM_TEMP_DIRS = ("/tmp", "/var/tmp", "/usr/tmp")

#: The reaper: wait for end-of-file on stdin (the launcher ended or died), then remove the folder
#: ("$1"); a rank still writing a log line as it is SIGKILLed can refill it once, so retry.
_REAPER_SCRIPT = ('while read -r _; do :; done; '
                  'for _ in 1 2 3 4 5; do rm -rf -- "$1" 2>/dev/null; [ -e "$1" ] || exit 0; sleep 1; done')
#: The reaper's ``$0`` (its command line: ``sh -c <script> ddp-lab-run-folder-reaper <folder>``).
REAPER_NAME = "ddp-lab-run-folder-reaper"
_REAPER_STOP_S = 5.0  # how long the launcher waits for the reaper to exit after a launch (seconds)


@contextlib.contextmanager
def run_folder() -> Iterator[str]:
    """A fresh ``ddp-lab-launch-*`` folder in the temp directory, removed afterwards even if the
    launching process is SIGKILLed (see the module docstring; without a POSIX ``sh``, only
    after a normal end). Yields its path."""
    path = tempfile.mkdtemp(prefix="ddp-lab-launch-")
    reaper = _start_reaper(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _stop_reaper(reaper)


def _start_reaper(path: str) -> subprocess.Popen | None:
    sh = shutil.which("sh")
    if sh is None or sys.platform.startswith("win"):
        return None
    # its own session: a signal to the launcher's process group (Ctrl-C, a runner ending a kernel's
    # group) does not stop it before it has cleaned up; it exits by itself once the pipe closes
    return subprocess.Popen([sh, "-c", _REAPER_SCRIPT, REAPER_NAME, path],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)


def is_reaper(proc) -> bool:
    """Whether ``proc`` (a :class:`psutil.Process`) is the reaper of a run folder (see
    :func:`run_folder`). False for a process that is gone or cannot be inspected."""
    try:
        cmd = proc.cmdline()
    except Exception:  # psutil.Error (gone, zombie, access denied): not one to spare
        return False
    return len(cmd) >= 4 and cmd[1:2] == ["-c"] and cmd[2] == _REAPER_SCRIPT and cmd[3] == REAPER_NAME


def _stop_reaper(reaper: subprocess.Popen | None) -> None:
    """Close the reaper's pipe (it removes the folder, already gone, and exits) and reap it. A
    process forked from the launcher during the launch holds a copy of the pipe: kill it then."""
    if reaper is None:
        return
    reaper.stdin.close()
    try:
        reaper.wait(_REAPER_STOP_S)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def socket_dir(name_length: int) -> str:
    """A temp folder in which a Unix socket named with ``name_length`` more characters (after a path
    separator) fits in :data:`SUN_PATH_MAX`: the temp directory (``tempfile.gettempdir()``, i.e.
    ``TMPDIR``) when it fits, else the first of :data:`SYSTEM_TEMP_DIRS` that is a writable folder.

    A long ``TMPDIR`` (a cluster job's scratch folder, a test's ``tmp_path``) otherwise makes binding
    the socket fail with ``OSError: AF_UNIX path too long``. CPython 3.14 falls back to the same three
    folders for multiprocessing's own sockets (https://github.com/python/cpython/issues/132124);
    Python 3.10 to 3.12 do not.

    Returns:
        str: an absolute folder path.

    Raises:
        OSError: neither the temp directory nor any of :data:`SYSTEM_TEMP_DIRS` fits; the message
            gives ``TMPDIR``'s length and what to do.
    """
    def fits(folder: str) -> bool:
        return len(os.fsencode(folder)) + 1 + name_length < SUN_PATH_MAX

    base = tempfile.gettempdir()
    if fits(base):
        return base
    for folder in SYSTEM_TEMP_DIRS:
        if os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK) and fits(folder):
            return folder
    raise OSError(
        f"the temp directory {base!r} is {len(os.fsencode(base))} bytes long: a Unix socket in it "
        f"(a name of {name_length} characters) would pass the {SUN_PATH_MAX - 1}-byte limit, and none of "
        f"{', '.join(SYSTEM_TEMP_DIRS)} is a writable folder to use instead. Set TMPDIR to a shorter "
        "folder (for example `export TMPDIR=/tmp`) before starting Python or Jupyter.")


def write_marker(run_dir: str, kind: str, rank: int, payload: dict) -> None:
    """Write ``run_dir/<kind>.<rank>`` as JSON, atomically (readers never see half a file)."""
    path = os.path.join(run_dir, f"{kind}.{rank}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def read_markers(run_dir: str, kind: str) -> dict[int, dict]:
    """``{rank: payload}`` of the ``<kind>.<rank>`` markers written so far."""
    found = {}
    for path in glob.glob(os.path.join(run_dir, f"{kind}.*")):
        suffix = path.rsplit(".", 1)[-1]
        if suffix.isdigit():
            try:
                with open(path) as f:
                    found[int(suffix)] = json.load(f)
            except (OSError, ValueError):
                pass
    return found


#: Where :func:`capture_output` puts a rank's streams, below the run folder: ``output/<rank>/<name>.log``.
OUTPUT_DIR = "output"
_STREAMS = ((1, "stdout"), (2, "stderr"))


def capture_output(run_dir: str, rank: int) -> None:
    """In a rank, first thing: point file descriptors 1 and 2 at ``run_dir/output/<rank>/stdout.log``
    and ``stderr.log`` (``os.dup2``), which :class:`Relay` copies to the launcher, and make Python's
    ``sys.stdout``/``sys.stderr`` line-buffered.

    At the descriptor level, so what C code writes (gloo's warnings) and what a subprocess of the
    rank writes (a DataLoader worker, ``os.system``) is captured too, not only ``print``. Done here,
    not by torch's elastic agent (``redirects=`` in its ``LogsSpecs``): the agent's redirect is a
    null context on macOS and Windows (``get_std_cm`` in
    ``torch/distributed/elastic/multiprocessing/api.py``: ``if IS_WINDOWS or IS_MACOS ...: return
    nullcontext()``), where rank output would otherwise never reach the cell. What is still
    buffered when the rank's process ends normally (a last line without a newline, C stdio
    buffers) is flushed by a ``multiprocessing`` finaliser; a rank killed by a signal loses only
    what was not yet written out (with line buffering: at most its unfinished last line).
    """
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


class Relay:
    """Copies each rank's ``output/<rank>/std{out,err}.log`` (:func:`capture_output`) into the
    caller's streams line by line, prefixed ``[rank r]``: stdout to ``sys.stdout``, stderr to
    ``sys.stderr``, each rank's lines in the order it wrote them."""

    _pattern = re.compile(r"(\d+)/(stdout|stderr)\.log$")

    def __init__(self, run_dir: str):
        self.output_dir = os.path.join(run_dir, OUTPUT_DIR)
        self.files: dict[str, list] = {}  # path -> [rank, stream name, offset, pending bytes]

    def poll(self, final: bool = False) -> None:
        for path in glob.glob(os.path.join(self.output_dir, "*", "std*.log")):
            if path not in self.files:
                m = self._pattern.search(path.replace(os.sep, "/"))
                if m:
                    self.files[path] = [int(m.group(1)), m.group(2), 0, b""]
        for path, state in sorted(self.files.items(), key=lambda kv: (kv[1][0], kv[1][1])):
            rank, name, offset, pending = state
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            state[2] = offset + len(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            if final and pending:
                lines.append(pending)
                pending = b""
            state[3] = pending
            if lines:
                out = sys.stdout if name == "stdout" else sys.stderr
                out.write(rank_lines(rank, [line.decode("utf-8", "replace") for line in lines]))
                out.flush()
