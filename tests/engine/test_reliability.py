"""ci/reliability.py: the fault matrix goes to build/, and one command copies it into docs/."""

from __future__ import annotations

import json

from ci import reliability

ROWS = [
    {"fault": "rank 1 raises", "injection": "`x`", "error": "`WorkerError`", "seconds": 2.5, "left": 0,
     "status": "survived"},
    {"fault": "20 launches", "injection": "`y`", "error": "none", "seconds": None, "left": 0, "status": "survived"},
    {"fault": "a hang", "injection": "`z`", "error": "`LaunchTimeout`", "seconds": 7.0, "left": 1,
     "status": "FAILED"},
]
DETAILS = {"run": "2026-01-01 00:00", "torch": "2.14.1", "python": "3.11.7", "cpus": 2}


def test_render_counts_rows_and_names_the_slowest():
    text = reliability.render(ROWS, DETAILS)
    assert "**2 of 3 faults survived**" in text
    assert "slowest time to error: 7.0 s (a hang)" in text
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + len(ROWS)  # header + one row per fault
    assert "| 20 launches | `y` | none |  | 0 | survived |" in text
    assert "python3 -m ci.reliability" in text, "the document names the command that refreshes it"


def test_partial_run_never_replaces_the_complete_matrix(tmp_path):
    reliability.write_build_report(ROWS, DETAILS, complete=True, build_dir=tmp_path)
    reliability.write_build_report(ROWS[:1], DETAILS, complete=False, build_dir=tmp_path)
    assert len(json.loads((tmp_path / "fault_matrix.json").read_text())["rows"]) == 3
    assert len(json.loads((tmp_path / "fault_matrix.partial.json").read_text())["rows"]) == 1
    assert (tmp_path / "RELIABILITY.md").read_text() == reliability.render(ROWS, DETAILS)


def test_refresh_and_check(tmp_path, capsys):
    matrix = reliability.write_build_report(ROWS, DETAILS, complete=True, build_dir=tmp_path)
    doc = tmp_path / "docs" / "RELIABILITY.md"
    doc.parent.mkdir()
    args = ["--matrix", str(matrix), "--output", str(doc)]
    assert reliability.main([*args, "--check"]) == reliability.EXIT_DIFFERS
    assert reliability.main(args) == reliability.EXIT_OK
    assert doc.read_text() == reliability.render(ROWS, DETAILS)
    assert reliability.main([*args, "--check"]) == reliability.EXIT_OK
    missing = ["--matrix", str(tmp_path / "nope.json"), "--output", str(doc)]
    assert reliability.main(missing) == reliability.EXIT_MISSING
    assert "tests/engine/test_faults.py" in capsys.readouterr().err
