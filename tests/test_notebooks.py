"""Execute every notebooks/*.ipynb through the CI runner, in the smoke and the full profile.

The full profile (ci/profiles.json) is what a learner runs and what the main job executes; it
adds about 9 minutes on 2 cores, most of it notebook 05's benchmarks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci.run_notebooks import run_notebooks

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}: nothing to execute"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("profile", ["smoke", "full"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, profile: str, tmp_path: Path):
    (row,) = run_notebooks([str(path)], profile=profile, output_dir=tmp_path)
    assert row["status"] == "ok", (
        f"{row['notebook']} {row['status']} after {row['seconds']:.1f} s: {row['error']}\n"
        f"executed notebook: {row['output']}"
    )
