"""Executing a planned run: one papermill kernel per notebook, a row per notebook.

A failure names the notebook, the cell (its 0-based position among all cells of the source
notebook, markdown included, and its first line) and the error; a process left behind fails
the notebook (see :mod:`ci.cleanup`). Plans come from :mod:`ci.planning`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import nbformat
import pandas as pd
import papermill
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from ci.cleanup import Watch, child_subreaper, describe, kernel_manager_class, kill_all
from ci.outputs import output_lock, partial_path, publish
from ci.planning import Job, Plan, plan_run, require_device

KERNEL_NAME = "python3"
#: Seconds a process still alive after the kernel shut down may take to exit on its own.
LEFTOVER_GRACE_S = 3.0

STATUS_OK = "ok"
STATUS_FAILED = "FAILED"
STATUS_TIMEOUT = "TIMEOUT"
STATUS_SKIPPED = "skipped"


def _first_line(source: str) -> str:
    for line in source.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= 80 else line[:77] + "..."
    return "<empty>"


def _describe_cell(src_path: Path, exec_index: int | None, injected: bool) -> tuple[int | None, str]:
    """Map a cell index of the executed notebook to the source notebook; return
    ``(source index or None, "cell N: `first line`")``."""
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
    try:
        nb = nbformat.read(str(output), as_version=4)
    except Exception:  # noqa: BLE001
        return None
    started = [i for i, c in enumerate(nb.cells)
               if c.get("metadata", {}).get("papermill", {}).get("start_time")]
    return started[-1] if started else None


def _row(name: str, status: str, output: Path | None) -> dict[str, Any]:
    """A notebook's row before it ran (see :func:`run_notebooks`)."""
    return {"notebook": name, "status": status, "seconds": 0.0, "error": None, "cell_index": None,
            "output": output and str(output), "startup_seconds": None, "shutdown_seconds": None,
            "processes_left": 0}


def _execute(job: Job, output: Path, cell_timeout: int | None) -> dict:
    row = _row(job.name, STATUS_OK, output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(output)  # papermill rewrites it as cells run; `output` is only ever whole
    injected = bool(job.params)
    watch = Watch.start()
    t0 = time.monotonic()
    stopped = False  # Ctrl-C / SystemExit: the run was stopped, the notebook is not complete
    try:
        papermill.execute_notebook(
            str(job.path), str(partial), parameters=job.params or None, kernel_name=KERNEL_NAME,
            execution_timeout=cell_timeout, cwd=str(job.path.parent), log_output=False,
            progress_bar=False, kernel_manager_class=kernel_manager_class(watch),
            on_cell_start=watch.on_cell_start, on_cell_execute=watch.on_cell_execute,
            on_cell_executed=watch.on_cell_executed)
    except papermill.PapermillExecutionError as e:
        idx, where = _describe_cell(job.path, e.cell_index, injected)
        row.update(status=STATUS_FAILED, cell_index=idx)
        evalue = str(e.evalue).strip()
        row["error"] = f"{job.name}: {where}: {e.ename}: {evalue}" if evalue else f"{job.name}: {where}: {e.ename}"
    except CellTimeoutError as e:
        exec_idx = watch.last_cell_started
        if exec_idx is None:
            exec_idx = _running_cell_from_output(partial)
        idx, where = _describe_cell(job.path, exec_idx, injected)
        what = ("timed out waiting for the cell's output (IOPub)" if "IOPub" in str(e)
                else f"timed out after {cell_timeout} s (cell timeout)")
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
    except BaseException:
        stopped = True  # Ctrl-C: no notebook, whole or partial, is left in the output folder
        partial.unlink(missing_ok=True)
        raise
    finally:
        if not stopped:  # done, or failed in a cell: a complete record of the run
            publish(partial, output)
        row["seconds"] = round(time.monotonic() - t0, 1)
        if watch.t_first_cell is not None:
            row["startup_seconds"] = round(watch.t_first_cell - t0, 2)
        if watch.t_last_cell_done is not None and row["status"] == STATUS_OK:
            row["shutdown_seconds"] = round(time.monotonic() - watch.t_last_cell_done, 2)
        left = watch.leftovers(LEFTOVER_GRACE_S)
        if left:
            descriptions = [describe(p) for p in left]
            survivors = kill_all(left)
            row["processes_left"] = len(left)
            note = (f"{len(left)} process(es) left behind (killed): " + "; ".join(descriptions)
                    + (f" [{len(survivors)} could not be killed]" if survivors else ""))
            if row["status"] == STATUS_OK:
                row["status"] = STATUS_FAILED
                row["error"] = f"{job.name}: {note}"
            else:
                row["error"] = f"{row['error']}; {note}"
        if watch.killed_on_abort:
            row["error"] = (f"{row['error']}; killed {len(watch.killed_on_abort)} kernel child "
                            "process(es) when the cell was cut short")
    return row


def execute_plan(plan: Plan, *, fail_fast: bool = False,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """Execute ``plan``'s notebooks in order; one row per notebook (see :func:`run_notebooks`).

    The caller holds the output folder (:func:`ci.outputs.output_lock`), as :func:`run_notebooks`
    and the command line do.
    """
    rows: list[dict] = []
    with child_subreaper():
        for i, job in enumerate(plan.jobs):
            if fail_fast and any(r["status"] != STATUS_OK for r in rows):
                rows.append(_row(job.name, STATUS_SKIPPED, None))
                continue
            if progress:
                timeout = f"{plan.cell_timeout} s" if plan.cell_timeout else "none"
                progress(f"[{i + 1}/{len(plan.jobs)}] {job.name} (profile {plan.profile}, "
                         f"cell timeout {timeout}, parameters {job.params or 'defaults'}) ...")
            output = plan.output_dir / plan.profile / f"{job.name}.ipynb"
            row = _execute(job, output, plan.cell_timeout)
            rows.append(row)
            if progress:
                progress(f"[{i + 1}/{len(plan.jobs)}] {job.name}: {row['status']} in {row['seconds']:.1f} s")
    return rows


def run_notebooks(names: Iterable[str] | None = None, profile: str = "smoke",
                  output_dir: str | os.PathLike = "build", cell_timeout: float | None = None,
                  extra_params: dict[str, Any] | None = None, *,
                  notebooks_dir: str | os.PathLike | None = None,
                  manifest: str | os.PathLike | None = None, fail_fast: bool = False,
                  progress: Callable[[str], None] | None = None) -> list[dict]:
    """Validate, then execute notebooks; one row per notebook, in order.

    Each row: ``notebook`` (stem), ``status`` (``ok`` / ``FAILED`` / ``TIMEOUT`` /
    ``skipped`` after a failure with ``fail_fast``), ``seconds``, ``error`` (None when ok;
    otherwise names the notebook, the cell index in the source notebook with its first line,
    and the error), ``cell_index``, ``output`` (executed notebook path), ``startup_seconds``
    (start to first cell: parameter injection + kernel start), ``shutdown_seconds`` (last cell
    done to kernel gone, for ok rows) and ``processes_left``.

    ``extra_params`` are typed values checked like profile values (a :class:`CliValue` is typed
    against the default first, as ``-p`` does). Raises :class:`ConfigError` before running
    anything when a name, the profile, the manifest or a parameter is wrong, and
    :class:`ci.outputs.OutputDirBusy` (a ``ConfigError``) when another runner holds
    ``output_dir``.
    """
    plan = plan_run(names, profile, output_dir, cell_timeout, extra_params,
                    notebooks_dir=notebooks_dir, manifest=manifest)
    require_device(plan.profile)
    with output_lock(plan.output_dir):
        return execute_plan(plan, fail_fast=fail_fast, progress=progress)


def format_table(rows: list[dict]) -> str:
    """Aligned table of notebook, status and seconds."""
    table = [{"notebook": r["notebook"], "status": r["status"], "seconds": f"{r['seconds']:.1f}"}
             for r in rows]
    return pd.DataFrame(table, columns=["notebook", "status", "seconds"]).to_string(index=False)
