"""The launcher contract (helpers.engine.launch): real processes, real gloo process groups.

Faults (worker errors, exits, kills, hangs, interrupts, repeated launches) are in test_faults.py."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import launch_workers as w
from _support import REPO_ROOT, TESTS_DIR, as_cell, repo_env, run_papermill, write_notebook
from helpers.engine import LaunchError, OversubscriptionWarning, launch
from helpers.engine.processes import is_live

# slow: real processes in (nearly) every test
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(180), pytest.mark.slow]


@pytest.mark.matrix
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


def _closure():
    offset = torch.tensor([0.5])

    def inner(rank, world_size, scale=1.0):
        import torch.distributed as dist

        t = (torch.tensor([float(rank)]) + offset) * scale
        dist.all_reduce(t)
        return t.item()
    return inner


REPORT = as_cell("import dataclasses\n@dataclasses.dataclass\nclass Report:\n    rank: int\n"
               "def work(rank, world_size):\n    return Report(rank)\n")


@pytest.mark.parametrize("args,kwargs,expected", [
    pytest.param((w.report, 1), {}, [0.0], id="world_size-1"),  # (the all_reduce's sum)
    pytest.param((lambda rank, world_size: rank * 10 + world_size, 2), {}, [2, 12], id="lambda"),
    # a closure with its variables: (0 + 0.5) * 2 + (1 + 0.5) * 2 = 4.0 on every rank
    pytest.param((_closure(), 2), {"scale": 2.0}, [4.0, 4.0], id="closure"),
    # an instance of a cell-defined class comes back
    pytest.param((REPORT["work"], 2), {}, [REPORT["Report"](0), REPORT["Report"](1)], id="cell-defined-class",
                 marks=pytest.mark.matrix),
])
def test_sent_by_value_runs(args, kwargs, expected):
    results = launch(*args, **kwargs)
    assert (results if args[0] is not w.report else [r["sum"] for r in results]) == expected


# ---- bad input: refused before any process starts ------------------------------------------

@pytest.mark.parametrize("args,kwargs,said", [
    *[((w.report, n), {}, "world_size") for n in (0, -1, 2.5, "2", True, None)],
    ((42, 2), {}, "fn must be callable"),
    ((w.report, 2), {"backend": "mpi-ish"}, "unknown backend"),
    pytest.param((w.report, 2), {"backend": "nccl"}, "nccl.*GPU", marks=pytest.mark.skipif(
        torch.cuda.device_count() >= 2, reason="this machine has enough GPUs for nccl")),
    *[((w.report, 2), {"timeout": t}, "timeout") for t in (0, -5, "10")],
    ((w.report, 8 * (os.cpu_count() or 1) + 1), {}, "ranks per CPU core"),
])
def test_bad_input_refused(args, kwargs, said):
    with pytest.raises(LaunchError, match=said):
        launch(*args, **kwargs)


@pytest.mark.matrix
def test_function_from_main_runs():
    """A function defined in __main__ (a script's top level, as in a notebook cell) is sent by value."""
    code = (
        "from helpers.engine import launch\n"
        "def mine(rank, world_size):\n    return rank + 100\n"
        "if __name__ == '__main__':\n    print('RESULTS', launch(mine, 2))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "RESULTS [100, 101]" in proc.stdout, proc.stdout


NOTEBOOK_CELLS = [
    # a function and an nn.Module subclass defined in cells, sent by value to 2 ranks
    """\
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.engine import launch


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
""",
    """\
def ddp_grads(rank, world_size):
    torch.manual_seed(rank)  # different start weights on each rank: DDP broadcasts rank 0's
    model = DDP(TinyNet())
    x, y = batch()
    shard = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
    nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    print(f"rank {rank} of {world_size}: {type(model.module).__name__} backward done")
    return {name: p.grad.clone() for name, p in model.module.named_parameters()}


results = launch(ddp_grads, world_size)
""",
    """\
torch.manual_seed(0)
reference = TinyNet()
x, y = batch()
nn.functional.mse_loss(reference(x), y).backward()
for rank in range(world_size):
    for name, p in reference.named_parameters():
        torch.testing.assert_close(results[rank][name], p.grad)
print("GRADS MATCH", sorted(results[0]))
""",
]


@pytest.mark.matrix
def test_cell_defined_function_and_module_run_from_a_notebook(tmp_path, monkeypatch):
    """A papermill-executed notebook: a function and an nn.Module subclass defined in cells run in
    DDP on 2 ranks; the averaged gradients equal one process's gradients on the whole batch."""
    monkeypatch.setenv("PYTHONPATH", repo_env()["PYTHONPATH"])
    write_notebook(tmp_path / "cell_defined.ipynb", *NOTEBOOK_CELLS, params="world_size = 2")
    text = "".join(run_papermill(tmp_path / "cell_defined.ipynb", cwd=tmp_path, timeout=150))
    assert "[rank 1] rank 1 of 2: TinyNet backward done" in text, text
    assert "GRADS MATCH ['fc1.bias', 'fc1.weight', 'fc2.bias', 'fc2.weight']" in text, text


def test_oversubscription_warns_and_runs():
    cpus = os.cpu_count() or 1
    with pytest.warns(OversubscriptionWarning) as warned:
        results = launch(w.report, cpus + 1)
    assert len(results) == cpus + 1
    # the warning names the caller's line (a cell's), not one inside helpers/engine/launcher.py
    assert [r.filename for r in warned] == [__file__], [(r.filename, r.lineno) for r in warned]


# ---- the same worker under torchrun --------------------------------------------------------

@pytest.mark.matrix
def test_same_worker_runs_under_torchrun(tmp_path):
    """Each rank's stdout goes to its own file (``--redirects 3`` under ``--log-dir``): two ranks
    writing one stdout at once can join their lines, so the combined stream is never parsed."""
    logs = tmp_path / "torchrun-logs"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         f"--log-dir={logs}", "--redirects=3", str(TESTS_DIR / "launch_workers.py")],
        capture_output=True, text=True, timeout=150, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # torchrun's layout: <log-dir>/<run id>/attempt_0/<local rank>/stdout.log
    files = sorted(logs.glob("*/attempt_0/*/stdout.log"), key=lambda p: int(p.parent.name))
    assert [int(f.parent.name) for f in files] == [0, 1], f"per-rank logs: {files}\n{proc.stderr}"
    for local_rank, f in enumerate(files):
        results = [line for line in f.read_text().splitlines() if line.startswith("TORCHRUN_RESULT")]
        assert results == [f"TORCHRUN_RESULT {local_rank} 2 2.0"], f.read_text()


# ---- parent-death signal: the thread that starts the ranks outlives them -----------------------

def pdeathsig(rank, world_size):
    """The signal this process gets when its parent thread dies (prctl PR_GET_PDEATHSIG)."""
    import ctypes

    sig = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig), 0, 0, 0)  # 2 = PR_GET_PDEATHSIG
    return sig.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
@pytest.mark.parametrize("how", ["returns", "times out"])
def test_ranks_started_by_agent_thread_that_outlives_them(monkeypatch, how):
    """PR_SET_PDEATHSIG fires when the *thread* that created a process exits. Record which thread
    starts each rank and whether every rank has exited when that thread's elastic agent returns."""
    import multiprocessing.process

    import torch.distributed.launcher.api as api

    started = []  # (thread name, process)
    at_agent_return = []  # whether each rank still ran when elastic_launch returned, in its thread
    real_start, real_launch = multiprocessing.process.BaseProcess.start, api.elastic_launch

    def start(self):
        started.append((threading.current_thread().name, self))
        return real_start(self)

    def elastic_launch(config, entrypoint):
        run = real_launch(config, entrypoint)

        def wrapped(*a):
            try:
                return run(*a)
            finally:
                at_agent_return.extend(is_live(p.pid) for _, p in started)
        return wrapped

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    if how == "returns":
        import signal

        assert launch(pdeathsig, 2) == [signal.SIGKILL, signal.SIGKILL]
    else:
        from helpers.engine import LaunchTimeout, faults

        with pytest.raises(LaunchTimeout):
            launch(faults.skip_collective, 2, timeout=5)
    assert [name for name, _ in started] == ["ddp-lab-elastic-agent"] * 2, started
    assert at_agent_return == [False, False], \
        f"a rank was still running when the thread that started it ended: running {at_agent_return}"


def _nap(rank, world_size, seconds):
    import time

    time.sleep(seconds)
    return (rank, seconds)


def test_launches_from_two_threads_both_return():
    """A launch ends what multiprocessing started below the caller during it; a second launch from
    another thread, started while the first runs, must not lose its ranks to that clean-up."""
    launch(_nap, 1, 0)  # the fork server up first: both launches below fork from it
    got = {}

    def run(name, seconds):
        try:
            got[name] = launch(_nap, 2, seconds, timeout=120)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            got[name] = e

    first = threading.Thread(target=run, args=("first", 2.0))
    second = threading.Thread(target=run, args=("second", 0.5))
    first.start()
    time.sleep(1.0)
    second.start()
    first.join(150)
    second.join(150)
    assert got == {"first": [(0, 2.0), (1, 2.0)], "second": [(0, 0.5), (1, 0.5)]}, got
