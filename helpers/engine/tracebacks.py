"""Learner-sized tracebacks: a traceback's frames, the learner's own among them, and how to print them.

:func:`parse_frames` reads Python's and IPython's traceback text; :func:`own_frames` keeps the
learner's frames (not helpers, the standard library or an installed package); :func:`format_frames`
prints them as Python does, or with IPython's cell names (``Cell In[3], line 2``). The exceptions of
:mod:`helpers.engine.errors` and the stack summaries of :mod:`helpers.engine.stacks` use them.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
from typing import NamedTuple

__all__ = ["HELPERS_DIR", "Frame", "format_frames", "ipython", "is_hidden", "own_frames", "parse_frames"]


# ---- the learner's own frames ---------------------------------------------------------------

class Frame(NamedTuple):
    """One traceback frame: ``file``, ``line`` (int), ``name`` (function), ``source`` (the line's
    code, ``""`` if unknown) and ``label`` (a ready-made location such as ``"Cell In[3], line 2"``
    from an IPython-formatted traceback, else ``""``)."""

    file: str
    line: int
    name: str
    source: str
    label: str = ""


#: the ``helpers/`` folder (engine and course helpers): frames there are ours, not the learner's
HELPERS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_dirs() -> tuple[str, ...]:
    dirs = {HELPERS_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.realpath(path))
            dirs.add(os.path.abspath(path))
    return tuple(sorted(dirs))


_LIBRARY_DIRS = _library_dirs()


def is_hidden(file: str) -> bool:
    """A frame of helpers, of Python's standard library (multiprocessing, threading, runpy) or of an
    installed package (torch, cloudpickle, ipyparallel, IPython), not the learner's code."""
    if file.startswith("<frozen ") or file == "<dynamic-code>":
        return True
    path = os.path.abspath(os.path.expanduser(file))
    if any(part in path.split(os.sep) for part in ("site-packages", "dist-packages")):
        return True
    return any(path == d or path.startswith(d + os.sep) for d in _LIBRARY_DIRS)


_PY_FRAME = re.compile(r'^  File "(?P<file>.+)", line (?P<line>\d+), in (?P<name>.+)$')
_IPY_FILE = re.compile(r"^File (?P<file>.+?):(?P<line>\d+)(?:, in (?P<name>.+))?$")
_IPY_CELL = re.compile(r"^(?P<label>(?:Cell|Input) In ?\[\d+\], line (?P<line>\d+))(?:, in (?P<name>.+))?$")
_IPY_ARROW = re.compile(r"^-*> ?\s*\d+ (?P<source>.*)$")
_MARKS = re.compile(r"^\s*[\^~]+\s*$")  # Python 3.11+'s ^^^^ and ~~~^~~~ under a line
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def parse_frames(tb: str) -> list[Frame]:
    """The frames of the last exception in ``tb``, a formatted traceback: Python's own
    (``traceback.format_exc()``, what launch ranks send) or IPython's (ipyparallel's, what warm
    ranks send), ANSI colours allowed. Chained exceptions before the last are left out."""
    lines = _ANSI.sub("", tb or "").splitlines()
    starts = [i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln]
    lines = lines[starts[-1] + 1:] if starts else lines
    frames: list[Frame] = []
    ipython = not any(_PY_FRAME.match(ln) for ln in lines)  # else Python's own format
    i = 0
    while i < len(lines):
        ln = lines[i]
        m = _PY_FRAME.match(ln)
        if m:
            source = ""
            if i + 1 < len(lines) and lines[i + 1].startswith("    ") and not _MARKS.match(lines[i + 1]):
                source = lines[i + 1].strip()
            frames.append(Frame(m["file"], int(m["line"]), m["name"], source))
        elif ipython and (m := _IPY_FILE.match(ln) or _IPY_CELL.match(ln)):
            source = ""
            for nxt in lines[i + 1:]:
                if not nxt.strip():
                    break
                arrow = _IPY_ARROW.match(nxt)
                if arrow:
                    source = arrow["source"].strip()
                    break
            file = m.groupdict().get("file") or m["label"]
            name = (m["name"] or "").split("(")[0] or "<module>"
            if file == "<string>" and not source:  # ipyparallel's own exec of the call
                i += 1
                continue
            frames.append(Frame(file, int(m["line"]), name, source, m.groupdict().get("label") or ""))
        i += 1
    return frames


def own_frames(frames: list[Frame]) -> list[Frame]:
    """The learner's frames among ``frames``: those not inside helpers, the standard library or an
    installed package (see :func:`is_hidden`). ``[]`` when every frame is a library's."""
    return [f for f in frames if f.label or not is_hidden(f.file)]


def ipython():
    """The running IPython shell, or ``None`` (a plain script)."""
    if "IPython" not in sys.modules:
        return None
    try:
        from IPython import get_ipython
        return get_ipython()
    except Exception:  # noqa: BLE001 - a broken IPython: as in a script
        return None


def _location(frame: Frame, shell) -> str:
    """``Cell In[3], line 2, in work`` for a notebook cell of ``shell``, else Python's
    ``File "path", line 2, in work``."""
    if frame.label:
        return f"{frame.label}, in {frame.name}"
    if shell is not None:
        try:
            label = shell.compile.format_code_name(frame.file)
        except Exception:  # noqa: BLE001 - not IPython's compiler: Python's form
            label = None
        if label:
            return f"{label[0]} {label[1]}, line {frame.line}, in {frame.name}"
    return f'File "{frame.file}", line {frame.line}, in {frame.name}'


def format_frames(frames: list[Frame], shell=None) -> list[str]:
    """Two lines per frame, as Python prints them: where, and the line's code (looked up here when
    the traceback lacks it, e.g. a cell of this kernel)."""
    out = []
    for f in frames:
        out.append(f"  {_location(f, shell)}")
        source = f.source or (linecache.getline(f.file, f.line).strip() if not f.label else "")
        if source:
            out.append(f"    {source}")
    return out
