#!/usr/bin/env python3
"""Execute the teaching notebooks headless with papermill, as CI does.

Usage (from the repository root)::

    python ci/run_notebooks.py [--profile smoke|full|gpu] [--output-dir build]
                               [--cell-timeout SECONDS] [-p NAME=VALUE ...]
                               [--fail-fast] [--notebooks-dir DIR] [--manifest FILE]
                               [--list] [NOTEBOOK ...]

``NOTEBOOK`` is a stem (``01_gradients_dp_vs_ddp``), its number prefix (``01``), a lesson label
(``06a``: the stem's part before ``_``) or a path to an ``.ipynb`` file; without any, every notebook
of the lesson manifest (``notebooks/lessons.toml``) runs, in its order (a folder without a
manifest: every ``*.ipynb``, sorted by name). Each
executed notebook is written to ``<output-dir>/<profile>/<stem>.ipynb`` (outputs included, so
a failure can be read there). The kernel runs with the notebook's own folder as working
directory.

One copy of the course, one runner: run as a file, the runner imports its own copy's ``ci`` and
``helpers`` (not those ``pip install -e .`` of another copy maps), and every kernel gets that copy
first on ``PYTHONPATH``; from a working folder inside another copy it stops, naming both
(``helpers/checkout.py``).

Parameters, lowest priority first:

1. the notebook's cell tagged ``parameters`` (smoke-sized defaults);
2. the profile's table under the notebook's record in ``notebooks/lessons.toml``
   (``[lesson.full]``, ``[lesson.gpu]``); a notebook or a profile without one means "the
   notebook's defaults";
3. ``-p NAME=VALUE`` (applies to every selected notebook; each must declare NAME). VALUE is
   read as a Python literal (``2``, ``0.5``, ``True``, ``[1, 2]``) and otherwise as a plain
   string; for a parameter whose default is a string the text is always taken as-is.

Everything is checked before the first notebook starts: the notebook names, the profile, the
manifest, and every parameter against the notebook's ``parameters`` cell
(``papermill.inspect_notebook``): an unknown name, or a value whose type differs from the
default's, is an error naming notebook, parameter, expected and given type, where the value came
from and what to pass. The rule and the message are the notebook's own ``check_parameters``'s
(``helpers.param_types.accepts``: an int is accepted for a float, a bool is not an int, a list for a
tuple; a default of ``None`` or an expression that is not a literal accepts anything). A notebook
without a cell tagged ``parameters`` is an error too.

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

One runner per output folder: a runner holds ``<output-dir>/.run_notebooks.lock`` (``flock``)
for its whole run; a second runner on the same folder stops at once, before any kernel starts,
naming the folder and the pid holding it (wait, or pass another ``--output-dir``). Executed
notebooks are written to a hidden ``.<stem>.<pid>.partial.ipynb`` file and moved into place when
the notebook ends, so ``<stem>.ipynb`` is never half written (``ci/outputs.py``); Ctrl-C removes it.

The course site is built from a run's executed notebooks by its own command, after the run:
``python3 -m ci.site build/full`` writes ``build/site/`` (``ci/site.py``; a failed notebook's
page says it failed), and ``python3 -m ci.site --check build/site`` clicks through it in a browser.

Run times: after every run, each passing notebook's seconds, the date and this machine are
merged into ``<output-dir>/<profile>/times.json`` (``ci/outputs.py``); ``python3 -m
ci.generate --record`` keeps them in ``docs/run_times.json`` for the README and the lessons.

Exit codes:
    0  every notebook ran without error;
    1  at least one notebook FAILED, hit a TIMEOUT or left processes behind;
    2  bad invocation or configuration (unknown notebook or profile, bad parameter, no
       ``parameters`` cell, unreadable manifest), or the output folder is in use by another
       runner; nothing was run.

Importable API: :func:`run_notebooks` (returns one dict per notebook) and :func:`main`. The
code lives in ``ci/planning.py`` (names, profiles, parameter checks), ``ci/execution.py``
(papermill, one row per notebook), ``ci/cleanup.py`` (ending the processes a notebook left),
``ci/outputs.py`` (one runner per output folder, whole files only) and
this file (the command line); run it as ``python3 ci/run_notebooks.py`` or
``python3 -m ci.run_notebooks``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path

if not __package__:  # run as a file: this copy's `ci` and `helpers`, not the ones the Python has installed
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

try:
    from ci.execution import (
        STATUS_FAILED,
        STATUS_OK,
        STATUS_SKIPPED,
        STATUS_TIMEOUT,
        execute_plan,
        format_table,
        run_notebooks,
    )
    from ci.outputs import OutputDirBusy, output_lock, record_times
    from ci.planning import (
        DEFAULT_NOTEBOOKS_DIR,
        PROFILE_CELL_TIMEOUTS,
        PROFILES,
        CliValue,
        ConfigError,
        discover_notebooks,
        expected_type,
        load_profiles,
        notebook_parameters,
        plan_run,
        require_device,
        resolve_notebooks,
        type_check_parameters,
    )
except ImportError as e:
    if type(e).__name__ == "CheckoutMismatch":  # helpers.checkout: the working folder is another copy's
        sys.exit(f"error: {e}")
    if not isinstance(e, ModuleNotFoundError) or e.name != "ci":
        raise
    sys.exit("error: the package `ci` is not importable: install the repository first "
             "(`python3 -m pip install -r requirements.lock`, which runs `pip install -e .`), "
             "or run `python3 -m ci.run_notebooks ...` from the repository root")

__all__ = [
    "main", "build_parser", "run_notebooks", "plan_run", "execute_plan", "format_table", "ConfigError",
    "CliValue", "type_check_parameters", "discover_notebooks", "expected_type", "load_profiles",
    "notebook_parameters", "require_device", "resolve_notebooks", "PROFILES", "PROFILE_CELL_TIMEOUTS",
    "STATUS_OK", "STATUS_FAILED", "STATUS_TIMEOUT", "STATUS_SKIPPED", "OutputDirBusy", "EXIT_OK", "EXIT_FAILED",
    "EXIT_USAGE",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _parse_param(text: str) -> tuple[str, CliValue]:
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise ConfigError(f"-p expects NAME=VALUE, got {text!r}")
    return name, CliValue(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 ci/run_notebooks.py",
        description="Execute the notebooks with papermill and report notebook, status, seconds.",
        epilog="Exit codes: 0 all ok; 1 a notebook failed, timed out or left processes behind; "
        "2 bad invocation or configuration (nothing ran).",
    )
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                        help="stem, number prefix (01), lesson label (06a) or path; default: the manifest's notebooks")
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
    parser.add_argument("--manifest", default=None, metavar="FILE",
                        help="lesson manifest holding the profiles (default: lessons.toml in the notebooks folder)")
    parser.add_argument("--list", action="store_true",
                        help="list the selected notebooks with their final parameters, run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        extra = dict(_parse_param(t) for t in args.parameter)
        plan = plan_run(
            args.notebooks, args.profile, args.output_dir, args.cell_timeout, extra,
            notebooks_dir=args.notebooks_dir, manifest=args.manifest,
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

    try:
        with output_lock(plan.output_dir), _sigterm_as_interrupt():  # one runner per folder
            rows = _execute_and_report(plan, args, progress)
    except OutputDirBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        sig, how = ((signal.SIGTERM, "terminated (SIGTERM)") if isinstance(e, _Terminated)
                    else (signal.SIGINT, "interrupted (Ctrl-C)"))
        print(f"\n{how}: the running notebook was stopped and its kernel ended; notebooks that "
              f"finished before it are in {plan.output_dir / plan.profile}", file=sys.stderr)
        return 128 + sig
    bad = [r for r in rows if r["status"] not in (STATUS_OK, STATUS_SKIPPED)]
    if bad:
        print()
        for r in bad:
            print(f"{r['status']} {r['error']}")
            if r.get("output"):
                print(f"    executed notebook: {r['output']}")
        sys.stdout.flush()
        return EXIT_FAILED
    return EXIT_OK


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so the same clean-up runs."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """While the notebooks run, SIGTERM (``kill``, a CI job cancelled) ends the run the way Ctrl-C
    does: the kernel is shut down and its connection files removed, instead of Python exiting at
    once and leaving them. Only in the main thread (signal handlers can be set nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _execute_and_report(plan, args, progress) -> list[dict]:
    """Run the plan, print the table and record the passing notebooks' times: the rows."""
    rows = execute_plan(plan, fail_fast=args.fail_fast, progress=progress)
    print()
    print(format_table(rows))
    try:  # the passing notebooks' times, for the README's path table (python3 -m ci.generate --record)
        print(f"\nrun times: {record_times(rows, plan.output_dir / plan.profile)}")
    except OSError as e:
        print(f"\nwarning: the run times could not be recorded: {e}", file=sys.stderr)
    from ci.gpu_claims import unproven_outputs  # the check cells' "not proven here: ..." lines

    unproven = [f"{r['notebook']}: {line}" for r in rows if r["status"] == STATUS_OK and r.get("output")
                for line in unproven_outputs(r["output"])]
    if unproven:  # not failures: claims this machine cannot prove (a GPU claim on CPU)
        print(f"\nclaims not proven in this run ({len(unproven)}):", *unproven, sep="\n  ")
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
