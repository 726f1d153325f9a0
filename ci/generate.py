"""Write every generated text of the course from the lesson manifest and the records: one command.

Usage (from the repository root)::

    python3 -m ci.generate                                          # write what is out of date
    python3 -m ci.generate --check                                  # exit 1 if anything is
    python3 -m ci.generate --record build/full/times.json --profile full   # take a run's times first

What it writes, each between its markers (``ci/marked.py``): the README's path table and every
notebook's opening block and "Next" link (``ci/path_table.py``, from ``notebooks/lessons.toml``
and ``docs/run_times.json``), docs/RUNNER.md's parameter table (``ci/params_table.py``),
docs/TEACHING.md's agendas (``ci/agenda.py``, ``ci/workshop.py``), docs/OWN_CODE.md's table of
tutorial edits (``ci/changes_table.py``) and docs/CASEBOOK.md, the casebook by symptom
(``ci/casebook.py``, the whole file). ``--record FILE`` first copies a runner's ``times.json`` (written by
``ci/run_notebooks.py`` into ``build/<profile>/``) into ``docs/run_times.json`` under
``--profile``, merged: the lessons the run did not pass keep their times (``--record-replace
FILE`` drops them); the other profile's times are kept.

Exit codes: 0 written / up to date; 1 ``--check`` found something out of date; 2 the manifest, a
record, a notebook or a marker is missing or unreadable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ci import agenda, casebook, changes_table, lessons, marked, params_table, path_table, planning, workshop
from helpers.lessons import ManifestError


def record(times_file: Path, run_file: Path, profile: str, replace: bool = False) -> None:
    """Merge ``run_file`` (``{stem: {"seconds", "date", "machine"}}``) into ``times_file``'s
    ``profile`` times (``replace``: instead of them), each with ``"parts"``: its sections' seconds,
    read from the executed notebook beside ``run_file`` (:func:`ci.workshop.part_seconds`).
    Raises OSError or ValueError when a file is unreadable."""
    run = json.loads(run_file.read_text(encoding="utf-8"))
    for stem, entry in run.items():
        executed = run_file.parent / f"{stem}.ipynb"
        if executed.is_file():
            entry["parts"] = workshop.part_seconds(executed)
    current = json.loads(times_file.read_text(encoding="utf-8")) if times_file.is_file() else {}
    profiles = current.get("profiles", {})
    kept = {} if replace else profiles.get(profile, {})
    profiles[profile] = dict(sorted({**kept, **run}.items()))
    times_file.write_text(json.dumps({"profiles": dict(sorted(profiles.items()))}, indent=1) + "\n",
                          encoding="utf-8")


def outputs(root: Path) -> list[tuple[Path, str, str, str]]:
    """``(path, current, wanted, what)`` for every generated text of the checkout at ``root``."""
    notebooks, times = root / "notebooks", root / "docs" / "run_times.json"
    return [*path_table.outputs(root / "README.md", times, notebooks),
            *params_table.outputs(root / "docs" / "RUNNER.md", notebooks),
            *agenda.outputs(root / "docs" / "TEACHING.md", times, notebooks),
            *changes_table.outputs(root / "docs" / "OWN_CODE.md", root / "tests" / "engine" / "tutorial_edits.py"),
            *casebook.outputs(root / "docs" / "CASEBOOK.md", notebooks),
            *lessons.outputs(root / "docs" / "TESTING.md")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any generated text is out of date")
    record_ = parser.add_mutually_exclusive_group()
    record_.add_argument("--record", type=Path, metavar="FILE", help="merge a runner's times.json "
                         "(e.g. build/full/times.json) into docs/run_times.json")
    record_.add_argument("--record-replace", type=Path, metavar="FILE",
                         help="as --record, dropping the profile's lessons FILE lacks")
    parser.add_argument("--profile", choices=planning.PROFILES, default="full",
                        help="the profile --record's file comes from (default full)")
    parser.add_argument("--root", type=Path, default=path_table.REPO_ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    run_file = args.record or args.record_replace
    if args.check and run_file:
        parser.error("--check and --record do not go together")
    try:
        if run_file:
            record(args.root / "docs" / "run_times.json", run_file, args.profile, not args.record)
        wanted = outputs(args.root)
    except (ManifestError, planning.ConfigError, ValueError, OSError, KeyError, AttributeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rcs = [marked.check_or_write(path, now, new, args.check, what) for path, now, new, what in wanted]
    stale = sum(rcs)
    print(f"{len(wanted) - stale} of {len(wanted)} generated texts up to date" if args.check
          else f"{len(wanted)} generated texts checked")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
