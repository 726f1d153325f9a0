"""Input pipeline: the seed recipe (torchvision ``ToTensor`` + ``Normalize`` per item, a
``DataLoader``) against the project's in-memory tensors, same model, same sampler order (notebook 05a).

Units: seconds (s), samples per second (samples/s).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset

from helpers.bench.common import build_bench_model, ddp_wrap, sync_device
from helpers.data import load_mnist, mnist_datasets
from helpers.engine import launch, worker_device


@torch.no_grad()
def _accuracy(model: nn.Module, batches: Iterable, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        correct += int((model(x).argmax(1) == y).sum())
        total += int(y.numel())
    model.train()
    return correct / max(total, 1)


def _pipeline_epoch(pipeline: str, wrapper: str, rank: int, world_size: int, n_train: int | None,
                    n_test: int | None, batch_size: int, lr: float, seed: int,
                    device: torch.device, evaluate: bool = True) -> dict[str, Any]:
    t_setup = time.perf_counter()
    if pipeline == "seed":
        # The seed recipe: a PIL image -> ToTensor -> Normalize for every item, collated by the
        # DataLoader (num_workers=0), the rank's share chosen by DistributedSampler.
        train_ds, test_ds = mnist_datasets()
        if n_train:
            train_ds = Subset(train_ds, range(n_train))
        if n_test:
            test_ds = Subset(test_ds, range(n_test))
        sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(0)
        batches = DataLoader(train_ds, batch_size=batch_size, sampler=sampler)
        test_batches = lambda: DataLoader(test_ds, batch_size=1000)  # noqa: E731
    else:
        # The project's path: the whole split as one float32 tensor, normalised once; each batch
        # is one index_select with the same sampler's indices (same order as the seed).
        # (index_select: the same rows as x[idx], with less per-call overhead than advanced indexing.)
        xtr, ytr = load_mnist(train=True)
        xte, yte = load_mnist(train=False)
        if n_train:
            xtr, ytr = xtr[:n_train], ytr[:n_train]
        if n_test:
            xte, yte = xte[:n_test], yte[:n_test]
        xtr, ytr = xtr.to(device), ytr.to(device)
        sampler = DistributedSampler(range(xtr.shape[0]), num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=seed)
        sampler.set_epoch(0)
        order = torch.tensor(list(sampler), dtype=torch.int64, device=device)
        batches = ((xtr.index_select(0, i), ytr.index_select(0, i)) for i in order.split(batch_size))
        test_batches = lambda: zip(xte.split(1000), yte.split(1000))  # noqa: E731
    model = build_bench_model("linear", seed).to(device)
    wrapped = ddp_wrap(model, device) if wrapper == "ddp" else model  # "none": one rank, the plain module
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr)
    setup_s = time.perf_counter() - t_setup

    samples = steps = 0
    loss = torch.zeros(())
    dist.barrier()
    sync_device(device)
    t0 = time.perf_counter()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        samples += int(y.shape[0])
        steps += 1
    sync_device(device)
    seconds = time.perf_counter() - t0
    accuracy = _accuracy(model, test_batches(), device) if rank == 0 and evaluate else None
    return {
        "pipeline": pipeline, "wrapper": wrapper, "rank": rank, "world_size": world_size,
        "threads_per_rank": torch.get_num_threads(), "device": str(device),
        "batch_size": batch_size, "steps": steps, "samples": samples, "seconds": seconds,
        "samples_per_s": samples / seconds, "setup_seconds": setup_s,
        "final_loss": float(loss.detach()), "test_accuracy": accuracy,
    }


def pipeline_worker(rank: int, world_size: int, n_train: int | None = None, n_test: int | None = None,
                    batch_size: int = 64, lr: float = 0.01, seed: int = 0, threads: int | None = 1,
                    repeats: int = 1, warmup_samples: int = 1024) -> list[dict[str, Any]]:
    """One rank of the input-pipeline benchmark; run it with ``launch(pipeline_worker, ws, ...)``.

    For each repeat, wrapper and pipeline (``"seed"``: torchvision dataset with ``ToTensor`` +
    ``Normalize`` per item through ``DataLoader(batch_size)`` and ``DistributedSampler``;
    ``"memory"``: :func:`helpers.data.load_mnist` tensors indexed with the same sampler's
    indices), train a fresh ``Linear(784, 10)`` (seeded, so both start from the same weights)
    with SGD for one epoch and time the epoch loop (data loading included: that is the point).
    Rank 0 then measures test accuracy. Before any timing, every (wrapper, pipeline) is warmed up
    with an untimed pass over its first ``warmup_samples`` images (0: no warm-up), and the timed
    epochs alternate between the modes, repeat after repeat (seed, memory, seed, memory, ...).

    With one rank the wrappers are the plain module and DDP with ``world_size`` 1 (a round trip
    through the backend per step, nothing to all-reduce); with more, DDP. ``n_train``,
    ``n_test``: the first ``n`` images only (``None`` or 0: all); ``batch_size`` per rank.

    Returns:
        one row per (repeat, wrapper, pipeline): ``pipeline``, ``wrapper``, ``repeat``, ``rank``,
        ``world_size``, ``threads_per_rank``, ``steps``, ``samples``, ``seconds`` (epoch loop),
        ``samples_per_s`` (this rank's), ``setup_seconds``, ``final_loss``, ``test_accuracy``
        (rank 0; else ``None``), ``timed_position`` (the order of the timed epochs).
    """
    if threads:
        torch.set_num_threads(int(threads))
    device = worker_device()
    wrappers, pipelines = ("none", "ddp") if world_size == 1 else ("ddp",), ("seed", "memory")
    if warmup_samples:
        n_warm = min(warmup_samples, n_train) if n_train else warmup_samples
        for w in wrappers:
            for p in pipelines:
                _pipeline_epoch(p, w, rank, world_size, n_warm, n_test or None, batch_size, lr, seed,
                                device, evaluate=False)
    rows = []
    for rep in range(repeats):
        for w in wrappers:
            for p in pipelines:
                row = _pipeline_epoch(p, w, rank, world_size, n_train or None, n_test or None, batch_size,
                                      lr, seed, device)
                row["repeat"] = rep
                row["timed_position"] = len(rows)  # the order of the timed epochs in this rank
                rows.append(row)
    return rows


def bench_pipeline(world_sizes: Sequence[int] = (1, 2), n_train: int | None = None, n_test: int | None = None,
                   threads: int | None = 1, repeats: int = 1, seed: int = 0,
                   timeout: float = 900.0) -> list[dict[str, Any]]:
    """The seed recipe against the in-memory path, per world size (one launch per world size).

    Both pipelines run in the same worker processes, one after the other, so they share the
    machine's state; the ratio is measured side by side, never compared across runs. With one
    rank both run twice: on the plain module and wrapped in DDP (``world_size`` 1); with more
    ranks, in DDP.

    Returns:
        one row per (world size, repeat, wrapper, pipeline): ``pipeline``, ``wrapper``
        (``"none"`` or ``"ddp"``), ``world_size``, ``repeat``, ``threads_per_rank``, ``samples``
        (all ranks), ``seconds`` (the slowest rank's epoch), ``samples_per_s``, ``test_accuracy``,
        ``speedup_vs_seed`` (over the seed's samples/s, same world size, repeat and wrapper),
        ``launch_seconds``, ``timed_position``.

    Raises:
        helpers.engine.WorkerError / LaunchTimeout: as :func:`helpers.engine.launch`.
    """
    out = []
    for ws in world_sizes:
        t0 = time.perf_counter()
        per_rank = launch(pipeline_worker, ws, n_train, n_test, seed=seed, threads=threads, repeats=repeats,
                          timeout=timeout)
        launch_s = time.perf_counter() - t0
        rows = {}
        for i, r0 in enumerate(per_rank[0]):
            ranks = [pr[i] for pr in per_rank]
            samples = sum(r["samples"] for r in ranks)
            seconds = max(r["seconds"] for r in ranks)
            rows[(r0["repeat"], r0["wrapper"], r0["pipeline"])] = {
                "pipeline": r0["pipeline"], "wrapper": r0["wrapper"], "world_size": ws, "repeat": r0["repeat"],
                "threads_per_rank": r0["threads_per_rank"], "device": r0["device"],
                "batch_size_per_rank": r0["batch_size"], "steps_per_rank": r0["steps"],
                "samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
                "setup_seconds": max(r["setup_seconds"] for r in ranks),
                "test_accuracy": r0["test_accuracy"], "final_loss_rank0": r0["final_loss"],
                "launch_seconds": launch_s, "timed_position": r0["timed_position"],
            }
        for (rep, w, _), row in rows.items():
            row["speedup_vs_seed"] = row["samples_per_s"] / rows[(rep, w, "seed")]["samples_per_s"]
            out.append(row)
    return out

