#!/usr/bin/env python3
"""Execute the teaching notebooks headless with papermill, as CI does.

Usage (from the repository root)::

    python ci/run_notebooks.py [--profile smoke|full|gpu] [--output-dir build]
                               [--cell-timeout SECONDS] [-p NAME=VALUE ...]
                               [--fail-fast] [--notebooks-dir DIR] [--profiles FILE]
                               [--list] [--gallery | --no-gallery] [NOTEBOOK ...]

``NOTEBOOK`` is a stem (``01_gradients_dp_vs_ddp``), its number prefix (``01``) or a path to
an ``.ipynb`` file; without any, every ``notebooks/*.ipynb`` runs, sorted by name. Each
executed notebook is written to ``<output-dir>/<profile>/<stem>.ipynb`` (outputs included, so
a failure can be read there). The kernel runs with the notebook's own folder as working
directory.

Parameters, lowest priority first:

1. the notebook's cell tagged ``parameters`` (smoke-sized defaults);
2. ``ci/profiles.json``: ``{"<stem>": {"smoke": {...}, "full": {...}}}``; a notebook or a
   profile missing there means "the notebook's defaults"; keys starting with ``_`` are
   comments;
3. ``-p NAME=VALUE`` (applies to every selected notebook; each must declare NAME). VALUE is
   read as a Python literal (``2``, ``0.5``, ``True``, ``[1, 2]``) and otherwise as a plain
   string; for a parameter whose default is a string the text is always taken as-is.

Everything is checked before the first notebook starts: the notebook names, the profile, the
shape of the profiles file, and every parameter against the notebook's ``parameters`` cell
(``papermill.inspect_notebook``): an unknown name, or a value whose type differs from the
default's (an int is accepted for a float; a bool is not an int; a default of ``None`` or an
expression that is not a literal accepts anything), is an error naming notebook, parameter,
expected and given type. A notebook without a cell tagged ``parameters`` is an error too.

Failures name the notebook, the cell (its 0-based position among all cells of the source
notebook, markdown included, and its first line) and the error; the executed notebook in the
output folder holds the full traceback.

Cell timeout (seconds, per cell; ``0`` disables it): ``smoke`` 300, ``full`` 1800, or
``--cell-timeout``. A cell that runs longer is reported as ``TIMEOUT``.

After every notebook the runner makes sure no process it started is still running: when a
cell is cut short (timeout, interrupt) the kernel's whole process tree (e.g. DDP workers) is
killed before papermill shuts the kernel down; after shutdown, any process that was seen in
the kernel's tree, or that is still a descendant of the runner (on Linux the runner is a
"child subreaper", so orphaned grandchildren are re-parented to it and found), is given a few
seconds to exit, then killed, and the notebook is reported as failed with
"N process(es) left behind".

Gallery (``--gallery``, on by default for the ``full`` profile; ``--no-gallery``): after the
run, every executed notebook (failed ones too) is rendered to ``<stem>.html`` next to it and
``<output-dir>/<profile>/index.html`` lists them with status and seconds (``ci/gallery.py``).

Exit codes:
    0  every notebook ran without error;
    1  at least one notebook FAILED, hit a TIMEOUT or left processes behind;
    2  bad invocation or configuration (unknown notebook or profile, bad parameter, no
       ``parameters`` cell, unreadable profiles file); nothing was run.

Importable API: :func:`run_notebooks` (returns one dict per notebook) and :func:`main`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import ctypes
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from helpers.procs import end_processes

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
DEFAULT_PROFILES_FILE = Path(__file__).resolve().parent / "profiles.json"

#: Known profiles and their default per-cell timeout in seconds.
PROFILE_CELL_TIMEOUTS: dict[str, int] = {"smoke": 300, "full": 1800, "gpu": 1800}
PROFILES = tuple(PROFILE_CELL_TIMEOUTS)
KERNEL_NAME = "python3"
#: Seconds a process still alive after the kernel shut down may take to exit on its own.
LEFTOVER_GRACE_S = 3.0

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

STATUS_OK = "ok"
STATUS_FAILED = "FAILED"
STATUS_TIMEOUT = "TIMEOUT"
STATUS_SKIPPED = "skipped"


class ConfigError(Exception):
    """Bad invocation or configuration, detected before any notebook ran (exit code 2)."""


class CliValue(str):
    """A ``-p NAME=VALUE`` text; typed per notebook against the parameter's default."""


# --------------------------------------------------------------------------------------------
# Notebook selection
# --------------------------------------------------------------------------------------------


def discover_notebooks(notebooks_dir: str | os.PathLike | None = None) -> list[Path]:
    """All ``*.ipynb`` files directly in ``notebooks_dir``, sorted by name."""
    folder = Path(notebooks_dir) if notebooks_dir is not None else DEFAULT_NOTEBOOKS_DIR
    if not folder.is_dir():
        return []
    return sorted(
        (p.resolve() for p in folder.glob("*.ipynb") if not p.name.startswith(".")),
        key=lambda p: p.name,
    )


def _number_prefix(stem: str) -> int | None:
    m = re.match(r"(\d+)", stem)
    return int(m.group(1)) if m else None


def resolve_notebooks(
    names: Iterable[str] | None, notebooks_dir: str | os.PathLike | None = None
) -> list[Path]:
    """Map notebook names (stem, number prefix or path) to absolute paths.

    Raises :class:`ConfigError` listing the available notebooks when a name matches none, or
    a number prefix matches several.
    """
    folder = Path(notebooks_dir) if notebooks_dir is not None else DEFAULT_NOTEBOOKS_DIR
    available = discover_notebooks(folder)
    listing = "\n".join(f"  {p.stem}" for p in available) or "  (none)"
    names = list(names or [])
    if not names:
        if not available:
            raise ConfigError(f"no notebooks (*.ipynb) found in {folder}")
        return available

    chosen: list[Path] = []
    errors: list[str] = []
    for name in names:
        looks_like_path = name.endswith(".ipynb") or "/" in name or os.sep in name
        if looks_like_path:
            p = Path(name)
            if p.is_file():
                chosen.append(p.resolve())
            elif p.parent == Path(".") and (folder / p.name).is_file():
                chosen.append((folder / p.name).resolve())
            else:
                errors.append(f"no such notebook file: {name!r}")
            continue
        exact = [p for p in available if p.stem == name]
        if exact:
            chosen.append(exact[0])
            continue
        if name.isdigit():
            matches = [p for p in available if _number_prefix(p.stem) == int(name)]
            if len(matches) == 1:
                chosen.append(matches[0])
                continue
            if len(matches) > 1:
                errors.append(
                    f"notebook number {name!r} is ambiguous: " + ", ".join(p.stem for p in matches)
                )
                continue
        errors.append(f"unknown notebook {name!r}")
    if errors:
        raise ConfigError("\n".join(errors) + f"\navailable notebooks in {folder}:\n{listing}")

    unique: list[Path] = []
    for p in chosen:
        if p not in unique:
            unique.append(p)
    stems: dict[str, Path] = {}
    for p in unique:
        if p.stem in stems:
            raise ConfigError(
                f"two selected notebooks share the name {p.stem!r} (their outputs would "
                f"collide): {stems[p.stem]} and {p}"
            )
        stems[p.stem] = p
    return unique


# --------------------------------------------------------------------------------------------
# Profiles and parameters
# --------------------------------------------------------------------------------------------


def check_profile(profile: str) -> None:
    if profile not in PROFILE_CELL_TIMEOUTS:
        raise ConfigError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")


def load_profiles(profiles_file: str | os.PathLike | None = None) -> dict[str, dict[str, dict]]:
    """Read and shape-check the profiles file; ``{stem: {profile: {name: value}}}``."""
    path = Path(profiles_file) if profiles_file is not None else DEFAULT_PROFILES_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"profiles file not found: {path}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read profiles file {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    out: dict[str, dict[str, dict]] = {}
    for stem, entry in raw.items():
        if stem.startswith("_"):
            continue
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: {stem!r} must map profile names to objects")
        out[stem] = {}
        for prof, params in entry.items():
            if prof.startswith("_"):
                continue
            if prof not in PROFILE_CELL_TIMEOUTS:
                raise ConfigError(
                    f"{path}: {stem!r} has unknown profile {prof!r}; profiles: {', '.join(PROFILES)}"
                )
            if not isinstance(params, dict):
                raise ConfigError(f"{path}: {stem!r} -> {prof!r} must be an object of parameters")
            out[stem][prof] = {k: v for k, v in params.items() if not k.startswith("_")}
    return out


def notebook_parameters(path: Path) -> dict[str, dict]:
    """The parameters declared in the notebook's ``parameters`` cell (papermill's view).

    Raises :class:`ConfigError` when there is no cell tagged ``parameters``.
    """
    import nbformat
    import papermill

    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook is a config error
        raise ConfigError(f"{path.stem}: cannot read {path}: {e}") from None
    if not any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise ConfigError(f"{path.stem}: no cell tagged 'parameters' in {path}")
    try:
        declared = papermill.inspect_notebook(str(path))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{path.stem}: cannot inspect parameters of {path}: {e}") from None
    # papermill's line-based parser skips e.g. a line whose comment contains '='; top-level
    # assignments it missed are still parameters (their type is taken from the literal default)
    source = next(c.source for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))
    for name, annotation, default in parameter_assignments(source):
        declared.setdefault(
            name,
            {"name": name, "inferred_type_name": annotation or "None", "default": default, "help": ""},
        )
    return declared


def parameter_assignments(source: str) -> list[tuple[str, str | None, str]]:
    """``(name, annotation, default source)`` of the top-level ``name = value`` statements."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # e.g. IPython magics; papermill's view is all there is
        return []
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found.append((node.targets[0].id, None, ast.unparse(node.value)))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found.append((node.target.id, ast.unparse(node.annotation), ast.unparse(node.value)))
    return found


_GENERIC_BASES = {"List": "list", "Dict": "dict", "Tuple": "tuple", "Set": "set"}


def expected_type(param: dict) -> tuple[str | None, bool]:
    """``(type name or None when unknown, whether None is acceptable)`` for a parameter.

    Uses papermill's ``inferred_type_name`` (from an annotation or type comment) and, when
    that is absent, the type of the default if the default is a Python literal.
    """
    name = str(param.get("inferred_type_name") or "None").strip()
    if name not in ("None", ""):
        nullable = False
        m = re.fullmatch(r"(?:typing\.)?Optional\[(.+)\]", name)
        if m:
            name, nullable = m.group(1).strip(), True
        if "|" in name:
            parts = [s.strip() for s in name.split("|")]
            nullable = nullable or "None" in parts
            parts = [s for s in parts if s != "None"]
            if len(parts) != 1:
                return None, True
            name = parts[0]
        base = name.split("[", 1)[0].strip().rsplit(".", 1)[-1]
        return _GENERIC_BASES.get(base, base), nullable
    try:
        default = ast.literal_eval(str(param.get("default", "")))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None, True
    if default is None:
        return None, True
    return type(default).__name__, False


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, (list, tuple)),
    "tuple": lambda v: isinstance(v, (list, tuple)),
    "set": lambda v: isinstance(v, (list, tuple, set)),
    "dict": lambda v: isinstance(v, dict),
}


def _coerce_cli_value(value: CliValue, expected: str | None) -> Any:
    text = str(value)
    if expected == "str":
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return text
        return parsed if isinstance(parsed, str) else text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def check_parameters(
    stem: str, declared: dict[str, dict], values: dict[str, tuple[Any, str]]
) -> tuple[dict[str, Any], list[str]]:
    """Type ``values`` (``{name: (value, where it came from)}``) against ``declared``.

    Returns the final parameters and a list of error messages.
    """
    final: dict[str, Any] = {}
    errors: list[str] = []
    known = ", ".join(sorted(declared)) or "(none)"
    for name, (value, source) in values.items():
        if name not in declared:
            errors.append(
                f"{stem}: unknown parameter {name!r} (from {source}); the parameters cell "
                f"declares: {known}"
            )
            continue
        expected, nullable = expected_type(declared[name])
        if isinstance(value, CliValue):
            value = _coerce_cli_value(value, expected)
        if value is None:
            if expected is not None and not nullable:
                errors.append(
                    f"{stem}: parameter {name!r} expects {expected}, got NoneType (None) "
                    f"(from {source})"
                )
                continue
        elif expected in _TYPE_CHECKS and not _TYPE_CHECKS[expected](value):
            errors.append(
                f"{stem}: parameter {name!r} expects {expected} (default "
                f"{declared[name].get('default')}), got {type(value).__name__} ({value!r}) "
                f"(from {source})"
            )
            continue
        final[name] = value
    return final, errors


# --------------------------------------------------------------------------------------------
# Process bookkeeping
# --------------------------------------------------------------------------------------------


def _proc_key(p) -> tuple[int, float]:
    try:
        return (p.pid, p.create_time())
    except Exception:  # noqa: BLE001 - gone or inaccessible
        return (p.pid, -1.0)


def _describe(p) -> str:
    try:
        cmd = " ".join(p.cmdline()) or p.name()
    except Exception:  # noqa: BLE001
        cmd = "?"
    if len(cmd) > 120:
        cmd = cmd[:117] + "..."
    return f"pid {p.pid} ({cmd})"


def _is_live(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants(p) -> list:
    import psutil

    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _reap_zombie_children() -> None:
    """Reap re-parented orphans that died (they are our children while we are a subreaper)."""
    import psutil

    me = psutil.Process()
    for child in _descendants(me):
        try:
            if child.ppid() == me.pid and child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError, OSError):
            pass


def _wait_gone(procs: list, timeout: float) -> list:
    """Wait until none of ``procs`` is running (a zombie counts as gone); returns the rest."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _is_live(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap_zombie_children()
        alive = [p for p in alive if _is_live(p)]
    _reap_zombie_children()
    return alive


def _kill_all(procs: list, timeout: float = 5.0) -> list:
    """SIGKILL ``procs`` (parents before children, the order given) and wait; returns survivors."""
    survivors = end_processes(procs, terminate=False, timeout=timeout)
    _reap_zombie_children()  # orphans this subreaper adopted while their parents died
    return survivors


@contextlib.contextmanager
def _child_subreaper() -> Iterator[bool]:
    """On Linux, make this process adopt orphaned descendants while the block runs."""
    if not sys.platform.startswith("linux"):
        yield False
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        previous = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(previous), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        enabled = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        yield False
        return
    try:
        yield enabled
    finally:
        if enabled and not previous.value:
            libc.prctl(36, 0, 0, 0, 0)


@dataclass
class _Watch:
    """Per-notebook state shared by the papermill hooks and the kernel manager."""

    baseline: set = field(default_factory=set)
    kernel: Any = None
    seen: dict = field(default_factory=dict)
    current_cell: int | None = None  # index (in the executed notebook) of a running cell
    last_cell_started: int | None = None
    t_start: float = 0.0
    t_first_cell: float | None = None
    t_last_cell_done: float | None = None
    killed_on_abort: list[str] = field(default_factory=list)

    @classmethod
    def start(cls) -> "_Watch":
        import psutil

        me = psutil.Process()
        return cls(baseline={_proc_key(p) for p in _descendants(me)}, t_start=time.monotonic())

    def set_kernel(self, pid: int | None) -> None:
        import psutil

        if pid:
            with contextlib.suppress(psutil.Error):
                self.kernel = psutil.Process(pid)

    def snapshot_kernel_tree(self) -> list:
        if self.kernel is None:
            return []
        tree = _descendants(self.kernel)
        for p in tree:
            self.seen.setdefault(_proc_key(p), p)
        return tree

    def kill_kernel_tree(self) -> None:
        tree = [p for p in self.snapshot_kernel_tree() if _is_live(p)]
        if tree:
            self.killed_on_abort.extend(_describe(p) for p in tree)
            _kill_all(tree)

    # nbclient hooks (called with keyword arguments)
    def on_cell_start(self, cell=None, cell_index=None, **_: Any) -> None:
        if self.t_first_cell is None:
            self.t_first_cell = time.monotonic()

    def on_cell_execute(self, cell=None, cell_index=None, **_: Any) -> None:
        self.current_cell = cell_index
        self.last_cell_started = cell_index

    def on_cell_executed(self, cell=None, cell_index=None, **_: Any) -> None:
        self.current_cell = None
        self.t_last_cell_done = time.monotonic()
        self.snapshot_kernel_tree()

    def leftovers(self, grace: float) -> list:
        """Processes started during this notebook that are still running after ``grace``."""
        import psutil

        _reap_zombie_children()
        me = psutil.Process()
        candidates: dict = {}
        for p in _descendants(me):
            key = _proc_key(p)
            if key not in self.baseline:
                candidates[key] = p
        for key, p in self.seen.items():
            candidates.setdefault(key, p)
        if self.kernel is not None:
            candidates.setdefault(_proc_key(self.kernel), self.kernel)
        return _wait_gone(list(candidates.values()), grace)


def _kernel_manager_class(watch: _Watch):
    """An AsyncKernelManager that records the kernel pid and, when a cell was cut short, kills
    the kernel's process tree (DDP workers included) before shutting the kernel down."""
    from jupyter_client.manager import AsyncKernelManager

    class TreeKillingKernelManager(AsyncKernelManager):
        async def start_kernel(self, **kw: Any) -> None:
            await super().start_kernel(**kw)
            prov = self.provisioner
            pid = getattr(prov, "pid", None) or getattr(getattr(prov, "process", None), "pid", None)
            watch.set_kernel(pid)

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            if not restart:
                watch.snapshot_kernel_tree()
                if watch.current_cell is not None:
                    # A cell never finished (timeout / interrupt): its workers may be blocked
                    # in a collective; kill them first, then the kernel without a grace period.
                    watch.kill_kernel_tree()
                    now = True
            await super().shutdown_kernel(now=now, restart=restart)

    return TreeKillingKernelManager


# --------------------------------------------------------------------------------------------
# Execution
# --------------------------------------------------------------------------------------------


@dataclass
class _Job:
    path: Path
    params: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.stem


def _first_line(source: str) -> str:
    for line in source.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= 80 else line[:77] + "..."
    return "<empty>"


def _describe_cell(src_path: Path, exec_index: int | None, injected: bool) -> tuple[int | None, str]:
    """Map a cell index of the executed notebook to the source notebook; return
    ``(source index or None, "cell N: `first line`")``."""
    import nbformat

    if exec_index is None:
        return None, "an unknown cell"
    try:
        nb = nbformat.read(str(src_path), as_version=4)
    except Exception:  # noqa: BLE001
        return None, f"cell {exec_index} of the executed notebook"
    tags = [c.get("metadata", {}).get("tags", []) for c in nb.cells]
    index = exec_index
    if injected and not any("injected-parameters" in t for t in tags):
        param_idx = next((i for i, t in enumerate(tags) if "parameters" in t), -1)
        injected_at = param_idx + 1
        if exec_index == injected_at:
            return None, "the injected-parameters cell"
        if exec_index > injected_at:
            index = exec_index - 1
    if 0 <= index < len(nb.cells):
        return index, f"cell {index}: `{_first_line(nb.cells[index].source)}`"
    return None, f"cell {exec_index} of the executed notebook"


def _running_cell_from_output(output: Path) -> int | None:
    """Fallback: the last cell papermill started, from the saved output notebook."""
    import nbformat

    try:
        nb = nbformat.read(str(output), as_version=4)
    except Exception:  # noqa: BLE001
        return None
    started = [
        i
        for i, c in enumerate(nb.cells)
        if c.get("metadata", {}).get("papermill", {}).get("start_time")
    ]
    return started[-1] if started else None


def _execute(job: _Job, output: Path, cell_timeout: int | None) -> dict:
    import papermill
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    row: dict[str, Any] = {
        "notebook": job.name,
        "status": STATUS_OK,
        "seconds": 0.0,
        "error": None,
        "cell_index": None,
        "output": str(output),
        "startup_seconds": None,
        "shutdown_seconds": None,
        "processes_left": 0,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    injected = bool(job.params)
    watch = _Watch.start()
    t0 = time.monotonic()
    try:
        papermill.execute_notebook(
            str(job.path),
            str(output),
            parameters=job.params or None,
            kernel_name=KERNEL_NAME,
            execution_timeout=cell_timeout,
            cwd=str(job.path.parent),
            log_output=False,
            progress_bar=False,
            kernel_manager_class=_kernel_manager_class(watch),
            on_cell_start=watch.on_cell_start,
            on_cell_execute=watch.on_cell_execute,
            on_cell_executed=watch.on_cell_executed,
        )
    except papermill.PapermillExecutionError as e:
        idx, where = _describe_cell(job.path, e.cell_index, injected)
        row.update(status=STATUS_FAILED, cell_index=idx)
        evalue = str(e.evalue).strip()
        row["error"] = f"{job.name}: {where}: {e.ename}: {evalue}" if evalue else f"{job.name}: {where}: {e.ename}"
    except CellTimeoutError as e:
        exec_idx = watch.last_cell_started
        if exec_idx is None:
            exec_idx = _running_cell_from_output(output)
        idx, where = _describe_cell(job.path, exec_idx, injected)
        if "IOPub" in str(e):
            what = "timed out waiting for the cell's output (IOPub)"
        else:
            what = f"timed out after {cell_timeout} s (cell timeout)"
        row.update(status=STATUS_TIMEOUT, cell_index=idx)
        row["error"] = f"{job.name}: {where}: {what}"
    except DeadKernelError as e:
        idx, where = _describe_cell(job.path, watch.last_cell_started, injected)
        row.update(status=STATUS_FAILED, cell_index=idx)
        row["error"] = f"{job.name}: {where}: the kernel died ({e})"
    except Exception as e:  # noqa: BLE001 - report anything else as a failure of this notebook
        exec_idx = watch.current_cell
        idx, where = _describe_cell(job.path, exec_idx, injected) if exec_idx is not None else (None, "")
        row.update(status=STATUS_FAILED, cell_index=idx)
        prefix = f"{job.name}: {where}: " if where else f"{job.name}: "
        row["error"] = f"{prefix}{type(e).__name__}: {e}"
    finally:
        row["seconds"] = round(time.monotonic() - t0, 1)
        if watch.t_first_cell is not None:
            row["startup_seconds"] = round(watch.t_first_cell - t0, 2)
        if watch.t_last_cell_done is not None and row["status"] == STATUS_OK:
            row["shutdown_seconds"] = round(time.monotonic() - watch.t_last_cell_done, 2)
        left = watch.leftovers(LEFTOVER_GRACE_S)
        if left:
            descriptions = [_describe(p) for p in left]
            survivors = _kill_all(left)
            row["processes_left"] = len(left)
            note = (
                f"{len(left)} process(es) left behind (killed): " + "; ".join(descriptions)
                + (f" [{len(survivors)} could not be killed]" if survivors else "")
            )
            if row["status"] == STATUS_OK:
                row["status"] = STATUS_FAILED
                row["error"] = f"{job.name}: {note}"
            else:
                row["error"] = f"{row['error']}; {note}"
        if watch.killed_on_abort:
            row["error"] = (
                f"{row['error']}; killed {len(watch.killed_on_abort)} kernel child "
                f"process(es) when the cell was cut short"
            )
    return row


@dataclass
class Plan:
    """A fully validated run: what :func:`run_notebooks` executes."""

    jobs: list[_Job]
    profile: str
    output_dir: Path
    cell_timeout: int | None


def plan_run(
    names: Iterable[str] | None = None,
    profile: str = "smoke",
    output_dir: str | os.PathLike = "build",
    cell_timeout: float | None = None,
    extra_params: dict[str, Any] | None = None,
    *,
    notebooks_dir: str | os.PathLike | None = None,
    profiles_file: str | os.PathLike | None = None,
) -> Plan:
    """Check everything (names, profile, profiles file, parameters) without running anything.

    Raises :class:`ConfigError` with every problem found.
    """
    check_profile(profile)
    paths = resolve_notebooks(names, notebooks_dir)
    profiles = load_profiles(profiles_file)
    known_stems = {p.stem for p in discover_notebooks(notebooks_dir)} | {p.stem for p in paths}
    for stem in profiles:
        if stem not in known_stems:
            print(
                f"warning: {profiles_file or DEFAULT_PROFILES_FILE} has an entry for "
                f"{stem!r}, which is not a notebook here",
                file=sys.stderr,
            )
    if cell_timeout is None:
        timeout: int | None = PROFILE_CELL_TIMEOUTS[profile]
    elif cell_timeout < 0:
        raise ConfigError(f"--cell-timeout must be >= 0 (0 disables it), got {cell_timeout}")
    else:
        timeout = int(math.ceil(cell_timeout)) or None

    jobs: list[_Job] = []
    errors: list[str] = []
    for path in paths:
        try:
            declared = notebook_parameters(path)
        except ConfigError as e:
            errors.append(str(e))
            continue
        values: dict[str, tuple[Any, str]] = {}
        for k, v in profiles.get(path.stem, {}).get(profile, {}).items():
            values[k] = (v, f"profile {profile!r} in {Path(profiles_file or DEFAULT_PROFILES_FILE).name}")
        for k, v in (extra_params or {}).items():
            values[k] = (v, f"-p {k}=" + (str(v) if isinstance(v, CliValue) else repr(v)))
        params, errs = check_parameters(path.stem, declared, values)
        errors.extend(errs)
        jobs.append(_Job(path, params))
    if errors:
        raise ConfigError("\n".join(errors))
    return Plan(jobs, profile, Path(output_dir).resolve(), timeout)


def require_device(profile: str) -> None:
    """Refuse, before any notebook runs, a profile whose hardware is missing (never a silent skip)."""
    if profile == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("profile 'gpu' runs the notebooks on a CUDA GPU (nccl, real nn.DataParallel), "
                              "but torch.cuda.is_available() is False here; use --profile full on a CPU machine")


def execute_plan(
    plan: Plan,
    *,
    fail_fast: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    rows: list[dict] = []
    with _child_subreaper():
        for i, job in enumerate(plan.jobs):
            if fail_fast and any(r["status"] != STATUS_OK for r in rows):
                rows.append(
                    {"notebook": job.name, "status": STATUS_SKIPPED, "seconds": 0.0, "error": None,
                     "cell_index": None, "output": None, "startup_seconds": None,
                     "shutdown_seconds": None, "processes_left": 0}
                )
                continue
            if progress:
                timeout = f"{plan.cell_timeout} s" if plan.cell_timeout else "none"
                progress(
                    f"[{i + 1}/{len(plan.jobs)}] {job.name} (profile {plan.profile}, "
                    f"cell timeout {timeout}, parameters {job.params or 'defaults'}) ..."
                )
            output = plan.output_dir / plan.profile / f"{job.name}.ipynb"
            row = _execute(job, output, plan.cell_timeout)
            rows.append(row)
            if progress:
                progress(f"[{i + 1}/{len(plan.jobs)}] {job.name}: {row['status']} in {row['seconds']:.1f} s")
    return rows


def run_notebooks(
    names: Iterable[str] | None = None,
    profile: str = "smoke",
    output_dir: str | os.PathLike = "build",
    cell_timeout: float | None = None,
    extra_params: dict[str, Any] | None = None,
    *,
    notebooks_dir: str | os.PathLike | None = None,
    profiles_file: str | os.PathLike | None = None,
    fail_fast: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Validate, then execute notebooks; one row per notebook, in order.

    Each row: ``notebook`` (stem), ``status`` (``ok`` / ``FAILED`` / ``TIMEOUT`` /
    ``skipped`` after a failure with ``fail_fast``), ``seconds``, ``error`` (None when ok;
    otherwise names the notebook, the cell index in the source notebook with its first line,
    and the error), ``cell_index``, ``output`` (executed notebook path), ``startup_seconds``
    (start to first cell: parameter injection + kernel start), ``shutdown_seconds`` (last cell
    done to kernel gone, for ok rows) and ``processes_left``.

    ``extra_params`` are typed values checked like profile values (a :class:`CliValue` is typed
    against the default first, as ``-p`` does). Raises :class:`ConfigError` before running
    anything when a name, the profile, the profiles file or a parameter is wrong.
    """
    plan = plan_run(
        names, profile, output_dir, cell_timeout, extra_params,
        notebooks_dir=notebooks_dir, profiles_file=profiles_file,
    )
    require_device(plan.profile)
    return execute_plan(plan, fail_fast=fail_fast, progress=progress)


def format_table(rows: list[dict]) -> str:
    """Aligned table of notebook, status and seconds."""
    import pandas as pd

    df = pd.DataFrame(
        [{"notebook": r["notebook"], "status": r["status"], "seconds": f"{r['seconds']:.1f}"} for r in rows],
        columns=["notebook", "status", "seconds"],
    )
    return df.to_string(index=False)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parse_param(text: str) -> tuple[str, CliValue]:
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise ConfigError(f"-p expects NAME=VALUE, got {text!r}")
    return name, CliValue(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python ci/run_notebooks.py",
        description="Execute the notebooks with papermill and report notebook, status, seconds.",
        epilog="Exit codes: 0 all ok; 1 a notebook failed, timed out or left processes behind; "
        "2 bad invocation or configuration (nothing ran).",
    )
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                        help="stem, number prefix (01) or path; default: all notebooks/*.ipynb")
    parser.add_argument("--profile", default="smoke",
                        help=f"parameter profile: {' | '.join(PROFILES)} (default smoke)")
    parser.add_argument("--output-dir", default="build",
                        help="executed notebooks go to OUTPUT_DIR/<profile>/ (default build)")
    parser.add_argument("--cell-timeout", type=float, default=None, metavar="SECONDS",
                        help="per-cell timeout; default "
                        + ", ".join(f"{k} {v} s" for k, v in PROFILE_CELL_TIMEOUTS.items())
                        + "; 0 disables it")
    parser.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE",
                        help="override a notebook parameter (repeatable; highest priority)")
    parser.add_argument("--fail-fast", action="store_true",
                        help="stop after the first notebook that does not pass")
    parser.add_argument("--notebooks-dir", default=None,
                        help=f"folder holding the notebooks (default {DEFAULT_NOTEBOOKS_DIR})")
    parser.add_argument("--profiles", default=None, metavar="FILE",
                        help=f"profiles file (default {DEFAULT_PROFILES_FILE})")
    parser.add_argument("--list", action="store_true",
                        help="list the selected notebooks with their final parameters, run nothing")
    parser.add_argument("--gallery", action=argparse.BooleanOptionalAction, default=None,
                        help="render the executed notebooks to HTML with an index.html in "
                        "OUTPUT_DIR/<profile>/ (ci/gallery.py); default: on for the full "
                        "profile, off otherwise")
    return parser


def _write_gallery(rows: list[dict], folder: Path, profile: str) -> Path:
    """ci/gallery.py's :func:`write_gallery`, loaded by path (this file also runs as a script)."""
    import importlib.util

    path = Path(__file__).resolve().parent / "gallery.py"
    spec = importlib.util.spec_from_file_location("_ddp_lab_gallery", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_gallery(rows, folder, profile=profile)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        extra = dict(_parse_param(t) for t in args.parameter)
        plan = plan_run(
            args.notebooks, args.profile, args.output_dir, args.cell_timeout, extra,
            notebooks_dir=args.notebooks_dir, profiles_file=args.profiles,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.list:
        for job in plan.jobs:
            print(f"{job.name}: {job.params or '(notebook defaults)'}")
        return EXIT_OK
    try:
        require_device(plan.profile)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE

    def progress(msg: str) -> None:
        print(msg, flush=True)

    rows = execute_plan(plan, fail_fast=args.fail_fast, progress=progress)
    print()
    print(format_table(rows))
    gallery_failed = False
    if args.gallery if args.gallery is not None else plan.profile in ("full", "gpu"):
        try:
            index = _write_gallery(rows, plan.output_dir / plan.profile, plan.profile)
            print(f"\ngallery: {index}")
        except Exception as e:  # noqa: BLE001 - report, then fail the run
            gallery_failed = True
            print(f"\nerror: the gallery could not be written: {type(e).__name__}: {e}", file=sys.stderr)
    bad = [r for r in rows if r["status"] not in (STATUS_OK, STATUS_SKIPPED)]
    if bad:
        print()
        for r in bad:
            print(f"{r['status']} {r['error']}")
            if r.get("output"):
                print(f"    executed notebook: {r['output']}")
        sys.stdout.flush()
        return EXIT_FAILED
    return EXIT_FAILED if gallery_failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
