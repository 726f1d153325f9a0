"""ci/gpu_check.py refuses, with a clear message and before running anything, on a machine
without CUDA (the GPU run itself is recorded in docs/GPU.md)."""

import collections
import subprocess
import sys

import nbformat
import pytest
import torch

from _support import REPO_ROOT
from ci import gpu_check
from helpers import lessons as manifest

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run for real")
def test_refuses_without_cuda(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "ci" / "gpu_check.py"), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no usable CUDA GPU" in proc.stderr and "nothing was run" in proc.stderr, proc.stderr
    assert not out.exists(), "nothing may be written when the check is refused"


def test_usage_needs_an_output_folder(capsys):
    # in this process: the script itself starts in the test above (a new process imports torch
    # again, about 4 CPU-seconds)
    with pytest.raises(SystemExit) as exited:
        gpu_check.main([])
    assert exited.value.code == 2 and "out_dir" in capsys.readouterr().err


def _gpu_marks_by_lesson() -> dict[str, int]:
    """``**Claim (GPU):**`` labels per lesson, counted as plain text (not by ci/gpu_claims.py)."""
    counts = {stem: sum(c.source.count("**Claim (GPU):**") + c.source.count("**Claims (GPU):**")
                        for c in nbformat.read(str(REPO_ROOT / "notebooks" / f"{stem}.ipynb"), as_version=4).cells
                        if c.cell_type == "markdown") for stem in manifest.stems(None)}
    return {stem: n for stem, n in counts.items() if n}


def test_the_summary_lists_every_gpu_claim_and_runs_its_lesson():
    # on CPU: parses the notebooks, runs nothing
    rows = gpu_check.gpu_claims()
    listed = collections.Counter(r["lesson"] for r in rows)
    marked = _gpu_marks_by_lesson()
    assert marked, "the course marks no **Claim (GPU):**"
    assert listed == marked, f"gpu_check lists {listed}, the notebooks mark {marked}"
    not_run = sorted({stem for stem in marked if stem.split("_")[0] not in gpu_check.GPU_NOTEBOOKS})
    assert not not_run, f"lessons with a GPU claim that gpu_check.GPU_NOTEBOOKS does not run: {not_run}"
    assert all(r["status"] == "not run" and r["claim"] and r["helper_calls"] for r in rows), rows
    table = gpu_check.claims_lines(rows)
    assert len(table) == 2 + len(rows) and all(r["claim"] in "\n".join(table) for r in rows)


def test_a_gpu_claim_that_printed_not_proven_is_not_proven(tmp_path):
    stem = "06b_state_across_ranks"
    nb = nbformat.read(str(REPO_ROOT / "notebooks" / f"{stem}.ipynb"), as_version=4)
    mine = [r for r in gpu_check.gpu_claims() if r["lesson"] == stem]
    first = mine[0]
    cell = next(c for c in nb.cells[first["cell"] + 1:] if c.cell_type == "code")
    line = f"not proven here: needs 2 GPUs (found 1); a GPU run proves it. Claim (GPU): {first['helper_calls'][0]}"
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=line + "\n")]
    nbformat.write(nb, str(tmp_path / f"{stem}.ipynb"))
    status = {(r["lesson"], r["cell"], r["claim"]): r["status"] for r in gpu_check.gpu_claims(tmp_path)}
    assert status[(stem, first["cell"], first["claim"])].startswith("not proven: not proven here: needs 2 GPUs")
    assert [status[(stem, r["cell"], r["claim"])] for r in mine[1:]] == ["proven on GPU"] * (len(mine) - 1)
    assert {s for (lesson, _, _), s in status.items() if lesson != stem} == {"not run"}
