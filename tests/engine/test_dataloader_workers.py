"""Ranks behave like torchrun ranks for a DataLoader's workers: inside a ``launch``, ``helpers.mp``
and warm rank the multiprocessing start method is a fresh interpreter's default (Linux before
Python 3.14: fork), so a cell-defined Dataset with ``num_workers=2`` runs and every index is seen
once per epoch; under ``spawn`` the error names the class and says what to do.
Real processes, real gloo, real DataLoader workers."""

import subprocess
import sys

import pytest

from _support import as_cell, warm_ranks
from helpers import mp
from helpers.engine import WorkerError, launch
from helpers.engine.start_method import main_object_hint

# slow: real processes in (nearly) every test
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

N = 40  # indices in the dataset (a multiple of world_size: no padding by DistributedSampler)

# A notebook cell, as a learner writes it: the Dataset class lives in __main__, so it reaches the
# ranks by value (cloudpickle) and no process can import it by name.
CELL = '''\
import multiprocessing
import time

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Points(Dataset):
    def __init__(self, n):
        self.x = torch.arange(n, dtype=torch.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i]


def epochs(rank, world_size, n, context=None):
    """Two epochs of a DistributedSampler's share, with and without persistent workers."""
    ds = Points(n)
    report = {"start_method": (multiprocessing.get_start_method(allow_none=True),
                               multiprocessing.get_start_method())}
    for persistent in (False, True):
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=persistent,
                            multiprocessing_context=context)
        seen, first_epoch_s = [], None
        for epoch in range(2):
            sampler.set_epoch(epoch)
            t0 = time.perf_counter()
            seen.append([])
            for indices, xs in loader:
                assert torch.equal(xs, indices.float()), (indices, xs)
                seen[-1].extend(indices.tolist())
            if first_epoch_s is None:
                first_epoch_s = time.perf_counter() - t0
        report[f"persistent={persistent}"] = {"seen": seen, "first_epoch_s": first_epoch_s}
    return report
'''


def _fresh_start_method() -> tuple:
    """``(get_start_method(allow_none=True), get_start_method())`` in a fresh interpreter (a torchrun rank)."""
    code = "import multiprocessing as m; print(repr((m.get_start_method(allow_none=True), m.get_start_method())))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return eval(out.stdout)


def _check(reports: list, how: str) -> None:
    fresh = _fresh_start_method()
    for rank, report in enumerate(reports):
        assert report["start_method"] == fresh, f"{how} rank {rank}: {report['start_method']}; fresh: {fresh}"
    for persistent in (False, True):
        for epoch in range(2):
            union = sorted(i for report in reports for i in report[f"persistent={persistent}"]["seen"][epoch])
            assert union == list(range(N)), f"{how}, persistent_workers={persistent}, epoch {epoch}: {union}"
        key = f"persistent={persistent}"
        times = ", ".join(f"rank {r}: {rep[key]['first_epoch_s']:.2f} s" for r, rep in enumerate(reports))
        print(f"{how}, persistent_workers={persistent}: first epoch {times}")  # shown with -s; never asserted


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.matrix
@pytest.mark.parametrize("how", ["launch", "helpers.mp.spawn"])
def test_cell_defined_dataset_with_workers(how):
    epochs = as_cell(CELL)["epochs"]
    _check(launch(epochs, 2, N) if how == "launch" else mp.spawn(epochs, args=(2, N), nprocs=2), how)


def _in_memory_tensors(rank, world_size, n):
    """A plain list of ``n`` tensors (a map-style dataset): a forkserver worker would receive one fd each."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader([torch.tensor([float(i)]) for i in range(n)], batch_size=16, num_workers=2)
    return sorted(int(v) for batch in loader for v in batch.flatten())


@pytest.mark.usefixtures("no_leftover_processes")
def test_many_in_memory_tensors_no_fd_limit():
    """Under forkserver this was ``ValueError: too many fds`` (multiprocessing sends at most 256)."""
    assert launch(_in_memory_tensors, 2, 300) == [list(range(300))] * 2


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.matrix
def test_spawn_context_error_names_the_class_and_what_to_do():
    with pytest.raises(WorkerError) as info:
        launch(as_cell(CELL)["epochs"], 2, N, context="spawn")
    text = str(info.value)
    assert "Can't pickle <class '__main__.Points'>" in text, text
    assert "Hint: Points is defined in a notebook cell" in text, text
    assert "multiprocessing_context='fork'" in text and "move Points into a .py module" in text, text
    assert text.count("Hint:") == 1, f"the hint once, for the root-cause rank:\n{text}"


@pytest.mark.parametrize("message,name", [
    ("Can't pickle <class '__main__.Points'>: attribute lookup Points on __main__ failed", "Points"),
    ("Can't pickle <class '__main__.Points'>: it's not found as __main__.Points", "Points"),  # Python 3.14
    ("Can't pickle <function work at 0x7f3b7cfdf350>: attribute lookup work on __main__ failed", "work"),
    ("Can't get attribute 'Points' on <module '__main__' (built-in)>", "Points"),
    # no hint for other errors
    ("Can't pickle <class 'mymodule.Points'>: attribute lookup Points on mymodule failed", None),
    ("Can't pickle <function <lambda> at 0x7f3b>: it's not the same object as helpers.x", None),
    ("division by zero", None),
])
def test_hint_names_the_main_object(message, name):
    hint = main_object_hint(message)
    assert (hint is None) if name is None else f"Hint: {name} is defined in a notebook cell" in hint, hint


# ---- warm ranks: ipyparallel engines, fresh interpreters --------------------------------------

@pytest.fixture(scope="module")
def ranks():
    yield from warm_ranks(timeout=120)


@pytest.mark.matrix
def test_cell_defined_dataset_with_workers_in_warm_ranks(ranks):
    _check(ranks.run(as_cell(CELL)["epochs"], N), "warm ranks")


def test_warm_ranks_spawn_context_error_names_the_class(ranks):
    with pytest.raises(WorkerError) as info:
        ranks.run(as_cell(CELL)["epochs"], N, context="spawn")
    text = str(info.value)
    assert "Hint: Points is defined in a notebook cell" in text and text.count("Hint:") == 1, text
