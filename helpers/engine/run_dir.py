"""The run folder one launch shares with its ranks: its markers, and the reaper that removes it.

Each launch makes a fresh ``ddp-lab-launch-*`` in the temp directory; the ranks and the launcher talk
through JSON markers, each written atomically (a temp file, then ``os.replace``):

- ``pid.<rank>``: ``{"pid": int}``, written when the rank starts (before ``fn``);
- ``done.<rank>``: ``{"time": float}`` (seconds since the epoch), when ``fn`` returned;
- ``error.<rank>``: ``{"rank", "type", "message", "traceback", "time"}``, when ``fn`` raised;

and ``output/<rank>/std{out,err}.log`` (:mod:`helpers.engine.rank_output`); the agent's ``logs/``.

:func:`run_folder` removes the folder when the launch ends, and, through a reaper (``sh`` reading a
pipe only the launcher holds), when the launcher is SIGKILLed: at end-of-file it deletes the folder
and the paths it was given (``pymp-*``), four times over 2 s (a late rank cannot re-create it). A
normal end sends ``.``: it exits at once. Whoever ends a launcher's tree from outside must spare it
(:func:`is_reaper`): it exits by itself once the launcher is gone.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["REAPER_NAME", "is_reaper", "read_markers", "run_folder", "write_marker"]

#: The reaper: collect the paths the launcher sends ("$1" the folder, then one a line) until "." (a
#: normal end: exit) or end-of-file (the launcher died: remove them, four times over 2 s: a late rank).
_REAPER_SCRIPT = ('while read -r p; do [ "$p" = . ] && exit 0; set -- "$@" "$p"; done; '
                  'for _ in 1 2 3 4; do rm -rf -- "$@" 2>/dev/null; sleep 0.5; done')
#: The reaper's ``$0`` (its command line: ``sh -c <script> ddp-lab-run-folder-reaper <folder>``).
REAPER_NAME = "ddp-lab-run-folder-reaper"
_REAPER_STOP_S = 5.0  # how long the launcher waits for the reaper to exit after a launch (seconds)


@contextlib.contextmanager
def run_folder(also: str | None = None) -> Iterator[str]:
    """A fresh ``ddp-lab-launch-*`` folder in the temp directory, removed afterwards even if the
    launching process is SIGKILLed, then with ``also`` (see the module docstring; without a POSIX
    ``sh``, only after a normal end). Yields its path."""
    path = tempfile.mkdtemp(prefix="ddp-lab-launch-")
    reaper = _start_reaper(path)
    if reaper is not None and also:
        reaper.stdin.write(f"{also}\n".encode())
        reaper.stdin.flush()
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
    """Tell the reaper the launch ended (``.``: it exits) and reap it. A process forked from the
    launcher during the launch holds a copy of the pipe: kill it then."""
    if reaper is None:
        return
    with contextlib.suppress(OSError):  # BrokenPipeError: it was killed
        reaper.stdin.write(b".\n")
    with contextlib.suppress(OSError):
        reaper.stdin.close()
    try:
        reaper.wait(_REAPER_STOP_S)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


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
