"""Warm ranks (helpers.engine.warm_ranks): real ipyparallel engines, a real gloo group, a papermill-run notebook.

The faults (hung collective in ``run`` and in a ``%%px`` cell, killed ranks, interrupt, kernel
restart and kill) are rows of the fault matrix in tests/engine/test_faults.py.
"""

import os
import sys
import uuid

import psutil
import pytest
import torch

from _support import (
    RANKS_MARK,
    Kernel,
    busy_cpus,
    leftover_processes,
    marked_processes,
    marked_warm_ranks,
    repo_env,
    run_papermill,
    wait_until_gone,
    write_notebook,
)
from helpers.engine import LaunchError, WorkerError, faults, launch, start_ranks
from helpers.engine.internal import current_ranks, threads_per_rank
from helpers.engine.warm_ranks import _px_magic

# slow: kernels or warm ranks in (nearly) every test
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MARK = uuid.uuid4().hex  # every engine and controller this module starts carries it


@pytest.fixture(scope="module")
def ranks():
    yield from marked_warm_ranks(MARK, timeout=60)


# ---- before the module's warm ranks start (nothing may be running) -------------------------------

@pytest.mark.parametrize("kwargs", [
    {"world_size": 0}, {"world_size": "2"}, {"world_size": True}, {"world_size": 10 ** 6},
    {"world_size": 2, "backend": "mpi"}, {"world_size": 2, "backend": "nccl"},
])
def test_bad_input_same_message_as_launch(kwargs, no_leftover_processes):
    if kwargs.get("backend") == "nccl" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs for nccl")
    with pytest.raises(LaunchError) as from_launch:
        launch(faults.ok, kwargs["world_size"], backend=kwargs.get("backend"))
    before = current_ranks()
    with pytest.raises(LaunchError) as from_ranks:
        start_ranks(**kwargs)
    assert str(from_ranks.value) == str(from_launch.value)
    assert current_ranks() is before, "bad input must not stop or start anything"


def test_bad_timeout(no_leftover_processes):
    with pytest.raises(LaunchError, match="timeout must be a positive, finite number"):
        start_ranks(2, timeout=0)
    for opt, said in (("--timeout abc", "takes seconds, got 'abc'"), ("--timeout nan", "positive, finite")):
        with pytest.raises(LaunchError, match=said):  # before anything runs, ranks or not
            _px_magic(opt, "print(1)")


@pytest.mark.stress
@pytest.mark.slow(180)
@pytest.mark.timeout(1800)
def test_twenty_starts_while_a_core_is_busy():
    """Start and stop warm ranks 20 times while another process keeps a core busy (the load under
    which a start once lost a controller port to another process: ``start_ranks`` then retries);
    every start succeeds, runs a collective, and leaves nothing behind."""
    attempts = []
    with busy_cpus(n=1) as busy:
        for i in range(20):
            r = start_ranks(2, timeout=60, activate=False)
            attempts.append(r.start_attempts)
            assert r.run(faults.ok) == [0, 1], f"start {i}"
            r.stop()
            left = [p for p in leftover_processes() if p.pid != busy[0].pid]
            assert not left, f"start {i} left {[(p.pid, p.cmdline()) for p in left]}"
    assert len(attempts) == 20 and current_ranks() is None, attempts
    assert not leftover_processes()


def test_px_kernel_variable_says_so_and_push_sends_it():
    """A %%px cell that uses a kernel variable: one WorkerError saying the name is the kernel's and
    showing ranks.push (no per-rank tracebacks streamed above it); after ranks.push the cell runs."""
    mark = uuid.uuid4().hex
    k = Kernel(mark)
    try:
        reply, text = k.cell("from helpers.engine import start_ranks\nranks = start_ranks(2, timeout=60)\nlr = 0.5")
        assert reply["status"] == "ok", text
        reply, text = k.cell("%%px\nprint(lr * (rank + 1))")
        assert reply["status"] == "error" and reply["ename"] == "WorkerError", text
        assert "variable of this notebook's kernel" in reply["evalue"], reply["evalue"]
        assert "ranks.push({'lr': lr})" in reply["evalue"] and "rank 1: the same NameError" in reply["evalue"]
        assert "[0:execute]" not in text and "[1:execute]" not in text, text  # ipyparallel's per-rank copies
        reply, text = k.cell("ranks.push({'lr': lr})")
        assert reply["status"] == "ok", text
        reply, text = k.cell("%%px\nprint('got', lr * (rank + 1))")
        assert reply["status"] == "ok" and "got 0.5" in text and "got 1.0" in text, text
    finally:
        k.close()
    assert not wait_until_gone(mark)


@pytest.mark.matrix
def test_papermill_notebook_with_px(tmp_path, monkeypatch, no_leftover_processes):
    """A notebook run by papermill: two %%px cells where a name persists, a cell-defined function
    through ranks.run; every rank's output labelled, also when it all arrived before streaming
    began; restarting and stopping the ranks print nothing into the cell; nothing left after the
    kernel ends."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(RANKS_MARK, mark)
    monkeypatch.setenv("PYTHONPATH", repo_env()["PYTHONPATH"])
    sources = [
        "from helpers.engine import start_ranks\nranks = start_ranks(world_size=2)",
        "%%px\nx = torch.tensor([float(rank + 1)])\nprint('before', rank, x.item())",
        "%%px\ndist.all_reduce(x)\nprint('after', rank, x.item(), device)",
        "def times(rank, world_size, k):\n    return rank * k\nprint('run', ranks.run(times, k=10))",
        # what a loaded machine does: every rank's output is in before streaming starts (the
        # rank 0 line was lost then, replaced by rank 1's: warm_ranks_remote.stream_per_rank)
        "from ipyparallel.client.asyncresult import AsyncResult\n"
        "stream = AsyncResult.stream_output\n"
        "AsyncResult.stream_output = lambda ar: (ar.wait_for_output(30), stream(ar))[1]",
        "%%px\nprint('late', rank)",
        "import time\nranks.restart()\ntime.sleep(1.5)",  # ipyparallel notices a process exit within 1 s
        "ranks.stop()\ntime.sleep(1.5)",
    ]
    write_notebook(tmp_path / "in.ipynb", *sources)
    text = run_papermill(tmp_path / "in.ipynb")
    for r in range(2):
        assert f"[stdout:{r}]" in text[1] and f"before {r} {float(r + 1)}" in text[1], text[1]
        # x from the cell before is still there; 1 + 2 = 3 on both ranks
        assert f"[stdout:{r}]" in text[2] and f"after {r} 3.0 cpu" in text[2], text[2]
    assert "run [0, 10]" in text[3], text[3]
    assert all(f"[stdout:{r}] late {r}" in text[5] for r in range(2)), text[5]
    # ipyparallel logs the exit of a killed process, with its whole output file, as a warning: about
    # 100 lines of the controller's log arrived in this cell until the ranks silenced it
    assert text[6] == text[7] == "", (text[6], text[7])
    assert not wait_until_gone(mark), "engines/controller left after papermill"
    assert not wait_until_gone(mark, cmd_contains=""), "the kernel, the watchdog: nothing may be left"


# ---- on the module's warm ranks --------------------------------------------------------------------

@pytest.mark.matrix
def test_run_on_every_rank_with_its_group(ranks):
    def where(rank, world_size, scale=1):  # defined here: sent to the ranks by value
        import torch.distributed as dist

        return {"rank": rank, "world_size": world_size, "group_rank": dist.get_rank(),
                "group_size": dist.get_world_size(), "backend": dist.get_backend(),
                "threads": torch.get_num_threads(), "pid": os.getpid(), "scaled": rank * scale}

    got = ranks.run(where, scale=10)
    assert [g["rank"] for g in got] == [g["group_rank"] for g in got] == [0, 1]
    assert {g["group_size"] for g in got} == {2} and {g["world_size"] for g in got} == {2}
    assert {g["backend"] for g in got} == {"gloo"} and ranks.devices == ["cpu", "cpu"]
    assert [g["scaled"] for g in got] == [0, 10]
    assert [g["pid"] for g in got] == ranks.pids and os.getpid() not in ranks.pids
    if "OMP_NUM_THREADS" not in os.environ:
        assert {g["threads"] for g in got} == {threads_per_rank(2)}


@pytest.mark.matrix
def test_engines_are_forked_from_the_fork_server_with_torch_imported(ranks):
    """Each engine is a child of this process's fork server (helpers.engine.warm_ranks_forked), so
    torch was imported there once, not again per rank; named so that ``ps`` tells it apart from the
    server, whose command line it has; its multiprocessing start method is the platform's default."""
    import multiprocessing

    from helpers.engine.fork_server import fork_server_pid
    from helpers.engine.warm_ranks_forked import RANK_PROCESS_NAME

    got = ranks.run(lambda rank, world_size: (os.getppid(), psutil.Process().name(), os.getsid(0) == os.getpid(),
                                              multiprocessing.get_start_method()))
    server = fork_server_pid()
    expected = (server, RANK_PROCESS_NAME, True, multiprocessing.get_start_method())
    assert server is not None and got == [expected] * 2, got


@pytest.mark.matrix
def test_cell_defined_module_and_collective(ranks):
    class Scale(torch.nn.Module):  # a class defined in the caller, as in a notebook cell
        def __init__(self, k):
            super().__init__()
            self.k = k

        def forward(self, x):
            return x * self.k

    def reduce_scaled(rank, world_size, module):
        import torch.distributed as dist

        t = module(torch.tensor([float(rank + 1)]))
        dist.all_reduce(t)
        return t.item()

    # ranks hold 1*3 and 2*3; the sum, computed here without torch.distributed: 9
    assert ranks.run(reduce_scaled, Scale(3)) == [float(sum(3 * (r + 1) for r in range(2)))] * 2


def test_names_persist_and_predefined(ranks):
    ranks.execute("x = rank + 41\nsame_device = str(device)", stream=False)
    ranks.execute("x += world_size", stream=False)
    assert ranks.view.pull("x", block=True) == [43, 44]
    assert ranks.view.pull("same_device", block=True) == ["cpu", "cpu"]
    assert ranks.view.apply_sync(lambda: __import__("os").environ["RANK"]) == ["0", "1"]


@pytest.fixture
def stays_warm(ranks):
    """The module's ranks, which the test's errors must leave warm: the same processes, no restart,
    and the next run works (the peers finished: the group is intact)."""
    pids, restarts = list(ranks.pids), ranks.restarts
    yield ranks
    assert ranks.pids == pids and ranks.restarts == restarts and ranks.run(faults.ok) == [0, 1]


@pytest.mark.matrix
def test_worker_error_names_rank_and_keeps_ranks_warm(stays_warm):
    ranks = stays_warm
    with pytest.raises(WorkerError) as info:
        ranks.run(lambda rank, world_size: rank if rank == 0 else 1 / 0)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ZeroDivisionError" and "division by zero" in err.message
    assert "ZeroDivisionError" in err.traceback and "\x1b[" not in err.traceback
    assert "rank 1 failed with ZeroDivisionError" in str(err)


def test_run_relays_what_each_rank_prints(ranks, capsys):
    """``ranks.run`` shows what the ranks print, as ``launch`` does: whole lines prefixed
    ``[rank r]``, stdout to stdout and stderr to stderr, also from a rank that then raises."""
    def chatty(rank, world_size):

        for i in range(3):
            print(f"line {i} of rank {rank}")
        print(f"to stderr from {rank}", file=sys.stderr)
        return rank

    assert ranks.run(chatty) == [0, 1]
    out, err = capsys.readouterr()
    for rank in range(2):
        assert [line for line in out.splitlines() if line.startswith(f"[rank {rank}] ")] == \
            [f"[rank {rank}] line {i} of rank {rank}" for i in range(3)], out
        assert f"[rank {rank}] to stderr from {rank}" in err.splitlines(), err

    def then_fails(rank, world_size):
        print(f"rank {rank} got this far")
        return 1 / rank

    with pytest.raises(WorkerError):
        ranks.run(then_fails)
    out, _ = capsys.readouterr()
    assert "[rank 0] rank 0 got this far" in out.splitlines(), out


def test_run_refuses_what_cannot_be_sent_like_launch(stays_warm):
    """The same refusal as launch, naming the variable, and the ranks are not touched."""
    import threading

    ranks = stays_warm
    lock = threading.Lock()
    with pytest.raises(LaunchError, match=r"positional argument 0.*lock") as info:
        ranks.run(lambda rank, world_size, x: rank, lock)
    assert "inside the worker" in str(info.value) or "instead" in str(info.value), str(info.value)
    gen = (i for i in range(3))
    with pytest.raises(LaunchError, match="generator"):
        ranks.run(lambda rank, world_size: list(gen))


def test_result_that_cannot_come_back_gets_launchs_message(stays_warm):
    """A lock or a generator returned by a rank: launch's message ("cannot be pickled back"), not
    ipyparallel's bare TypeError; the ranks stay warm."""
    ranks = stays_warm
    with pytest.raises(WorkerError) as from_launch:
        launch(faults.unpicklable_result, 2)
    with pytest.raises(WorkerError) as from_ranks:
        ranks.run(faults.unpicklable_result)
    assert from_ranks.value.rank == 1 and from_ranks.value.message == from_launch.value.message, \
        (from_ranks.value.message, from_launch.value.message)
    with pytest.raises(WorkerError) as info:
        ranks.run(lambda rank, world_size: (i for i in range(rank)))
    assert info.value.message.startswith("rank 0 returned a generator that cannot be pickled back to the caller"), \
        info.value.message
    assert "return plain data" in info.value.message and "rank 1: the same TypeError" in str(info.value)


def test_init_process_group_on_warm_ranks_says_they_have_one(stays_warm):
    from helpers.engine import free_port

    def setup(rank, world_size, port):  # a tutorial's setup()
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)

    with pytest.raises(WorkerError, match="initialize the default process group twice") as info:
        stays_warm.run(setup, free_port())
    assert "warm ranks already have a default process group" in str(info.value), str(info.value)
    assert "destroy_process_group" in str(info.value)


def test_push_and_pull(ranks):
    import threading

    ranks.push({"lr": 0.5, "shift": torch.tensor([1.0, 2.0])})
    ranks.execute("y = lr * (rank + 1) + shift", stream=False)
    assert [t.tolist() for t in ranks.pull("y")] == [[1.5, 2.5], [2.0, 3.0]]
    with pytest.raises(LaunchError, match="keyword argument 'lock'.*a lock"):
        ranks.push({"lock": threading.Lock()})
    with pytest.raises(LaunchError, match="dict of variable names"):
        ranks.push(["lr", 0.5])
    with pytest.raises(WorkerError, match="NameError") as info:
        ranks.pull("never_defined_here")
    assert "no rank has a variable 'never_defined_here'" in str(info.value), str(info.value)
    assert "ranks.push({'never_defined_here': value})" in str(info.value), str(info.value)


def test_same_arguments_return_the_running_ranks(ranks):
    assert start_ranks(2, timeout=60, activate=False) is ranks and current_ranks() is ranks


@pytest.mark.matrix
def test_other_world_size_or_env_replaces_and_stop_is_idempotent(ranks, no_leftover_processes):
    """Runs last in this module (it replaces the module's ranks)."""
    old = list(ranks.pids)
    one = start_ranks(1, timeout=60, env={"DDP_LAB_RANKS_TEST": "yes"}, activate=False)
    assert ranks.stopped and not any(psutil.pid_exists(p) for p in old), "the old set must be stopped first"
    assert one.run(lambda rank, world_size: (rank, world_size, os.environ["DDP_LAB_RANKS_TEST"])) == [(0, 1, "yes")]
    # in the environment the engine process started with (/proc/<pid>/environ), i.e. set before torch was imported
    assert [psutil.Process(p).environ().get("DDP_LAB_RANKS_TEST") for p in one.pids] == ["yes"]
    # so a fresh interpreter of this process's, not a fork of the server (whose torch came before the variable)
    assert [psutil.Process(p).ppid() for p in one.pids] == [os.getpid()]
    one.stop()
    one.stop()
    ranks.stop()
    assert current_ranks() is None
    assert not marked_processes(MARK), "no ipcontroller/ipengine process may survive stop()"
    assert not leftover_processes()
