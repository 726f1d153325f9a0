"""The launcher contract (helpers.launch.launch): real processes, real gloo process groups.

Faults (worker errors, exits, kills, hangs, interrupts, repeated launches) are in test_faults.py."""

import os
import subprocess
import sys
import threading

import pytest
import torch

import launch_workers as w
from _support import REPO_ROOT, TESTS_DIR
from helpers.launch import LaunchError, OversubscriptionWarning, launch, resolve_backend

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(180)]


def test_results_in_rank_order_with_torchrun_environment(capfd):
    results = launch(w.report, 2, 10.0)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["env_rank"] for r in results] == [0, 1]
    assert [r["local_rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["sum"] == 21.0 for r in results), "all_reduce of (0+10) and (1+10) must be 21 on every rank"
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in results)
    cpus = os.cpu_count() or 1
    assert all(r["threads"] == max(1, cpus // 2) for r in results)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank} of 2" in out
        assert f"[rank {rank}] warning-ish line from rank {rank}" in err


def test_no_fixed_port_and_repeated_launches():
    ports = [launch(w.report, 2)[0]["master_port"] for _ in range(3)]
    assert all(p > 0 for p in ports)
    assert len(set(ports)) > 1, f"every launch used the same port {ports}: looks fixed"


def test_world_size_one():
    assert launch(w.report, 1)[0]["sum"] == 0.0


# ---- bad input: refused before any process starts ------------------------------------------

@pytest.mark.parametrize("world_size", [0, -1, 2.5, "2", True, None])
def test_bad_world_size(world_size):
    with pytest.raises(LaunchError, match="world_size"):
        launch(w.report, world_size)


def test_lambda_refused():
    with pytest.raises(LaunchError, match="lambda"):
        launch(lambda rank, world_size: rank, 2)


def test_nested_function_refused():
    def inner(rank, world_size):
        return rank

    with pytest.raises(LaunchError, match="inside another function"):
        launch(inner, 2)


def test_function_from_main_refused():
    """A function defined in __main__ (as in a notebook cell) is refused with a pointer to helpers/."""
    code = (
        "from helpers.launch import launch, LaunchError\n"
        "def mine(rank, world_size):\n    return rank\n"
        "try:\n    launch(mine, 2)\nexcept LaunchError as e:\n    print('REFUSED', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "__main__" in proc.stdout and "helpers/" in proc.stdout


def test_unknown_backend():
    with pytest.raises(LaunchError, match="unknown backend"):
        launch(w.report, 2, backend="mpi-ish")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has enough GPUs for nccl")
def test_nccl_without_enough_gpus():
    with pytest.raises(LaunchError, match="nccl.*GPU"):
        launch(w.report, 2, backend="nccl")


def test_backend_none_is_gloo_without_gpus():
    expected = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    assert resolve_backend(None, 2) == expected


def test_unpicklable_argument_named():
    with pytest.raises(LaunchError, match="keyword argument 'lock'"):
        launch(w.report, 2, lock=threading.Lock())


@pytest.mark.parametrize("timeout", [0, -5, "10"])
def test_bad_timeout(timeout):
    with pytest.raises(LaunchError, match="timeout"):
        launch(w.report, 2, timeout=timeout)


def test_oversubscription_warns_and_runs():
    cpus = os.cpu_count() or 1
    with pytest.warns(OversubscriptionWarning):
        results = launch(w.report, cpus + 1)
    assert len(results) == cpus + 1


def test_far_too_many_ranks_refused():
    with pytest.raises(LaunchError, match="ranks per CPU core"):
        launch(w.report, 8 * (os.cpu_count() or 1) + 1)


# ---- the same worker under torchrun --------------------------------------------------------

def test_same_worker_runs_under_torchrun():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(TESTS_DIR / "launch_workers.py")],
        capture_output=True, text=True, timeout=150, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("TORCHRUN_RESULT"))
    assert lines == ["TORCHRUN_RESULT 0 2 2.0", "TORCHRUN_RESULT 1 2 2.0"], proc.stdout
