"""Execute every notebooks/*.ipynb through the CI runner in the smoke profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci.run_notebooks import run_notebooks

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}: nothing to execute"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_profile(path: Path, tmp_path: Path):
    (row,) = run_notebooks([str(path)], profile="smoke", output_dir=tmp_path)
    assert row["status"] == "ok", (
        f"{row['notebook']} {row['status']} after {row['seconds']:.1f} s: {row['error']}\n"
        f"executed notebook: {row['output']}"
    )
