"""ci/gpu_check.py refuses, with a clear message and before running anything, on a machine
without CUDA (the GPU run itself is recorded in docs/GPU.md)."""

import subprocess
import sys

import pytest
import torch

from _support import REPO_ROOT
from ci import gpu_check

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
