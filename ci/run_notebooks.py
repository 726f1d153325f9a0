#!/usr/bin/env python3
"""Execute the teaching notebooks headless with papermill, as CI does (docs/RUNNER.md).

Usage (from the repository root)::

    python ci/run_notebooks.py [--profile smoke|full|gpu] [--output-dir build]
                               [--cell-timeout SECONDS] [-p NAME=VALUE ...]
                               [--fail-fast] [--notebooks-dir DIR] [--manifest FILE]
                               [--list] [NOTEBOOK ...]

``NOTEBOOK`` is a stem, its number prefix (``01``), a lesson label (``06a``) or a path to an
``.ipynb``; without any, the lesson manifest's notebooks (``notebooks/lessons.toml``) run in its
order (a folder without a manifest: every ``*.ipynb``, by name). Each executed notebook goes to
``<output-dir>/<profile>/<stem>.ipynb``; its kernel runs in the notebook's folder, with this
copy of the course first on ``PYTHONPATH`` (``helpers/checkout.py``).

Parameters, lowest priority first: the notebook's cell tagged ``parameters`` (the smoke values);
the profile's table under the notebook's record in ``notebooks/lessons.toml`` (``[lesson.full]``,
``[lesson.gpu]``); ``-p NAME=VALUE`` (every selected notebook must declare NAME; VALUE is read as
a Python literal, else as text). Everything is checked before the first notebook starts: names,
profile, manifest, and every value against the ``parameters`` cell with the notebook's own rule
(``helpers.param_types.accepts``), each error naming notebook, parameter, types, source and fix.

A failure names the notebook, the cell (its 0-based position in the source notebook) and the
error. Cell timeout: ``smoke`` 300 s, ``full`` 1800 s, or ``--cell-timeout`` (``0``: none).
After every notebook no process it started may be left (``ci/cleanup.py``: a cut-short kernel's
tree is killed; leftovers fail the notebook). One runner per output folder (``ci/outputs.py``:
a ``flock``; executed notebooks appear only whole). Each passing notebook's seconds are merged
into ``<output-dir>/<profile>/times.json``; ``python3 -m ci.generate --record`` keeps them.

Exit codes:
    0  every notebook ran without error;
    1  at least one notebook FAILED, hit a TIMEOUT or left processes behind;
    2  bad invocation or configuration, or the output folder is in use; nothing was run.

Importable API: :func:`run_notebooks` and :func:`main`; the code lives in ``ci/planning.py``,
``ci/execution.py``, ``ci/cleanup.py`` and ``ci/outputs.py``.
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
