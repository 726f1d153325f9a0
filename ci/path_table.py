#!/usr/bin/env python3
"""Write the run-time column of the README's path table from a recorded run.

Usage (from anywhere)::

    python3 ci/path_table.py --record build/full/times.json   # take a full run's times, rewrite
    python3 ci/path_table.py                                  # rewrite from docs/run_times.json
    python3 ci/path_table.py --check                          # exit 1 if the README is out of date

The runner (``ci/run_notebooks.py``) merges each passing notebook's seconds, date and machine
into ``build/<profile>/times.json`` (``ci.outputs.record_times``). ``--record FILE`` copies such a
record into ``docs/run_times.json`` (committed, so ``--check`` and the tests need no run); the
README is then rendered from that file. Between ``<!-- path:start -->`` and ``<!-- path:end -->``
the table's rows are typed by hand (lesson link ``notebooks/<stem>.ipynb`` first, run time
last); this script rewrites only each row's last cell, and the one line under the table that
says where and when the times were measured. A lesson without a recorded time reads "not
measured yet".

Exit codes: 0 written / up to date; 1 ``--check`` found the README out of date; 2 the markers,
the table or a record is missing or unreadable.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ci import params_table

REPO_ROOT = params_table.REPO_ROOT
README = REPO_ROOT / "README.md"
TIMES = REPO_ROOT / "docs" / "run_times.json"
START = "<!-- path:start -->"
END = "<!-- path:end -->"
NOTE = "Run times: "
STEM = re.compile(r"\(notebooks/([^)/]+)\.ipynb\)")


def fmt_seconds(seconds: float) -> str:
    """``57 s`` under 100 s, else whole minutes (``9 min``)."""
    return f"{round(seconds)} s" if seconds < 100 else f"{round(seconds / 60)} min"


def block(current: str, times: dict) -> str:
    """The new text between the markers: ``current``'s table with its last column from ``times``.

    ``times`` is a ``docs/run_times.json`` record: ``{"profile", "source" (optional),
    "notebooks": {stem: {"seconds", "date", "machine"}}}``.

    Raises:
        ValueError: no table between the markers, or a row names no ``notebooks/<stem>.ipynb``.
    """
    measured = times.get("notebooks", {})
    lines = [line for line in current.strip("\n").splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise ValueError(f"no table (header, rule, rows) between {START} and {END}")
    out = lines[:2]
    used = []
    for line in lines[2:]:
        cells = line.strip().strip("|").split(" | ")
        match = STEM.search(cells[0])
        if not match:
            raise ValueError(f"a path-table row names no notebooks/<stem>.ipynb: {line!r}")
        entry = measured.get(match.group(1))
        cells[-1] = fmt_seconds(float(entry["seconds"])) if entry else "not measured yet"
        if entry:
            used.append(entry)
        out.append("| " + " | ".join(c.strip() for c in cells) + " |")
    dates = sorted({e["date"] for e in used})
    machines = sorted({e["machine"] for e in used})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "no date"
    source = f" ({times['source']})" if times.get("source") else ""
    note = (f"{NOTE}the `{times.get('profile', 'full')}` profile's, measured on "
            f"{'; '.join(machines) or 'no machine'}, {when}{source}; written by "
            f"`python3 ci/path_table.py`, never by hand.")
    return "\n".join(out) + "\n\n" + note


def _between(text: str) -> str:
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md must contain the lines {START} and {END} exactly once each")
    return text.split(START, 1)[1].split(END, 1)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if the README's run times are out of date")
    group.add_argument("--record", type=Path, metavar="FILE",
                       help="a runner's times.json (e.g. build/full/times.json) to copy into docs/run_times.json")
    parser.add_argument("--profile", default="full", help="the profile --record's file comes from (default full)")
    parser.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    parser.add_argument("--times", type=Path, default=TIMES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.record:
            notebooks = json.loads(args.record.read_text(encoding="utf-8"))
            times = {"profile": args.profile, "notebooks": notebooks}
            args.times.write_text(json.dumps(times, indent=1) + "\n", encoding="utf-8")
        else:
            times = json.loads(args.times.read_text(encoding="utf-8"))
        current = args.readme.read_text(encoding="utf-8")
        wanted = params_table.render(current, block(_between(current), times), START, END)
    except (ValueError, OSError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return params_table.check_or_write(args.readme, current, wanted, args.check, "the path table",
                                       ": run python3 ci/path_table.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
