"""The launcher contract (helpers.launch.launch): real processes, real gloo process groups."""

import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import launch_workers as w
from _support import REPO_ROOT, TESTS_DIR, leftover_processes
from helpers.launch import (
    LaunchError,
    LaunchTimeout,
    OversubscriptionWarning,
    WorkerError,
    launch,
    resolve_backend,
)

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


def test_worker_exception_names_rank_type_message_and_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(w.raise_on, 2, bad_rank=1, timeout=120)
    err = info.value
    assert err.rank == 1
    assert err.exc_type == "ZeroDivisionError"
    assert "deliberate failure on rank 1" in err.message
    assert "raise_on" in err.traceback and "launch_workers.py" in err.traceback
    assert "rank 1 failed with ZeroDivisionError" in str(err)
    assert time.monotonic() - start < 60, "the error must end the launch, not the timeout"


def test_worker_exception_on_rank_zero():
    with pytest.raises(WorkerError) as info:
        launch(w.raise_on, 2, bad_rank=0)
    assert info.value.rank == 0


def test_timeout_names_unfinished_ranks():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(w.skip_collective, 2, timeout=6)
    assert info.value.ranks_not_finished == [1]
    assert "timed out after 6 s" in str(info.value)
    assert time.monotonic() - start < 6 + 30


def test_exit_without_result():
    with pytest.raises(WorkerError) as info:
        launch(w.exit_without_result, 2, timeout=120)
    assert info.value.rank == 1
    assert "without returning a result" in str(info.value)


def test_sys_exit():
    with pytest.raises(WorkerError) as info:
        launch(w.sys_exit_3, 2, timeout=120)
    assert info.value.rank == 1 and info.value.exc_type == "SystemExit"
    assert "sys.exit(3)" in str(info.value)


def test_sigkill():
    with pytest.raises(WorkerError) as info:
        launch(w.sigkill_self, 2, timeout=120)
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)


def test_unpicklable_result_names_rank():
    with pytest.raises(WorkerError) as info:
        launch(w.unpicklable_result, 2)
    assert info.value.rank == 1
    assert "cannot be pickled" in info.value.message


def test_keyboard_interrupt_ends_workers_and_next_launch_works():
    handler = signal.getsignal(signal.SIGINT)
    timer = threading.Timer(8.0, _thread.interrupt_main)  # what "interrupt kernel" delivers
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(w.skip_collective, 2, timeout=120)
    finally:
        timer.cancel()
    assert not leftover_processes()
    assert signal.getsignal(signal.SIGINT) is handler, "the caller's SIGINT handler must be left alone"
    assert launch(w.report, 2)[1]["sum"] == 1.0


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
