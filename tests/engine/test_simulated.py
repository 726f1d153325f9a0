"""Simulated ranks (helpers.engine.simulate): values against one-process references and real gloo ranks,
the faults a learner meets, the process put back after each, the version guard.

The fault matrix rows for the same faults are in test_faults.py."""

import _thread
import re
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _support import REPO_ROOT
from helpers.engine import (
    LaunchError,
    LaunchInterrupted,
    LaunchTimeout,
    SimulationUnavailable,
    WorkerError,
    launch,
    simulate,
)
from helpers.engine import simulated as sim

pytestmark = [pytest.mark.timeout(240)]

LR = 0.1
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(4, 12, generator=g), torch.randint(0, 3, (4,), generator=g)


def ddp_worker(rank, world_size):
    """DDP on this rank's batch: the first step's gradients, and the weights after STEPS SGD steps."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    x, y = _batch(rank)
    first = None
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        first = first or [p.grad.clone() for p in model.parameters()]
        opt.step()
    return first, [p.detach().clone() for p in model.parameters()]


def _reference(world_size):
    """One process: each rank's local gradient, their mean, and STEPS steps on the whole batch."""
    model = _model()
    local = []
    for r in range(world_size):
        model.zero_grad()
        x, y = _batch(r)
        nn.functional.cross_entropy(model(x), y).backward()
        local.append([p.grad.clone() for p in model.parameters()])
    mean = [torch.stack(gs).mean(0) for gs in zip(*local)]
    xs, ys = zip(*(_batch(r) for r in range(world_size)))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return local, mean, [p.detach() for p in model.parameters()]


def _restored():
    """The process as before a simulation: no rank thread, the world and autograd multithreading back."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    names = [t.name for t in threading.enumerate() if t.name.startswith("simulated-rank-")]
    assert not names, f"rank threads left: {names}"
    assert torch._C._is_multithreading_enabled(), "autograd multithreading must be back on"
    assert not isinstance(dist.distributed_c10d._world, ThreadLocalWorld), "the threaded world must be uninstalled"
    assert not dist.is_initialized()
    assert getattr(sys.excepthook, "__name__", "") != "_distributed_excepthook", "tracebacks prefixed [rankN]"
    assert simulate(_sum_ranks, 3) == [3.0, 3.0, 3.0], "the next call must work"


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


# ---- values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 8, 64])
def test_ddp_gradient_is_the_mean_and_weights_match_one_process(world_size):
    results = simulate(ddp_worker, world_size)
    local, mean, weights = _reference(world_size)
    assert not all(torch.equal(a, b) for a, b in zip(local[0], local[1])), "the ranks' local gradients must differ"
    for rank, (grads, final) in enumerate(results):
        for g, m in zip(grads, mean):
            torch.testing.assert_close(g, m, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: gradient is not the mean")
        for w, ref in zip(final, weights):
            torch.testing.assert_close(w, ref, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: weights differ")
    _restored()


def seeded_worker(rank, world_size):
    torch.manual_seed(rank)
    a = torch.randn(3)
    dist.barrier()  # the other ranks draw in between on a simulation: their draws must not move ours
    return torch.cat([a, torch.rand(2), ddp_worker(rank, world_size)[0][0].flatten()[:4]])


@pytest.mark.slow
def test_same_worker_on_real_gloo_ranks_gives_the_same_values():
    simulated = simulate(seeded_worker, 2)
    real = launch(seeded_worker, 2, timeout=120)
    for rank in range(2):
        torch.testing.assert_close(simulated[rank], real[rank], rtol=1e-6, atol=1e-7)


def unseeded_worker(rank, world_size):
    return torch.randn(4)


def test_each_rank_starts_with_its_own_random_state_and_the_callers_is_kept():
    torch.manual_seed(7)
    expected = torch.randn(2)
    torch.manual_seed(7)
    draws = simulate(unseeded_worker, 4)
    assert torch.equal(torch.randn(2), expected), "simulate must leave the caller's generator as it was"
    assert len({tuple(d.tolist()) for d in draws}) == 4, "unseeded ranks draw different numbers, as fresh processes do"


def fsdp_worker(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    return model[0].weight.to_local().detach().clone()


def test_fsdp2_rank_r_holds_chunk_r():
    shards = simulate(fsdp_worker, 8)
    full = _model()[0].weight.detach()
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, full.chunk(8)[rank]), f"rank {rank}'s shard is not chunk {rank}"


# ---- output -----------------------------------------------------------------------------------

def printer(rank, world_size):
    print(f"hello from rank {rank}")
    print(f"a warning-ish line {rank}", file=sys.stderr)
    return rank


def test_output_prefixed_and_summarised_at_64_ranks(capsys):
    simulate(printer, 4)
    out, err = capsys.readouterr()
    assert all(f"[rank {r}] hello from rank {r}\n" in out for r in range(4)), out
    assert "[rank 3] a warning-ish line 3" in err
    simulate(printer, 64)
    out, err = capsys.readouterr()
    assert "[rank 0] hello from rank 0" in out and "[rank 5]" not in out + err
    assert "[ranks 1-63] 126 more lines not shown" in out, out
    simulate(printer, 64, output="all")
    assert "[rank 63] hello from rank 63" in capsys.readouterr().out


# ---- faults: each ends with the right error, then the process is as before ------------------

def raiser(rank, world_size):
    if rank == 5:
        raise ValueError("bad batch on rank 5")
    _sum_ranks(rank, world_size)
    return rank


def skipper(rank, world_size):
    if rank == 0:
        return rank
    return _sum_ranks(rank, world_size)


def sleeper(rank, world_size, seconds=4.0):
    if rank == 1:
        time.sleep(seconds)
    return _sum_ranks(rank, world_size)


@pytest.mark.parametrize("fn,world_size,timeout,expected,words,check", [
    pytest.param(raiser, 64, 60, WorkerError, ("in raiser", "raise ValueError"),
                 lambda e, s: e.rank == 5 and e.exc_type == "ValueError" and "bad batch on rank 5" in e.message
                 and s < 2.0, id="raises"),  # the error ends the run within about 2 s
    pytest.param(skipper, 4, 1, LaunchTimeout, ("Ranks 1, 2, 3 were waiting in torch.distributed.all_reduce",
                                                "in _sum_ranks", "dist.all_reduce(t)"),
                 lambda e, s: e.ranks_not_finished == [1, 2, 3] and e.what == "simulate", id="skips-a-collective"),
    pytest.param(sleeper, 4, 1, LaunchTimeout, ("Rank 1 was still running your function's own work",
                                                "Rank 0 was waiting in torch.distributed.all_reduce, most likely for "
                                                "rank 1", "time.sleep(seconds)"), None, id="sleeps-past-the-timeout"),
    pytest.param(skipper, 4, None, LaunchInterrupted, ("simulate interrupted",),  # Ctrl-C after 1 s
                 lambda e, s: isinstance(e, KeyboardInterrupt) and sorted(e.stacks) == [1, 2, 3] and s < 10,
                 id="interrupted"),
])
def test_a_fault_ends_the_run(fn, world_size, timeout, expected, words, check):
    """The fault's error, naming the rank and where, in the worker's own code; then the process is as before."""
    timer = threading.Timer(1.0, _thread.interrupt_main)
    start = time.monotonic()
    with pytest.raises(expected) as info:
        if expected is LaunchInterrupted:
            timer.start()
        simulate(fn, world_size, timeout=timeout)
    timer.cancel()
    text = str(info.value)
    assert all(word in text for word in words) and (check is None or check(info.value, time.monotonic() - start)), text
    _restored()


def barrier_on_rank_0(rank, world_size):
    t = torch.ones(1)
    dist.barrier() if rank == 0 else dist.all_reduce(t)  # real ranks: a hang, or values from a mix
    return t.item()


def shapes_differ(rank, world_size):
    dist.all_reduce(torch.ones(2 + (rank == 1)))


def test_ranks_in_different_collectives_fail_at_once_naming_both():
    """Real gloo ranks hang here (launch's timeout names the different calls); the threaded group
    would pair a barrier with an all-reduce and return values. simulate stops it at the call."""
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        simulate(barrier_on_rank_0, 4, timeout=30)
    assert time.monotonic() - start < 5.0
    err = info.value
    assert err.exc_type == "CollectiveMismatch" and err.rank in (1, 2, 3), err
    assert "rank 0 called barrier" in err.message and "called allreduce of shape [1]" in err.message, err.message
    with pytest.raises(WorkerError) as info:
        simulate(shapes_differ, 2, timeout=30)
    assert "rank 0 called allreduce of shape [2], rank 1 called allreduce of shape [3]" in info.value.message
    _restored()
    assert simulate(_sum_ranks, 8) == [28.0] * 8, "matching collectives still run"


SEEN = []


def shared_state(rank, world_size):
    import os

    SEEN.append(rank)
    dist.barrier()
    return len(SEEN), os.environ.get("RANK")


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no __del__ noise after a refusal
def test_documented_differences_from_real_ranks():
    """docs/OWN_CODE.md: simulated ranks share the process's globals and its environment (no RANK);
    under launch each rank has its own."""
    SEEN.clear()
    assert simulate(shared_state, 4) == [(4, None)] * 4 and sorted(SEEN) == [0, 1, 2, 3]
    SEEN.clear()
    assert launch(shared_state, 2) == [(1, "0"), (1, "1")] and SEEN == []
    with pytest.raises(WorkerError, match=r"DataLoader\(num_workers=2\) in a simulated rank"):
        simulate(read_with_workers, 2)
    _restored()
    assert launch(read_with_workers, 2) == [10, 10]


def read_with_workers(rank, world_size):
    return sum(len(batch) for batch in torch.utils.data.DataLoader(range(10), batch_size=5, num_workers=2))


# ---- input and the version guard --------------------------------------------------------------

def test_bad_input_refused_before_any_thread():
    before = threading.active_count()
    for bad in (0, -1, 2.0, True, sim.MAX_SIMULATED_RANKS + 1):
        with pytest.raises(LaunchError):
            simulate(_sum_ranks, bad)
    with pytest.raises(LaunchError):
        simulate(_sum_ranks, 2, output="some")
    assert threading.active_count() == before


def test_version_guard_names_versions_and_launch(monkeypatch):
    import torch.testing._internal.distributed as package

    monkeypatch.delattr(package, "multi_threaded_pg", raising=False)
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.multi_threaded_pg", None)
    sim._pieces.cache_clear()
    before = threading.active_count()
    try:
        with pytest.raises(SimulationUnavailable) as info:
            simulate(_sum_ranks, 2)
    finally:
        monkeypatch.undo()
        sim._pieces.cache_clear()
    text = str(info.value)
    assert "multi_threaded_pg" in text and torch.__version__ in text, text
    assert "checked on torch 2.14" in text and "helpers.engine.launch(fn, world_size)" in text, text
    assert threading.active_count() == before, "no thread may start"
    _restored()


def test_doctor_line(monkeypatch):
    from helpers.doctor.checks import check_simulate
    from helpers.doctor.common import Failed

    class Doc:  # the doctor's one method a check calls
        def inner_timeout(self, name):
            return 60.0

    assert "all_reduce 2080 on each" in check_simulate(Doc())
    import torch.testing._internal.distributed as package

    monkeypatch.delattr(package, "multi_threaded_pg", raising=False)
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.multi_threaded_pg", None)
    sim._pieces.cache_clear()
    try:
        with pytest.raises(Failed) as info:
            check_simulate(Doc())
    finally:
        monkeypatch.undo()
        sim._pieces.cache_clear()
    assert "multi_threaded_pg" in str(info.value) and "lesson 09" in info.value.fix, (str(info.value), info.value.fix)


def test_the_largest_simulated_world_is_stated_once():
    """MAX_SIMULATED_RANKS is the one limit: the engine's surface, docs/ARCHITECTURE.md and lesson 09's check say it."""
    limit = sim.MAX_SIMULATED_RANKS
    texts = {"helpers/engine/__init__.py": f"up to {limit:,} ranks, ``MAX_SIMULATED_RANKS``",
             "docs/ARCHITECTURE.md": f"for up to {limit:,} ranks (`MAX_SIMULATED_RANKS`)",
             "docs/OWN_CODE.md": f"Up to `MAX_SIMULATED_RANKS` ({limit:,}) ranks.",
             "notebooks/09_cluster_on_a_laptop.py": f'world_size <= {limit}, "16 to {limit:,} (a cluster-sized world; '}
    for path, said in texts.items():
        text = (REPO_ROOT / path).read_text()
        assert said in text, f"{path} must state the limit as {said!r}"
        ranges = re.findall(r"\b\d[\d,]* to \d[\d,]* (?:simulated )?ranks\b", text)
        assert not ranges, f"{path} states another range of simulated ranks: {ranges}"
    with pytest.raises(LaunchError, match=f"from 1 to {limit}"):
        simulate(_sum_ranks, limit + 1)


def _inits_again(rank, world_size):
    dist.init_process_group("gloo")


def _reads_rank(rank, world_size):
    import os

    return int(os.environ["RANK"])


@pytest.mark.parametrize("fn,said", [
    (_inits_again, "simulate has already initialised each rank's default process group"),
    (_reads_rank, "simulated ranks are threads of one process, sharing one os.environ")])
def test_hints_are_worded_for_simulate(fn, said, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(WorkerError) as info:
        simulate(fn, 2, timeout=60)
    text = str(info.value)
    assert "What to do:" in text and said in text, text
    assert "launch and warm ranks" not in text and "helpers.mp.spawn, like" not in text, text
