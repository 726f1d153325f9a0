"""Hang diagnosis (issue 30, part 3): a launch that times out or is interrupted says where each
unfinished rank was stuck, in the learner's code (helpers/engine/stacks.py), with real ranks on a
real gloo group: rank 0 in ``dist.all_reduce``, rank 1 in ``dist.barrier`` (a mismatched pair of
collectives that never completes)."""

import _thread
import contextlib
import datetime
import os
import re
import signal
import sys
import threading
import time
import uuid

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import helpers.mp as hmp
import launch_workers as w
from _support import Kernel, busy_cpus, wait_until_gone
from helpers.engine import (
    LaunchInterrupted,
    LaunchTimeout,
    RanksTimeout,
    WorkerError,
    faults,
    free_port,
    launch,
    launcher,
    start_ranks,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]

HERE = os.path.abspath(__file__)


def mismatched(rank, world_size, flag_dir=None):
    """Rank 0 all-reduces while rank 1 waits in a barrier: both wait forever (a group timeout of
    10 minutes, far beyond the launch's)."""
    group = dist.new_group(timeout=datetime.timedelta(minutes=10))
    t = torch.ones(1)
    if flag_dir:
        open(os.path.join(flag_dir, f"in.{rank}"), "w").close()
    if rank == 0:
        dist.all_reduce(t, group=group)  # rank 0 is stuck here
    else:
        dist.barrier(group=group)  # rank 1 is stuck here
    return t.item()


def _line_of(text: str) -> int:
    with open(HERE) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


ALL_REDUCE_LINE = _line_of("# rank 0 is stuck here")
BARRIER_LINE = _line_of("# rank 1 is stuck here")


def _assert_names_both_lines(err):
    text = str(err)
    assert set(err.stacks) == {0, 1}, f"a stack dump per unfinished rank: {sorted(err.stacks)}\n{text}"
    rank0, rank1 = text.split("  rank 0")[1].split("  rank 1")
    assert "in torch.distributed.all_reduce" in rank0 and f'line {ALL_REDUCE_LINE}, in mismatched' in rank0, text
    assert "dist.all_reduce(t, group=group)" in rank0, text
    assert "in torch.distributed.barrier" in rank1 and f'line {BARRIER_LINE}, in mismatched' in rank1, text
    assert "dist.barrier(group=group)" in rank1, text
    assert "rank_main.py" not in text and "distributed_c10d.py" not in text, f"library frames hidden:\n{text}"
    assert "distributed_c10d.py" in err.stacks[0], "the full dump stays on the exception"
    assert len(text.splitlines()) <= 12, f"a few lines per rank (at most 2 frames each):\n{text}"


def test_timeout_names_each_ranks_line():
    with pytest.raises(LaunchTimeout) as info:
        launch(mismatched, 2, timeout=15)
    err = info.value
    assert err.ranks_not_finished == [0, 1], err.ranks_not_finished
    _assert_names_both_lines(err)
    # two different collectives read as such in the message's first lines, each rank with its own
    assert ("Ranks 0, 1 were waiting in different calls (rank 0 in torch.distributed.all_reduce, rank 1 in "
            "torch.distributed.barrier)") in str(err), str(err)
    assert "with tensors of the same shape and dtype" in str(err), str(err)


# ---- issue 40: the clock, the default, and a loaded machine ---------------------------------------

def test_timeout_names_each_ranks_line_under_load():
    """At load average ~10 each unfinished rank's stack still comes (it once came from none), and the
    timeout counts from when every rank runs ``fn``, so a slow start-up does not eat it."""
    with busy_cpus(), pytest.raises(LaunchTimeout) as info:
        launch(mismatched, 2, timeout=5)
    err = info.value
    assert err.ranks_not_finished == [0, 1], err.ranks_not_finished
    assert "counted from when every rank was running your function (start-up took" in str(err), err
    _assert_names_both_lines(err)
    assert "A rank that skips a collective" in str(err), "every rank waits in a collective: the mismatch advice"


def test_timeout_in_ddp_is_not_called_own_work():
    """A rank that waits in DDP's all-reduce (C++, no Python frame of torch.distributed: lesson 06a's
    uneven inputs) is not reported as busy in its own code: the message says it may be waiting there."""
    with pytest.raises(LaunchTimeout) as info:
        launch(w.uneven_ddp, 2, timeout=5)
    err, text = info.value, str(info.value)
    assert err.ranks_not_finished == [1], text
    # the second step's forward (DDP's bucket rebuild) or backward: DDP's all-reduce, in C++
    assert re.search(r"Rank 1 was in torch\.\S+ \(computing, or waiting in DDP's all-reduce", text), text
    assert "own work" not in text, text


def check_on_rank_0_only(rank, world_size):
    from helpers.replicas import assert_in_sync

    if rank == 0:  # a collective that rank 1 never calls
        assert_in_sync(torch.nn.Linear(2, 2))


def test_timeout_in_a_library_collective_is_not_called_own_work():
    """A rank waiting in a collective inside a library call (assert_in_sync on one rank only, the
    mistake docs/OWN_CODE.md warns of) is waiting in a collective, not busy in its own work."""
    with pytest.raises(LaunchTimeout) as info:
        launch(check_on_rank_0_only, 2, timeout=5)
    text = str(info.value)
    assert "Rank 0 was waiting in replicas.assert_in_sync" in text and "own work" not in text, text
    assert "A rank that skips a collective" in text, text


def test_timeout_in_startup_says_start_up_took_the_time(monkeypatch):
    """Start-up past its allowance (``max(timeout, STARTUP_S)``, here 3 s): the message says start-up
    took the time, with the seconds, and which ranks had not reached ``fn``."""
    monkeypatch.setattr(launcher, "STARTUP_S", 1.0, raising=False)
    with pytest.raises(LaunchTimeout) as info:
        launch(w.slow_rank, 2, 0, faults.SlowStart(600.0, value=0.0), timeout=3)
    err, text = info.value, str(info.value)
    # rank 0 waits in the process group's rendezvous for rank 1, which is still unpickling
    assert err.in_startup == [0, 1], (err.in_startup, text)
    took = re.search(r"launch timed out in start-up: start-up took (\d+\.\d) s", text)
    assert took and float(took[1]) >= 3, text
    assert "ranks 0, 1 had not yet started your function" in text, text


def test_default_timeout_says_it_is_the_default_and_how_to_lift_it(monkeypatch):
    """launch keeps a default timeout (300 s); past it, the message says so and how to lift it. The
    default is shortened here to 3 s (the same kind of value, so launch still knows it is the default)."""
    default = launch.__kwdefaults__["timeout"]
    monkeypatch.setitem(launch.__kwdefaults__, "timeout", type(default)(3.0))
    with pytest.raises(LaunchTimeout) as info:
        launch(w.slow_rank, 2)
    assert "launch's default timeout=3 s; pass timeout=None for no limit" in str(info.value), info.value
    assert info.value.default
    monkeypatch.undo()
    assert launch.__kwdefaults__["timeout"] == 300.0
    with pytest.raises(LaunchTimeout) as info:
        launch(w.slow_rank, 2, timeout=3.0)
    assert "default" not in str(info.value) and "timeout=None for no limit" in str(info.value), info.value


def test_spawn_timeout_names_each_ranks_line():
    """helpers.mp.spawn runs on the same launcher: the same diagnosis, for code that sets up its own group."""
    with pytest.raises(LaunchTimeout) as info:
        hmp.spawn(_own_group, args=(2, free_port()), nprocs=2, timeout=15)
    _assert_names_both_lines(info.value)
    assert "in _own_group" in str(info.value), "the caller's frame too"


def _own_group(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return mismatched(rank, world_size)


@contextlib.contextmanager
def _interrupt_once_both_wait(folder):
    """Ctrl-C ("interrupt kernel"): KeyboardInterrupt in this thread 1 s after both ranks wrote
    ``folder/in.<rank>`` (into their collective); Python's own SIGINT handler meanwhile, as a kernel has."""
    def interrupt_when_both_wait():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all((folder / f"in.{r}").exists() for r in range(2)):
                time.sleep(1.0)  # into the collective
                return _thread.interrupt_main()
            time.sleep(0.05)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=interrupt_when_both_wait, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        watcher.join(130)
        signal.signal(signal.SIGINT, previous)


def test_interrupt_names_each_ranks_line(tmp_path):
    with _interrupt_once_both_wait(tmp_path), pytest.raises(LaunchInterrupted) as info:
        launch(mismatched, 2, flag_dir=str(tmp_path), timeout=200)
    assert "workers were ended" in str(info.value)
    _assert_names_both_lines(info.value)


def test_debug_detail_names_the_mismatch(monkeypatch):
    """With TORCH_DISTRIBUTED_DEBUG=DETAIL torch compares the collectives first: no hang, a
    WorkerError at once naming both collectives, with what to do."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with pytest.raises(WorkerError) as info:
        launch(mismatched, 2, timeout=120)
    text = str(info.value)
    assert "Detected mismatch between collectives" in text and "ALLREDUCE" in text and "BARRIER" in text, text
    assert "What to do: TORCH_DISTRIBUTED_DEBUG=DETAIL found the ranks in different collectives" in text, text


# ---- warm ranks: ranks.run and a %%px cell (ranks.execute) -------------------------------------

def warm_mismatched(rank, world_size, flag_dir=None):
    """On warm ranks (their default group): rank 0 all-reduces, rank 1 waits in a barrier."""
    t = torch.ones(1)
    if flag_dir:
        open(os.path.join(flag_dir, f"in.{rank}"), "w").close()
    if rank == 0:
        dist.all_reduce(t)  # warm rank 0 is stuck here
    else:
        dist.barrier()  # warm rank 1 is stuck here
    return t.item()


PX_MISMATCHED = "t = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.barrier()\n"


def _assert_warm_stuck(err, rank0: str, rank1: str, cell: bool = False):
    """``err`` names rank 0 in all_reduce at ``rank0`` and rank 1 in barrier at ``rank1`` (location
    and source text), a few lines, with the full dumps in ``err.stacks``."""
    text = str(err)
    assert set(err.stacks) == {0, 1}, f"a stack dump per unfinished rank: {sorted(err.stacks)}\n{text}"
    where0, where1 = text.split("  rank 0")[1].split("  rank 1")
    assert "in torch.distributed.all_reduce" in where0 and rank0 in where0, text
    assert "in torch.distributed.barrier" in where1 and rank1 in where1, text
    assert "ipykernel" not in text and "distributed_c10d.py" not in text, f"library frames hidden:\n{text}"
    assert "distributed_c10d.py" in err.stacks[0], "the full dump stays on the exception"
    assert len(text.splitlines()) <= 12, f"a few lines per rank:\n{text}"


@pytest.fixture
def ranks():
    """2 warm ranks; this module and launch_workers go to them by value (not importable there), as a cell's."""
    modules = [sys.modules[warm_mismatched.__module__], w]
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    r = start_ranks(2, timeout=60, activate=False)
    yield r
    r.stop()
    for module in modules:
        cloudpickle.unregister_pickle_by_value(module)


def _warm_run(ranks, expected, **kwargs):
    """``ranks.run(warm_mismatched, **kwargs)`` raises ``expected`` naming each rank's line; returns it."""
    with pytest.raises(expected) as info:
        ranks.run(warm_mismatched, **kwargs)
    line0, line1 = _line_of("# warm rank 0 is stuck here"), _line_of("# warm rank 1 is stuck here")
    _assert_warm_stuck(info.value, f"line {line0}, in warm_mismatched\n      dist.all_reduce(t)",
                       f"line {line1}, in warm_mismatched\n      dist.barrier()")
    return info.value


def test_warm_run_timeout_names_each_ranks_line(ranks):
    _warm_run(ranks, RanksTimeout, timeout=15)


def test_warm_run_timeout_tells_the_sleeping_rank_from_the_waiting_one(ranks):
    """Warm ranks' RanksTimeout gives the same advice as LaunchTimeout: rank 0 still in its own code,
    rank 1 waiting in all_reduce for it, and no blame on skipped collectives."""
    with pytest.raises(RanksTimeout) as info:
        ranks.run(w.slow_rank, timeout=10)
    text = str(info.value)
    assert set(info.value.stacks) == {0, 1}, f"a stack dump per unfinished rank: {sorted(info.value.stacks)}\n{text}"
    assert "Rank 0 was still running your function's own work (sleeping or computing)" in text, text
    assert "Rank 1 was waiting in torch.distributed.all_reduce, most likely for rank 0" in text, text
    assert "skips a collective" not in text, text


def test_warm_run_interrupt_names_each_ranks_line(ranks, tmp_path):
    """Ctrl-C ("interrupt kernel") once both warm ranks are in their collective: SIGINT does not stop
    them there, so they are ended, and the error says where each was."""
    with _interrupt_once_both_wait(tmp_path):
        err = _warm_run(ranks, LaunchInterrupted, flag_dir=str(tmp_path), timeout=200)
    assert "did not stop on SIGINT" in str(err), err


def test_warm_px_timeout_names_each_ranks_cell_line(ranks):
    """A %%px cell's frames on the ranks carry ipykernel's file name for the cell's code
    (/tmp/ipykernel_<pid>/<hash>.py, no such file): the report gives the cell's line and its text."""
    with pytest.raises(RanksTimeout) as info:
        ranks.execute(PX_MISMATCHED, timeout=15, stream=False)
    _assert_warm_stuck(info.value, "%%px code, line 3, in <module>\n      dist.all_reduce(t)",
                       "%%px code, line 5, in <module>\n      dist.barrier()")


@pytest.mark.matrix
def test_px_cell_in_a_kernel_names_each_ranks_cell_and_line():
    """In a real kernel: a function defined in one %%px cell (In[2]) and called from the next (In[3])
    hangs; the RanksTimeout shows each rank's line in both cells, by the kernel's cell numbers. In the
    matrix: IPython 8 on Python 3.10 and 9 from 3.11 (requirements.lock), which count cells differently."""
    mark = uuid.uuid4().hex
    k = Kernel(mark)
    try:
        reply, text = k.cell("from helpers.engine import start_ranks\nranks = start_ranks(2, timeout=60)")
        assert reply["status"] == "ok", text
        reply, text = k.cell("%%px\ndef work():\n" + "".join(f"    {line}\n" for line in PX_MISMATCHED.splitlines()))
        assert reply["status"] == "ok", text
        reply, text = k.cell("%%px --timeout 15\nx = 1\nwork()")
    finally:
        k.close()
        assert not wait_until_gone(mark)
    assert reply["status"] == "error" and reply["ename"] == "RanksTimeout", text
    where0, where1 = text.split("  rank 0")[1].split("  rank 1")
    # line numbers as the notebook shows them: the %%px line is line 1
    for where, line, source in ((where0, 5, "dist.all_reduce(t)"), (where1, 7, "dist.barrier()")):
        assert "Cell In[3], line 3, in <module>\n      work()" in where, text
        assert f"Cell In[2], line {line}, in work\n      {source}" in where, text
    assert "in torch.distributed.all_reduce" in where0 and "in torch.distributed.barrier" in where1, text
    assert "sys.last_value.stacks" in text, text


def test_a_collective_in_another_thread_is_not_the_ranks_wait():
    """state() reads the thread that runs the learner's code: a background thread in a collective does not
    turn the main thread's library call into a collective wait."""
    from helpers.engine.stacks import state

    lib = "/venv/lib/python3.11/site-packages"
    dump = (f'Thread 0x01 (most recent call first):\n  File "{lib}/torch/distributed/distributed_c10d.py", line 1 in '
            f'all_reduce\n  File "/work/mine.py", line 3 in background\nCurrent thread 0x02 (most recent call first):\n'
            f'  File "{lib}/numpy/linalg/_linalg.py", line 5 in inv\n  File "/work/mine.py", line 9 in worker\n'
            f'  File "/x/helpers/engine/rank_main.py", line 2 in worker_entry\n')
    assert state(dump) == ("library", "numpy.linalg._linalg.inv"), state(dump)
