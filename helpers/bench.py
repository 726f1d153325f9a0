"""Benchmarks: where the time goes when DDP trains MNIST (notebook 05, and a command line).

Run every benchmark from the repository root; each prints a table and writes JSON::

    python -m helpers.bench                       # all benchmarks, full profile, to build/bench/
    python -m helpers.bench --profile smoke       # small and quick (notebook 05's CI sizes; no memory/launch runs)
    python -m helpers.bench pipeline allreduce    # only some: pipeline scaling allreduce launch memory buckets
    python -m helpers.bench --out /tmp/bench      # another output folder

The benchmarks (each has a ``bench_*`` function returning rows, plain dicts, for pandas):

``pipeline``  The seed recipe's input pipeline (torchvision ``ToTensor`` + ``Normalize`` on every
              item, ``DataLoader(batch_size=64)``, ``DistributedSampler``) against the project's
              in-memory tensors (:func:`helpers.data.load_mnist`), same ``Linear(784, 10)``, same
              SGD (lr 0.01), same wrapper (DDP; with one rank also the plain module), same
              sampler order, one epoch, side by side in the same worker processes: samples/s
              and test accuracy.
``scaling``   Training samples/s for DDP at several world sizes and threads per rank, for the
              Linear model and a small CNN, at several global batch sizes; each configuration
              is split into where its time goes: one rank's share alone, all ranks at once under
              ``ddp.no_sync()`` (no gradient all-reduce), and the real step. Plus a single
              process and ``nn.DataParallel`` in the calling process.
``allreduce`` ``dist.all_reduce`` time for message sizes 4 KiB .. 64 MiB: ``algbw = S / t`` and
              ``busbw = algbw * 2(n-1)/n`` (nccl-tests' definitions), against the memory-copy
              bandwidth of the same size on this machine.
``launch``    Seconds from a call to results for a trivial worker: :func:`helpers.launch.launch`
              against ``torch.multiprocessing.spawn``, and the cost of ``import torch``.
``memory``    Peak RSS per rank when every rank holds its own copy of MNIST, against ranks that
              share one read-only memory map of the raw file.
``buckets``   DDP ``bucket_cap_mb`` and ``gradient_as_bucket_view`` against step time, and a
              ``torch.profiler`` timeline of all-reduce overlapping backward.

Timings are wall-clock (``time.perf_counter``), with ``torch.cuda.synchronize`` on GPUs. They
depend on the machine and on whatever else runs on it: every JSON file records the machine and
the load average before and after. Tests check the structure of the rows, never a timing.

Units: seconds (s), milliseconds (ms), samples per second (samples/s), bytes, GB/s (1e9
bytes/s), MiB (2**20 bytes).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import REPO_ROOT
from helpers.costmodel import algbw as _algbw
from helpers.costmodel import busbw as _busbw

__all__ = [
    "BENCHMARKS",
    "DEFAULT_OUT",
    "PROFILES",
    "profile_config",
    "machine_info",
    "MLP_PARAMS",
    "WRAPPERS",
    "build_bench_model",
    "pipeline_worker",
    "bench_pipeline",
    "scaling_worker",
    "local_throughput",
    "bench_scaling",
    "allreduce_worker",
    "memcpy_bandwidth",
    "bench_allreduce",
    "trivial_worker",
    "spawn_launch",
    "import_torch_seconds",
    "bench_launch_overhead",
    "memory_worker",
    "bench_memory",
    "bucket_worker",
    "bench_buckets",
    "timeline_overlap",
    "run_benchmarks",
    "main",
]

#: Where the command line writes its JSON files.
DEFAULT_OUT = REPO_ROOT / "build" / "bench"

#: The benchmarks the command line knows, in the order it runs them.
BENCHMARKS = ("pipeline", "scaling", "allreduce", "launch", "memory", "buckets")

KIB = 2**10
MIB = 2**20

#: The bucket benchmark's MLP: 784 -> MLP_WIDTH (x MLP_HIDDEN hidden layers) -> 10.
MLP_WIDTH = 512
MLP_HIDDEN = 12
MLP_PARAMS = 784 * MLP_WIDTH + MLP_WIDTH + (MLP_HIDDEN - 1) * (MLP_WIDTH * MLP_WIDTH + MLP_WIDTH) + MLP_WIDTH * 10 + 10

#: Sizes of each benchmark per profile. ``smoke`` is what notebook 05 runs in CI (small, no
#: timing claims); ``full`` is the real measurement (a few minutes on 2 CPU cores).
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "smoke": {
        "pipeline": {"world_sizes": [1], "n_train": 4096, "n_test": 2000, "threads": 1, "repeats": 1},
        "scaling": {"configs": [[1, 1], [2, 1]], "models": ["cnn"], "global_batch_sizes": [256],
                    "steps": 8, "warmup": 2, "local": True},
        "allreduce": {"world_sizes": [2], "sizes_kib": [4, 64, 1024, 4096], "threads": 1},
        "launch": {"world_sizes": [], "repeats": 1},  # only `import torch` in smoke; launches: full
        "memory": {"world_sizes": [], "variants": ["private", "mmap"], "steps": 20},  # two launches: full only
        "buckets": {"world_size": 2, "bucket_caps_mb": [1.0, 25.0], "as_view": [False, True],
                    "steps": 5, "warmup": 2, "profile_cap_mb": 4.0},
    },
    "full": {
        "pipeline": {"world_sizes": [1, 2], "n_train": 0, "n_test": 0, "threads": 1, "repeats": 3},
        "scaling": {"configs": [[1, 1], [1, 2], [2, 1], [2, 2], [4, 1]], "models": ["linear", "cnn"],
                    "global_batch_sizes": [64, 256, 1024], "steps": 30, "warmup": 3, "local": True},
        "allreduce": {"world_sizes": [2, 4], "sizes_kib": [4, 16, 64, 256, 1024, 4096, 16384, 65536],
                      "threads": 1},
        "launch": {"world_sizes": [2, 4], "repeats": 3},
        "memory": {"world_sizes": [1, 2, 4], "variants": ["private", "mmap"], "steps": 100},
        "buckets": {"world_size": 2, "bucket_caps_mb": [0.5, 1.0, 2.0, 4.0, 8.0, 25.0, 100.0],
                    "as_view": [False, True], "steps": 15, "warmup": 3, "profile_cap_mb": 4.0},
    },
}


def profile_config(profile: str) -> dict[str, dict[str, Any]]:
    """A deep copy of :data:`PROFILES[profile] <PROFILES>` (edit it freely in a notebook).

    Raises:
        ValueError: unknown profile name.
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; use one of {sorted(PROFILES)}")
    return json.loads(json.dumps(PROFILES[profile]))


# --------------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model and count, GPUs, versions, load average.

    Returns a JSON-ready dict: ``cpu_model``, ``logical_cpus``, ``gpus`` (names),
    ``torch``, ``python``, ``platform``, ``load_average`` (1, 5, 15 minutes; the number of
    runnable processes averaged: above the core count the machine is busy), ``time`` (UTC).
    """
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "gpus": gpus,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _threads(n: int | None):
    """Temporarily ``torch.set_num_threads(n)`` in this process (``None``: leave as is)."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _peak_rss_mib() -> float:
    from helpers.mnist_train import peak_rss_mib

    return peak_rss_mib()


def _memory_now_mib() -> dict[str, float | None]:
    """This process's RSS, USS (private pages) and PSS (shared pages split between sharers), MiB."""
    import psutil

    p = psutil.Process()
    out: dict[str, float | None] = {"rss_mib": p.memory_info().rss / MIB, "uss_mib": None, "pss_mib": None}
    try:
        full = p.memory_full_info()
        out["uss_mib"] = full.uss / MIB
        out["pss_mib"] = getattr(full, "pss", 0) / MIB or None
    except (psutil.Error, AttributeError, OSError):
        pass
    return out


def _device_ids(device: torch.device):
    return [device.index] if device.type == "cuda" else None


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def build_bench_model(name: str, seed: int | None = 0) -> nn.Module:
    """A model for the benchmarks: input ``(batch, 1, 28, 28) float32``, output ``(batch, 10)``.

    ``"linear"`` and ``"cnn"`` are notebook 04's models (:func:`helpers.mnist_train.build_model`:
    7,850 and 9,098 parameters). ``"mlp"`` is ``784 -> 512 -> (11 more 512-wide layers) -> 10``
    with ReLUs (:data:`MLP_PARAMS` = 3,296,266 parameters, 13.2 MB of float32 gradients; each
    hidden layer 1.05 MB, just over 1 MiB): deep enough for DDP's gradient buckets to matter.

    Raises:
        ValueError: unknown name.
    """
    if name in ("linear", "cnn"):
        from helpers.mnist_train import build_model

        return build_model(name, seed)
    if name != "mlp":
        raise ValueError(f"model must be 'linear', 'cnn' or 'mlp', got {name!r}")
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, MLP_WIDTH), nn.ReLU()]
    for _ in range(MLP_HIDDEN - 1):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, 10))


def _ddp(model: nn.Module, device: torch.device, **kwargs) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model.to(device), device_ids=_device_ids(device), **kwargs)


# --------------------------------------------------------------------------------------------
# 1. Input pipeline: the seed recipe against in-memory tensors
# --------------------------------------------------------------------------------------------


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


#: How the pipeline benchmark wraps the model: ``"ddp"`` (DistributedDataParallel, needed with
#: more than one rank) or ``"none"`` (the plain module; only with one rank, where there is
#: nothing to all-reduce and DDP only adds a round trip through the backend per step).
WRAPPERS = ("ddp", "none")


def _pipeline_epoch(pipeline: str, wrapper: str, rank: int, world_size: int, n_train: int | None,
                    n_test: int | None, batch_size: int, lr: float, seed: int, data_root: str | None,
                    device: torch.device) -> dict[str, Any]:
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    from helpers.data import load_mnist, mnist_datasets

    if wrapper not in WRAPPERS or (wrapper == "none" and world_size > 1):
        raise ValueError(f"wrapper must be 'ddp', or 'none' with world_size 1; got {wrapper!r} "
                         f"with world_size {world_size}")
    t_setup = time.perf_counter()
    if pipeline == "seed":
        # The seed recipe: a PIL image -> ToTensor -> Normalize for every item, collated by the
        # DataLoader (num_workers=0), the rank's share chosen by DistributedSampler.
        train_ds, test_ds = mnist_datasets(data_root)
        if n_train:
            train_ds = Subset(train_ds, range(n_train))
        if n_test:
            test_ds = Subset(test_ds, range(n_test))
        sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(0)
        batches = DataLoader(train_ds, batch_size=batch_size, sampler=sampler)
        test_batches = lambda: DataLoader(test_ds, batch_size=1000)  # noqa: E731
    elif pipeline == "memory":
        # The project's path: the whole split as one float32 tensor, normalised once; each batch
        # is one index_select with the same sampler's indices (same order as the seed).
        # (index_select: the same rows as x[idx], with less per-call overhead than advanced indexing.)
        xtr, ytr = load_mnist(train=True, root=data_root)
        xte, yte = load_mnist(train=False, root=data_root)
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
    else:
        raise ValueError(f"pipeline must be 'seed' or 'memory', got {pipeline!r}")
    model = build_bench_model("linear", seed).to(device)
    wrapped = _ddp(model, device) if wrapper == "ddp" else model
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr)
    setup_s = time.perf_counter() - t_setup

    samples = steps = 0
    loss = torch.zeros(())
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        samples += int(y.shape[0])
        steps += 1
    _sync(device)
    seconds = time.perf_counter() - t0
    accuracy = _accuracy(model, test_batches(), device) if rank == 0 else None
    return {
        "pipeline": pipeline, "wrapper": wrapper, "rank": rank, "world_size": world_size,
        "threads_per_rank": torch.get_num_threads(), "device": str(device),
        "batch_size": batch_size, "steps": steps, "samples": samples, "seconds": seconds,
        "samples_per_s": samples / seconds, "setup_seconds": setup_s,
        "final_loss": float(loss.detach()), "test_accuracy": accuracy,
    }


def pipeline_worker(rank: int, world_size: int, pipelines: Sequence[str] = ("seed", "memory"),
                    n_train: int | None = None, n_test: int | None = None, batch_size: int = 64,
                    lr: float = 0.01, seed: int = 0, threads: int | None = 1, repeats: int = 1,
                    data_root: str | None = None, wrappers: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One rank of the input-pipeline benchmark; run it with ``launch(pipeline_worker, ws, ...)``.

    For each repeat, wrapper and pipeline (``"seed"``: torchvision dataset with ``ToTensor`` +
    ``Normalize`` per item through ``DataLoader(batch_size)`` and ``DistributedSampler``;
    ``"memory"``: :func:`helpers.data.load_mnist` tensors indexed with the same sampler's
    indices), train a fresh ``Linear(784, 10)`` (seeded, so both start from the same weights)
    with SGD for one epoch and time the epoch loop (data loading included: that is the point).
    Rank 0 then measures test accuracy.

    Args:
        n_train, n_test: use only the first ``n`` training / test images (``None`` or 0: all).
        batch_size: samples per rank per step (the seed's 64).
        threads: ``torch.set_num_threads`` in this rank (``None``: the launcher's choice).
        wrappers: from :data:`WRAPPERS`; default ``("none", "ddp")`` with one rank (the plain
            module, as a single process trains, and DDP with ``world_size`` 1), ``("ddp",)``
            with more.

    Returns:
        one row per (repeat, wrapper, pipeline): ``pipeline``, ``wrapper``, ``repeat``,
        ``rank``, ``world_size``, ``threads_per_rank``, ``steps``, ``samples`` (this rank's),
        ``seconds`` (epoch loop, s), ``samples_per_s`` (this rank's), ``setup_seconds``
        (dataset and model construction, s), ``final_loss``, ``test_accuracy`` (rank 0, in
        [0, 1]; ``None`` on other ranks).

    Raises:
        ValueError: unknown pipeline or wrapper, or wrapper ``"none"`` with several ranks.
    """
    from helpers.launch import worker_device

    if threads:
        torch.set_num_threads(int(threads))
    device = worker_device()
    wrappers = tuple(wrappers) if wrappers else (("none", "ddp") if world_size == 1 else ("ddp",))
    rows = []
    for rep in range(repeats):
        for w in wrappers:
            for p in pipelines:
                row = _pipeline_epoch(p, w, rank, world_size, n_train or None, n_test or None, batch_size,
                                      lr, seed, data_root, device)
                row["repeat"] = rep
                rows.append(row)
    return rows


def bench_pipeline(world_sizes: Sequence[int] = (1, 2), n_train: int | None = None,
                   n_test: int | None = None, threads: int | None = 1, repeats: int = 1,
                   batch_size: int = 64, lr: float = 0.01, seed: int = 0,
                   timeout: float = 900.0) -> list[dict[str, Any]]:
    """The seed recipe against the in-memory path, per world size (one launch per world size).

    Both pipelines run in the same worker processes, one after the other, so they share the
    machine's state; the ratio is measured side by side, never compared across runs. With one
    rank both run twice: on the plain module and wrapped in DDP (``world_size`` 1); with more
    ranks, in DDP.

    Returns:
        one row per (world size, repeat, wrapper, pipeline): ``pipeline``, ``wrapper``
        (``"none"`` or ``"ddp"``), ``world_size``, ``repeat``, ``threads_per_rank``,
        ``samples`` (all ranks), ``seconds`` (slowest rank's epoch, s), ``samples_per_s`` (all
        ranks' samples / slowest rank's seconds), ``test_accuracy`` (in [0, 1]),
        ``speedup_vs_seed`` (this pipeline's samples/s over the seed's, same world size, repeat
        and wrapper), ``launch_seconds`` (the whole launch, s).

    Raises:
        helpers.launch.WorkerError / LaunchTimeout: as :func:`helpers.launch.launch`.
    """
    from helpers.launch import launch

    out = []
    for ws in world_sizes:
        t0 = time.perf_counter()
        per_rank = launch(pipeline_worker, ws, ("seed", "memory"), n_train, n_test, batch_size, lr,
                          seed, threads, repeats, timeout=timeout)
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
                "launch_seconds": launch_s,
            }
        for (rep, w, p), row in rows.items():
            row["speedup_vs_seed"] = row["samples_per_s"] / rows[(rep, w, "seed")]["samples_per_s"]
            out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# 2. Scaling: samples/s by world size, threads per rank, model and global batch
# --------------------------------------------------------------------------------------------


def _train_step(model: nn.Module, opt, x, y, sync: bool = True) -> None:
    opt.zero_grad(set_to_none=True)
    if sync or not hasattr(model, "no_sync"):
        F.cross_entropy(model(x), y).backward()
    else:
        with model.no_sync():  # forward and backward inside: no gradient all-reduce
            F.cross_entropy(model(x), y).backward()
    opt.step()


def _timed_steps(model, opt, batch, first: int, steps: int, device, sync: bool = True,
                 barrier: bool = True) -> list[float]:
    """Run ``steps`` training steps; return each step's seconds."""
    if barrier and dist.is_initialized():
        dist.barrier()
    _sync(device)
    times = []
    t = time.perf_counter()
    for s in range(first, first + steps):
        x, y = batch(s)
        _train_step(model, opt, x, y, sync)
        _sync(device)
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def _batch_fn(x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor, global_batch: int, rank: int,
              world_size: int):
    n = perm.numel()

    def batch(step: int):
        start = (step * global_batch) % max(1, n - global_batch)
        idx = perm[start:start + global_batch][rank::world_size]
        return x.index_select(0, idx), y.index_select(0, idx)

    return batch


def scaling_worker(rank: int, world_size: int, models: Sequence[str] = ("linear", "cnn"),
                   global_batch_sizes: Sequence[int] = (64, 256, 1024), steps: int = 20,
                   warmup: int = 3, threads: int | None = 1, seed: int = 0, lr: float = 0.01,
                   no_sync: bool = True, data_root: str | None = None) -> list[dict[str, Any]]:
    """One rank of the scaling benchmark; run it with ``launch(scaling_worker, ws, ...)``.

    Each rank loads MNIST into memory (its own copy), then for every model and global batch
    size builds a fresh DDP model and times ``steps`` SGD steps on
    ``global_batch // world_size`` images per rank (after ``warmup`` untimed steps). With
    ``no_sync`` it also times, to split the step into where its time goes:

    * ``steps`` more inside ``ddp.no_sync()``, all ranks at once: the same work without the
      gradient all-reduce (and without waiting for the slowest rank);
    * with more than one rank, the same per-rank work on rank 0 **alone** (a plain copy of the
      model, no DDP) while the other ranks wait at a barrier: what one rank's share costs
      when it has the machine to itself.

    Args:
        models: names for :func:`build_bench_model`.
        global_batch_sizes: samples per optimizer step over all ranks; each must be divisible
            by ``world_size``.
        threads: ``torch.set_num_threads`` in this rank (``None``: the launcher's choice,
            ``cpu_count // world_size`` unless ``OMP_NUM_THREADS`` is set).

    Returns:
        one row per (model, global batch): ``model``, ``global_batch_size``, ``rank``,
        ``world_size``, ``threads_per_rank``, ``step_s_mean``, ``step_s_median``, ``step_s_min``,
        ``step_s_max`` (synced steps, s), ``nosync_step_s_mean``, ``nosync_step_s_median`` (``None`` without ``no_sync``),
        ``solo_step_s_median`` (rank 0 alone; ``None`` on other ranks, with one rank or without
        ``no_sync``),
        ``peak_rss_mib`` (this process's peak RSS at the end, MiB), ``dataset_mib`` (the
        float32 training images and labels this rank holds, MiB).

    Raises:
        ValueError: a global batch size not divisible by ``world_size``.
    """
    from helpers.data import load_mnist
    from helpers.launch import worker_device

    for gb in global_batch_sizes:
        if gb % world_size:
            raise ValueError(f"global_batch_size={gb} is not divisible by world_size={world_size}")
    if threads:
        torch.set_num_threads(int(threads))
    device = worker_device()
    x, y = load_mnist(train=True, root=data_root)
    dataset_mib = (x.numel() * x.element_size() + y.numel() * y.element_size()) / MIB
    x, y = x.to(device), y.to(device)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(x.shape[0], generator=g).to(device)
    rows = []
    for name in models:
        for gb in global_batch_sizes:
            ddp = _ddp(build_bench_model(name, seed), device)
            opt = torch.optim.SGD(ddp.parameters(), lr=lr)
            batch = _batch_fn(x, y, perm, gb, rank, world_size)
            _timed_steps(ddp, opt, batch, 0, warmup, device)
            synced = _timed_steps(ddp, opt, batch, warmup, steps, device)
            unsynced = _timed_steps(ddp, opt, batch, warmup + steps, steps, device, sync=False) \
                if no_sync else []
            solo = []
            if no_sync and world_size > 1:
                dist.barrier()
                if rank == 0:  # the others wait at the next barrier: rank 0 has the machine
                    plain = build_bench_model(name, seed).to(device)
                    popt = torch.optim.SGD(plain.parameters(), lr=lr)
                    _timed_steps(plain, popt, batch, 0, warmup, device, barrier=False)
                    solo = _timed_steps(plain, popt, batch, warmup, steps, device, barrier=False)
                dist.barrier()
            rows.append({
                "model": name, "global_batch_size": gb, "rank": rank, "world_size": world_size,
                "threads_per_rank": torch.get_num_threads(), "device": str(device), "steps": steps,
                "step_s_mean": sum(synced) / len(synced), "step_s_median": _median(synced),
                "step_s_min": min(synced), "step_s_max": max(synced),
                "nosync_step_s_mean": sum(unsynced) / len(unsynced) if unsynced else None,
                "nosync_step_s_median": _median(unsynced) if unsynced else None,
                "solo_step_s_median": _median(solo) if solo else None,
            })
    peak = _peak_rss_mib()
    for r in rows:
        r["peak_rss_mib"] = peak
        r["dataset_mib"] = dataset_mib
    return rows


def local_throughput(mode: str = "single", models: Sequence[str] = ("linear", "cnn"),
                     global_batch_sizes: Sequence[int] = (64, 256, 1024), steps: int = 20,
                     warmup: int = 3, threads: int | None = 1, seed: int = 0, lr: float = 0.01,
                     data_root: str | None = None) -> list[dict[str, Any]]:
    """Samples/s of one process in *this* process (no launch): a plain model, or ``nn.DataParallel``.

    ``mode="single"`` trains the plain model on ``cuda:0`` (or the CPU). ``mode="dp"`` wraps it
    in ``nn.DataParallel``: with GPUs it scatters every batch over all visible GPUs; on a
    CPU-only machine ``device_ids == []`` and DP simply calls the module, so it cannot run
    anything in parallel (the row says ``dp_device_ids: []``). ``threads`` sets
    ``torch.set_num_threads`` for the measurement and restores it after.

    Returns:
        rows shaped like :func:`scaling_worker`'s (``rank`` 0, ``world_size`` 1, no ``no_sync``
        columns) plus ``mode`` and ``dp_device_ids`` (list of int, DP only).
    """
    from helpers.data import load_mnist

    if mode not in ("single", "dp"):
        raise ValueError(f"mode must be 'single' or 'dp', got {mode!r}")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    x, y = load_mnist(train=True, root=data_root)
    x, y = x.to(device), y.to(device)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed)).to(device)
    rows = []
    with _threads(threads):
        for name in models:
            for gb in global_batch_sizes:
                model = build_bench_model(name, seed).to(device)
                dp_ids = None
                if mode == "dp":
                    model = nn.DataParallel(model)
                    dp_ids = list(model.device_ids)
                opt = torch.optim.SGD(model.parameters(), lr=lr)
                batch = _batch_fn(x, y, perm, gb, 0, 1)
                _timed_steps(model, opt, batch, 0, warmup, device, barrier=False)
                synced = _timed_steps(model, opt, batch, warmup, steps, device, barrier=False)
                rows.append({
                    "mode": mode, "model": name, "global_batch_size": gb, "rank": 0, "world_size": 1,
                    "threads_per_rank": torch.get_num_threads(), "device": str(device), "steps": steps,
                    "step_s_mean": sum(synced) / len(synced), "step_s_median": _median(synced),
                    "step_s_min": min(synced), "step_s_max": max(synced),
                    "dp_device_ids": dp_ids,
                })
    return rows


def bench_scaling(configs: Sequence[Sequence[int]] = ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1)),
                  models: Sequence[str] = ("linear", "cnn"),
                  global_batch_sizes: Sequence[int] = (64, 256, 1024), steps: int = 20,
                  warmup: int = 3, local: bool = True, seed: int = 0,
                  timeout: float = 900.0) -> list[dict[str, Any]]:
    """DDP samples/s for each ``(world_size, threads_per_rank)`` in ``configs`` (one launch each),
    plus, if ``local``, a single process and ``nn.DataParallel`` in this process (1 thread and
    ``cpu_count`` threads).

    Returns:
        one row per (mode, world size, threads, model, global batch): ``mode`` (``"ddp"``,
        ``"single"``, ``"dp"``), ``world_size``, ``threads_per_rank``, ``total_threads``
        (``world_size * threads_per_rank``), ``oversubscribed`` (total threads > logical CPUs),
        ``model``, ``global_batch_size``, ``step_ms`` (the slowest rank's **median** step, ms:
        robust to bursts of other work on the machine), ``step_ms_mean`` (slowest rank's mean),
        ``step_ms_min``, ``step_ms_max`` (the spread: the largest over ranks of each rank's
        fastest and slowest timed step, ms),
        ``samples_per_s`` (``global_batch_size / step_ms``), ``solo_step_ms`` (one rank's share
        of the work with the machine to itself, ms; with one rank: ``nosync_step_ms``),
        ``nosync_step_ms`` (median, ms, all ranks at once without the all-reduce),
        ``interference_ms`` (``nosync - solo``: what the ranks cost each other by sharing cores,
        caches and memory bandwidth), ``comm_exposed_ms`` (``step_ms - nosync_step_ms``: the
        all-reduce, plus waiting for the slowest rank, that backward did not hide),
        ``speedup`` and ``efficiency`` (against DDP with 1 rank and 1 thread, same model and
        batch; efficiency = speedup / world_size), ``peak_rss_mib_per_rank`` (largest rank),
        ``dataset_mib_per_rank``, ``launch_seconds`` (whole launch, s; DDP only).

    Raises:
        ValueError: a global batch size not divisible by a world size (before any launch).
    """
    from helpers.launch import launch

    for ws, _ in configs:
        bad = [gb for gb in global_batch_sizes if gb % int(ws)]
        if bad:
            raise ValueError(f"global_batch_size {bad} not divisible by world_size={ws}: every rank must "
                             f"take the same share of each global batch")
    cpus = os.cpu_count() or 1
    out = []
    for ws, threads in configs:
        t0 = time.perf_counter()
        per_rank = launch(scaling_worker, int(ws), list(models), list(global_batch_sizes), steps, warmup,
                          int(threads), seed, timeout=timeout)
        launch_s = time.perf_counter() - t0
        for i, r0 in enumerate(per_rank[0]):
            ranks = [pr[i] for pr in per_rank]
            # the median step resists bursts from other processes; the slowest rank sets the pace
            step = max(r["step_s_median"] for r in ranks)
            nosync = max(r["nosync_step_s_median"] for r in ranks) if r0["nosync_step_s_median"] is not None else None
            solo = r0["solo_step_s_median"] if r0["solo_step_s_median"] is not None else (nosync if ws == 1 else None)
            out.append({
                "mode": "ddp", "world_size": ws, "threads_per_rank": r0["threads_per_rank"],
                "total_threads": ws * r0["threads_per_rank"],
                "oversubscribed": ws * r0["threads_per_rank"] > cpus,
                "model": r0["model"], "global_batch_size": r0["global_batch_size"], "device": r0["device"],
                "step_ms": step * 1e3, "step_ms_mean": max(r["step_s_mean"] for r in ranks) * 1e3,
                "step_ms_min": max(r["step_s_min"] for r in ranks) * 1e3,
                "step_ms_max": max(r["step_s_max"] for r in ranks) * 1e3,
                "samples_per_s": r0["global_batch_size"] / step,
                "solo_step_ms": solo * 1e3 if solo is not None else None,
                "nosync_step_ms": nosync * 1e3 if nosync is not None else None,
                "interference_ms": (nosync - solo) * 1e3 if solo is not None and nosync is not None else None,
                "comm_exposed_ms": (step - nosync) * 1e3 if nosync is not None else None,
                "peak_rss_mib_per_rank": max(r["peak_rss_mib"] for r in ranks),
                "dataset_mib_per_rank": r0["dataset_mib"],
                "launch_seconds": launch_s,
            })
    if local:
        for mode in ("single", "dp"):
            for threads in sorted({1, cpus}):
                for r in local_throughput(mode, models, global_batch_sizes, steps, warmup, threads, seed):
                    out.append({
                        "mode": mode, "world_size": 1, "threads_per_rank": r["threads_per_rank"],
                        "total_threads": r["threads_per_rank"], "oversubscribed": r["threads_per_rank"] > cpus,
                        "model": r["model"], "global_batch_size": r["global_batch_size"], "device": r["device"],
                        "step_ms": r["step_s_median"] * 1e3, "step_ms_mean": r["step_s_mean"] * 1e3,
                        "step_ms_min": r["step_s_min"] * 1e3, "step_ms_max": r["step_s_max"] * 1e3,
                        "samples_per_s": r["global_batch_size"] / r["step_s_median"],
                        "solo_step_ms": None, "nosync_step_ms": None, "interference_ms": None,
                        "comm_exposed_ms": None,
                        "peak_rss_mib_per_rank": None, "dataset_mib_per_rank": None, "launch_seconds": None,
                        "dp_device_ids": r["dp_device_ids"],
                    })
    base = {(r["model"], r["global_batch_size"]): r["samples_per_s"] for r in out
            if r["mode"] == "ddp" and r["world_size"] == 1 and r["threads_per_rank"] == 1}
    for r in out:
        b = base.get((r["model"], r["global_batch_size"]))
        r["speedup"] = r["samples_per_s"] / b if b else None
        r["efficiency"] = r["speedup"] / r["world_size"] if b else None
    return out


# --------------------------------------------------------------------------------------------
# 3. All-reduce bandwidth, and the memory-copy bandwidth it is bounded by on one host
# --------------------------------------------------------------------------------------------


def _iters_for(nbytes: int, target_bytes: int, min_iters: int, max_iters: int) -> int:
    """Same on every rank (a collective loop must have the same length everywhere)."""
    return int(min(max_iters, max(min_iters, math.ceil(target_bytes / max(nbytes, 1)))))


def allreduce_worker(rank: int, world_size: int, sizes_bytes: Sequence[int], warmup: int = 2,
                     min_iters: int = 3, max_iters: int = 200, target_bytes: int = 256 * MIB,
                     threads: int | None = 1) -> list[dict[str, Any]]:
    """One rank of the all-reduce benchmark; run it with ``launch(allreduce_worker, ws, sizes)``.

    For each size ``S`` (bytes), all-reduces (sum) a float32 tensor of ``S / 4`` zeros
    ``iters`` times back to back after ``warmup`` untimed calls (``iters`` from ``S``: enough
    calls to move about ``target_bytes``, clamped to ``[min_iters, max_iters]``), and takes the
    slowest rank's mean time per call (an all-reduce finishes when its last rank does).

    It also counts the bytes each rank really **sent** during the timed calls: the kernel's
    ``wchar`` counter of ``/proc/self/io`` (bytes passed to ``write``-family system calls, which
    is how gloo sends over its TCP sockets; Linux only). That is a measurement, independent of
    the ring formula ``2(n-1)/n * S`` that defines busbw (notebook 05 compares the two).

    Returns:
        rank 0: one row per size: ``bytes``, ``world_size``, ``iters``, ``seconds`` (one
        all-reduce, s), ``algbw_GBps`` (``S / t``, GB/s), ``busbw_GBps`` (``algbw * 2(n-1)/n``,
        GB/s), ``sent_bytes_per_call`` (list, one per rank: bytes written per all-reduce,
        measured; ``None`` where ``/proc/self/io`` is missing, or on GPUs, where NCCL does not
        go through system calls), ``backend``, ``threads_per_rank``; other ranks: ``[]``.
    """
    from helpers.launch import worker_device

    if threads:
        torch.set_num_threads(int(threads))
    device = worker_device()
    rows = []
    for nbytes in sizes_bytes:
        t = torch.zeros(max(1, int(nbytes) // 4), dtype=torch.float32, device=device)
        iters = _iters_for(int(nbytes), target_bytes, min_iters, max_iters)
        for _ in range(warmup):
            dist.all_reduce(t)
        _sync(device)
        dist.barrier()
        written0 = _bytes_written()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        _sync(device)
        elapsed = time.perf_counter() - t0
        written1 = _bytes_written()
        sent = (written1 - written0) / iters if written0 is not None and written1 is not None else -1.0
        per_call = torch.tensor([elapsed / iters], dtype=torch.float64, device=device)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
        sent_all = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
        dist.all_gather(sent_all, torch.tensor([sent], dtype=torch.float64, device=device))
        seconds = float(per_call.item())
        size = t.numel() * t.element_size()
        a = _algbw(size, seconds)
        sent_bytes = [float(x.item()) for x in sent_all]
        rows.append({"bytes": size, "world_size": world_size, "iters": iters, "seconds": seconds,
                     "algbw_GBps": a / 1e9, "busbw_GBps": _busbw(a, world_size) / 1e9,
                     "sent_bytes_per_call": None if device.type == "cuda" or min(sent_bytes) < 0 else sent_bytes,
                     "backend": dist.get_backend(), "threads_per_rank": torch.get_num_threads()})
    return rows if rank == 0 else []


def _bytes_written() -> int | None:
    """This process's ``wchar`` from ``/proc/self/io`` (bytes written by system calls), or ``None``."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def memcpy_bandwidth(sizes_bytes: Sequence[int], threads: int | None = 1, repeats_min: int = 5,
                     target_bytes: int = 512 * MIB, device: str | None = None) -> list[dict[str, Any]]:
    """Memory-copy bandwidth ``S / t`` of ``dst.copy_(src)`` for each size ``S``, in this process.

    The single-host limit for all-reduce between processes: every byte a rank sends to another
    on the same machine is at least copied once through memory. Reported like ``algbw`` (bytes
    copied / time; the copy reads ``S`` and writes ``S`` bytes). ``device``: ``None`` for
    the CPU, or e.g. ``"cuda:0"`` (device-to-device copy).

    Returns:
        one row per size: ``bytes``, ``iters``, ``seconds`` (one copy, s), ``copy_GBps``
        (GB/s), ``threads``.
    """
    dev = torch.device(device or "cpu")
    rows = []
    with _threads(threads):
        for nbytes in sizes_bytes:
            n = max(1, int(nbytes) // 4)
            src = torch.rand(n, device=dev)
            dst = torch.empty_like(src)
            iters = _iters_for(int(nbytes), target_bytes, repeats_min, 2000)
            for _ in range(3):
                dst.copy_(src)
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            _sync(dev)
            seconds = (time.perf_counter() - t0) / iters
            rows.append({"bytes": n * 4, "iters": iters, "seconds": seconds,
                         "copy_GBps": n * 4 / seconds / 1e9, "threads": torch.get_num_threads()})
    return rows


def bench_allreduce(world_sizes: Sequence[int] = (2, 4), sizes_kib: Sequence[int] = (4, 64, 1024, 16384, 65536),
                    threads: int | None = 1, timeout: float = 900.0) -> dict[str, list[dict[str, Any]]]:
    """All-reduce time, algbw and busbw per world size and size; memory copy of the same sizes.

    Returns:
        ``{"allreduce": rows of allreduce_worker (+ "copy_GBps" of the same size and
        "busbw_over_copy"), "memcpy": rows of memcpy_bandwidth}``.
    """
    from helpers.launch import launch

    sizes = [int(k) * KIB for k in sizes_kib]
    copy = memcpy_bandwidth(sizes, threads=threads)
    by_size = {r["bytes"]: r["copy_GBps"] for r in copy}
    rows = []
    for ws in world_sizes:
        rows += launch(allreduce_worker, ws, sizes, threads=threads, timeout=timeout)[0]
    for r in rows:
        r["copy_GBps"] = by_size.get(r["bytes"])
        r["busbw_over_copy"] = r["busbw_GBps"] / r["copy_GBps"] if r["copy_GBps"] else None
    return {"allreduce": rows, "memcpy": copy}


# --------------------------------------------------------------------------------------------
# 4. Launch overhead: helpers.launch against torch.multiprocessing.spawn
# --------------------------------------------------------------------------------------------


def trivial_worker(rank: int, world_size: int) -> int:
    """The cheapest worker: returns its rank (for launch-overhead measurements)."""
    return rank


def _free_port() -> int:
    from helpers.procs import free_port

    return free_port()


def _spawn_entry(local_rank: int, fn, world_size: int, port: int, queue, backend: str) -> None:
    """What each ``torch.multiprocessing.spawn`` process runs: the hand-written setup that
    ``helpers.launch`` does for you (environment, process group, result back to the caller)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(local_rank),
                       "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)})
    dist.init_process_group(backend)
    try:
        queue.put((local_rank, fn(local_rank, world_size)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_launch(fn, world_size: int, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size)`` with ``torch.multiprocessing.spawn`` (the tutorials' way),
    with a process group, and collect the return values in rank order through a queue.

    For comparison with :func:`helpers.launch.launch` only: no output relay, no timeout, and a
    port picked by binding port 0 first (another process may take it in between).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_spawn_entry, args=(fn, world_size, _free_port(), queue, backend), nprocs=world_size, join=True)
    results = dict(queue.get() for _ in range(world_size))
    return [results[r] for r in range(world_size)]


def import_torch_seconds() -> float:
    """Seconds for a fresh Python interpreter to ``import torch`` and exit (a floor for any
    launcher that starts new processes)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def bench_launch_overhead(world_sizes: Sequence[int] = (2, 4), repeats: int = 3) -> list[dict[str, Any]]:
    """Seconds from the call to the results for :func:`trivial_worker`, per method and world size.

    Methods: ``"helpers.launch"`` (:func:`helpers.launch.launch`: torch's elastic agent, output
    relay, error handling), ``"torch.multiprocessing.spawn"`` (:func:`spawn_launch`),
    ``"python -c 'import torch'"`` (one fresh interpreter; ``world_size`` 1) and, when 2 is in
    ``world_sizes``, warm ranks (:func:`bench_warm_ranks`: start-up once, then warm calls).

    Returns:
        one row per measurement: ``method``, ``world_size``, ``repeat``, ``seconds``.
    """
    from helpers.launch import launch

    rows = []
    for rep in range(repeats):
        rows.append({"method": "python -c 'import torch'", "world_size": 1, "repeat": rep,
                     "seconds": import_torch_seconds()})
        for ws in world_sizes:
            t0 = time.perf_counter()
            got = launch(trivial_worker, ws)
            rows.append({"method": "helpers.launch", "world_size": ws, "repeat": rep,
                         "seconds": time.perf_counter() - t0})
            assert got == list(range(ws)), got
            t0 = time.perf_counter()
            got = spawn_launch(trivial_worker, ws)
            rows.append({"method": "torch.multiprocessing.spawn", "world_size": ws, "repeat": rep,
                         "seconds": time.perf_counter() - t0})
            assert got == list(range(ws)), got
    if 2 in world_sizes:  # side by side with the cold launches of 2 ranks above
        rows += bench_warm_ranks(2, repeats=max(10, repeats))
    return rows


#: Method names of the warm-rank rows (:func:`bench_warm_ranks`).
WARM_START, WARM_RUN = "helpers.ranks start_ranks (engines, torch, group)", "helpers.ranks WarmRanks.run (warm)"


def bench_warm_ranks(world_size: int = 2, repeats: int = 10) -> list[dict[str, Any]]:
    """Seconds to start warm ranks (:func:`helpers.ranks.start_ranks`: ipyparallel engines, each
    importing torch, and the process group) and for :func:`trivial_worker` through
    ``WarmRanks.run`` once they are warm (after one untimed call). Same rows as
    :func:`bench_launch_overhead`."""
    from helpers.ranks import start_ranks

    t0 = time.perf_counter()
    ranks = start_ranks(world_size, activate=False)
    rows = [{"method": WARM_START, "world_size": world_size, "repeat": 0, "seconds": time.perf_counter() - t0}]
    try:
        ranks.run(trivial_worker)
        for rep in range(repeats):
            t0 = time.perf_counter()
            got = ranks.run(trivial_worker)
            rows.append({"method": WARM_RUN, "world_size": world_size, "repeat": rep,
                         "seconds": time.perf_counter() - t0})
            assert got == list(range(world_size)), got
    finally:
        ranks.stop()
    return rows


# --------------------------------------------------------------------------------------------
# 5. Memory: every rank holding MNIST, against one shared read-only map
# --------------------------------------------------------------------------------------------


def _mmap_split(train: bool, root: str | None):
    """uint8 images ``(N, 28, 28)`` and labels ``(N,)`` mapped copy-on-write from the raw IDX
    files: the pages are the page cache's, shared by every process that maps the file."""
    import numpy as np

    from helpers.data import MNIST_FILES, ensure_mnist

    raw = Path(ensure_mnist(root)) / "MNIST" / "raw"
    prefix = "train" if train else "t10k"
    n = MNIST_FILES[f"{prefix}-images-idx3-ubyte"].count
    imgs = np.memmap(raw / f"{prefix}-images-idx3-ubyte", dtype=np.uint8, mode="c", offset=16, shape=(n, 28, 28))
    labs = np.memmap(raw / f"{prefix}-labels-idx1-ubyte", dtype=np.uint8, mode="c", offset=8, shape=(n,))
    return torch.from_numpy(imgs), torch.from_numpy(labs)


def memory_worker(rank: int, world_size: int, variant: str = "private", steps: int = 100,
                  batch_per_rank: int = 64, threads: int | None = 1, seed: int = 0,
                  data_root: str | None = None) -> dict[str, Any]:
    """One rank of the memory benchmark: hold MNIST, train ``Linear(784, 10)`` for ``steps``.

    ``variant="private"``: the project's path, :func:`helpers.data.load_mnist` for train and
    test (float32, normalised: 219.6 MB per rank, plus the uint8 files it parsed, memoised).
    ``variant="mmap"``: the raw uint8 IDX files mapped read-only (copy-on-write) with numpy;
    every rank maps the same page-cache pages, and each batch is converted to normalised
    float32 when it is used.

    Returns:
        ``variant``, ``rank``, ``world_size``, ``peak_rss_mib`` (VmHWM, MiB), ``rss_mib``,
        ``uss_mib`` (pages only this process maps), ``pss_mib`` (shared pages divided among the
        processes that map them; sums to the real total), ``dataset_mib`` (bytes of the
        dataset tensors as this rank sees them, MiB).
    """
    from helpers.data import MNIST_MEAN, MNIST_STD, load_mnist

    if threads:
        torch.set_num_threads(int(threads))
    if variant == "private":
        xtr, ytr = load_mnist(train=True, root=data_root)
        xte, yte = load_mnist(train=False, root=data_root)

        def get(idx):
            return xtr[idx], ytr[idx]
    elif variant == "mmap":
        xtr, ytr = _mmap_split(True, data_root)
        xte, yte = _mmap_split(False, data_root)

        def get(idx):
            x = xtr[idx].unsqueeze(1).float().mul_(1.0 / (255.0 * MNIST_STD)).sub_(MNIST_MEAN / MNIST_STD)
            return x, ytr[idx].long()
    else:
        raise ValueError(f"variant must be 'private' or 'mmap', got {variant!r}")
    dataset_mib = sum(t.numel() * t.element_size() for t in (xtr, ytr, xte, yte)) / MIB
    model = _ddp(build_bench_model("linear", seed), torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    perm = torch.randperm(xtr.shape[0], generator=torch.Generator().manual_seed(seed))
    mine = perm[rank::world_size]
    for s in range(steps):
        idx = mine[(s * batch_per_rank) % max(1, mine.numel() - batch_per_rank):][:batch_per_rank]
        _train_step(model, opt, *get(idx))
    # every rank touches every page of its data once (as an epoch would), then we measure
    checksum = float(xtr.reshape(xtr.shape[0], -1)[:, ::512].float().sum()) + float(xte.float().sum())
    dist.barrier()  # every rank holds its data (and maps) while every rank measures
    now = _memory_now_mib()
    dist.barrier()
    return {"variant": variant, "rank": rank, "world_size": world_size, "peak_rss_mib": _peak_rss_mib(),
            **now, "dataset_mib": dataset_mib, "checksum": checksum}


def bench_memory(world_sizes: Sequence[int] = (1, 2, 4), variants: Sequence[str] = ("private", "mmap"),
                 steps: int = 100, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Per-rank memory for each world size and variant (one launch each, backend gloo: the
    data lives in host memory).

    Returns:
        the rows of :func:`memory_worker` for every rank, with ``launch_seconds`` added.
    """
    from helpers.launch import launch

    rows = []
    for ws in world_sizes:
        for v in variants:
            t0 = time.perf_counter()
            got = launch(memory_worker, ws, v, steps, backend="gloo", timeout=timeout)  # host memory: CPU
            for r in got:
                r["launch_seconds"] = time.perf_counter() - t0
            rows += got
    return rows


# --------------------------------------------------------------------------------------------
# 5b. Threads per rank: what each launcher sets (notebook 05)
# --------------------------------------------------------------------------------------------

#: What :func:`bench_threads_by_launcher` runs in each rank (and in the plain process): prints
#: one JSON line with the rank, ``torch.get_num_threads()`` and ``OMP_NUM_THREADS`` as it found it.
THREADS_REPORT_CODE = ("import json, os, torch; print('THREADS ' + json.dumps({'rank': int(os.environ.get('RANK', 0)), "
                       "'torch_threads': torch.get_num_threads(), 'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS')}))")


def threads_worker(rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """One rank's ``{"rank", "torch_threads", "OMP_NUM_THREADS"}`` (``None`` when unset): what
    the launcher that started this process left it. Works under ``launch``, ``mp.spawn`` and
    ``elastic_launch`` (which passes no arguments: the rank comes from ``RANK``)."""
    return {"rank": int(os.environ.get("RANK", rank)), "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def _threads_lines(text: str) -> list[dict[str, Any]]:
    """The ``THREADS {...}`` report lines of ONE process's output (never a stream that several
    processes share: their lines could run together)."""
    rows = [json.loads(line.split("THREADS ", 1)[1]) for line in text.splitlines() if line.startswith("THREADS ")]
    return sorted(rows, key=lambda r: r["rank"])


def bench_threads_by_launcher(world_size: int = 2, timeout: float = 300.0) -> dict[str, Any]:
    """Threads per rank as four launchers leave them, each measured in real processes.

    With ``OMP_NUM_THREADS`` removed from the environment the children inherit (restored after):

    * ``"plain python"``: one fresh ``python -c`` (torch's own default, no launcher);
    * ``"torchrun"``: ``python -m torch.distributed.run --standalone --nproc-per-node
      world_size --no-python python -c ...`` (torchrun's CLI, ``torch/distributed/run.py``, sets
      ``OMP_NUM_THREADS=1`` when it starts more than one process per node and the variable is
      unset, and prints a warning saying so);
    * ``"torch.multiprocessing.spawn"``: :func:`spawn_launch` of :func:`threads_worker`;
    * ``"elastic_launch"``: ``torch.distributed.launcher.api.elastic_launch`` (the engine
      behind torchrun, called from Python) of :func:`threads_worker`;
    * ``"helpers.launch"``: :func:`helpers.launch.launch` of :func:`threads_worker`.

    Returns:
        ``{"rows": [{"launcher", "rank", "torch_threads", "OMP_NUM_THREADS"}, ...],
        "torchrun_stderr": str, "cpu_count": int}``.

    Raises:
        subprocess.CalledProcessError / TimeoutExpired: a child failed or hung (it is killed).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from helpers.launch import launch

    saved = os.environ.pop("OMP_NUM_THREADS", None)
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    try:
        plain = subprocess.run([sys.executable, "-c", THREADS_REPORT_CODE], env=env, capture_output=True,
                               text=True, timeout=timeout, check=True)
        rows += [{"launcher": "plain python", **r} for r in _threads_lines(plain.stdout)]
        with tempfile.TemporaryDirectory(prefix="ddp-lab-threads-") as log_dir:
            # --redirects 3: each rank's stdout/stderr go to its own file under --log-dir
            # (<log_dir>/<run id>/attempt_0/<rank>/stdout.log), so no two ranks share a stream
            tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={world_size}", f"--log-dir={log_dir}", "--redirects=3",
                                 "--no-python", sys.executable, "-c", THREADS_REPORT_CODE],
                                env=env, capture_output=True, text=True, timeout=timeout, check=True)
            logs = sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "stdout.log")))
            if len(logs) != world_size:
                raise RuntimeError(f"torchrun left {len(logs)} rank stdout logs for world_size={world_size}: {logs}")
            for path in logs:
                with open(path) as f:
                    rows += [{"launcher": "torchrun", **r} for r in _threads_lines(f.read())]
        rows += [{"launcher": "torch.multiprocessing.spawn", **r} for r in spawn_launch(threads_worker, world_size)]
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size,
                              run_id=f"threads-{os.getpid()}-{time.monotonic_ns()}", rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
                              monitor_interval=0.1, start_method="spawn")
        import signal

        # elastic_launch installs its own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers in the calling
        # process (a notebook kernel here); put the caller's back afterwards
        sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
        import threading

        in_main = threading.current_thread() is threading.main_thread()  # only there can handlers change
        handlers = {sig: signal.getsignal(sig) for sig in sigs} if in_main else {}
        try:
            got = elastic_launch(config, threads_worker)()
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)
        rows += [{"launcher": "elastic_launch", **got[r]} for r in sorted(got)]
        rows += [{"launcher": "helpers.launch", **r} for r in launch(threads_worker, world_size, timeout=timeout)]
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
    return {"rows": rows, "torchrun_stderr": tr.stderr if "tr" in locals() else "", "cpu_count": os.cpu_count()}


# --------------------------------------------------------------------------------------------
# 6. DDP gradient buckets, and a profiler timeline of all-reduce overlapping backward
# --------------------------------------------------------------------------------------------


def _counting_hook(state: dict, bucket):
    """A DDP communication hook (public API) that records each bucket's size, then all-reduces it
    exactly as DDP's default does (``allreduce_hook``: sum, divide by world size)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    state["bytes"].append(buf.numel() * buf.element_size())
    return allreduce_hook(None, bucket)


def _bucket_layout(model_name: str, seed: int, cap_mb: float | None, view: bool, x, y, device) -> list[int]:
    """Bucket sizes (bytes) DDP all-reduces per step with this cap, read with a comm hook on a
    throw-away DDP model, after DDP rebuilt its buckets in the first step's gradient order.
    ``cap_mb=None`` leaves ``bucket_cap_mb`` at DDP's default (the argument is not passed)."""
    state: dict[str, list] = {"bytes": []}
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    ddp = _ddp(build_bench_model(model_name, seed), device, gradient_as_bucket_view=view, **kwargs)
    ddp.register_comm_hook(state, _counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(2):
        state["bytes"] = []
        _train_step(ddp, opt, x, y)
    return list(state["bytes"])


_COMM_MARKERS = ("gloo:all_reduce", "nccl:all_reduce", "ncclDevKernel_AllReduce", "ncclKernel_AllReduce")


def _timeline_from_profile(prof) -> list[dict[str, Any]]:
    """Flatten profiler events into lanes: forward, backward ops, optimizer, all-reduce (launch
    on the main thread; execution on the backend's threads or GPU streams)."""
    rows = []
    for e in prof.events():
        name = e.name
        kind = None
        if name == "DistributedDataParallel.forward":
            kind = "forward"
        elif name.startswith("autograd::engine::evaluate_function:"):
            kind = "backward"
        elif name.startswith("Optimizer.step"):
            kind = "optimizer"
        elif name == "c10d::allreduce_":
            kind = "allreduce launched"
        elif any(m in name for m in _COMM_MARKERS):
            kind = "allreduce"
        elif name.startswith("ProfilerStep") or name.startswith("step "):
            kind = "step"
        if kind is None:
            continue
        start = e.time_range.start
        rows.append({"kind": kind, "name": name, "thread": int(e.thread), "start_us": float(start),
                     "dur_us": float(e.time_range.end - start),
                     "device": "cuda" if getattr(e, "device_type", None) is not None
                     and "CUDA" in str(e.device_type) else "cpu"})
    if rows:
        t0 = min(r["start_us"] for r in rows)
        for r in rows:
            r["start_ms"] = (r.pop("start_us") - t0) / 1e3
            r["dur_ms"] = r.pop("dur_us") / 1e3
    rows.sort(key=lambda r: r["start_ms"])
    return rows


def timeline_overlap(timeline: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How much all-reduce time falls inside backward, from :func:`bucket_worker`'s timeline.

    For each profiled step (``kind == "step"`` windows), backward spans from its first to its
    last backward op; the overlap is the all-reduce time (``kind == "allreduce"``) inside that
    span.

    Returns:
        ``allreduce_ms`` (total), ``overlapped_ms``, ``overlap_fraction`` (in [0, 1]; ``None``
        without all-reduce events), ``launches`` (all-reduce calls DDP made), ``launched_early``
        (calls launched before the step's last backward op started: buckets whose all-reduce
        began while gradients of earlier layers were still to be computed; with ``k`` buckets a
        step has ``k - 1`` of them), ``backward_ms`` (summed backward spans), ``steps``.
    """
    steps = [r for r in timeline if r["kind"] == "step"]
    if not steps:
        steps = [{"start_ms": min((r["start_ms"] for r in timeline), default=0.0),
                  "dur_ms": max((r["start_ms"] + r["dur_ms"] for r in timeline), default=0.0)}]
    total = overlapped = backward = 0.0
    early = launches = 0
    for s in steps:
        lo, hi = s["start_ms"], s["start_ms"] + s["dur_ms"]
        inside = [r for r in timeline if lo <= r["start_ms"] < hi and r["kind"] != "step"]
        bw = [r for r in inside if r["kind"] == "backward"]
        if not bw:
            continue
        b0 = min(r["start_ms"] for r in bw)
        b1 = max(r["start_ms"] + r["dur_ms"] for r in bw)
        last_start = max(r["start_ms"] for r in bw)
        backward += b1 - b0
        for r in inside:
            if r["kind"] == "allreduce":
                a0, a1 = r["start_ms"], r["start_ms"] + r["dur_ms"]
                total += a1 - a0
                overlapped += max(0.0, min(a1, b1) - max(a0, b0))
            elif r["kind"] == "allreduce launched":
                launches += 1
                early += r["start_ms"] < last_start
    return {"allreduce_ms": total, "overlapped_ms": overlapped,
            "overlap_fraction": overlapped / total if total > 0 else None,
            "launches": launches, "launched_early": early, "backward_ms": backward, "steps": len(steps)}


def bucket_worker(rank: int, world_size: int, bucket_caps_mb: Sequence[float] = (1.0, 25.0),
                  as_view: Sequence[bool] = (False, True), model: str = "mlp", batch_per_rank: int = 64,
                  steps: int = 10, warmup: int = 3, threads: int | None = 1, seed: int = 0,
                  profile_cap_mb: float | None = 1.0, profile_steps: int = 2) -> dict[str, Any]:
    """One rank of the bucket benchmark; run it with ``launch(bucket_worker, ws, ...)``.

    For every ``bucket_cap_mb`` (MiB) and ``gradient_as_bucket_view``: read the bucket layout
    with a counting communication hook (``register_comm_hook``, public API) on a throw-away DDP
    model, then time ``steps`` steps of a fresh DDP model (no hook) on a fixed random batch
    ``(batch_per_rank, 1, 28, 28)`` (the data does not change the step time). Then, if
    ``profile_cap_mb`` is set, profile ``profile_steps`` steps with ``torch.profiler`` on rank 0
    (all ranks run them).

    Returns:
        ``{"rows": [...], "timeline": [...] or None, "profile_bucket_mb": [...] or None,
        "default_cap_bucket_mb": [...]}`` (``profile_bucket_mb``: bucket sizes, MB, of the
        profiled model; ``default_cap_bucket_mb``: the layout when ``bucket_cap_mb`` is not
        passed at all, DDP's default); rows: ``bucket_cap_mb``,
        ``gradient_as_bucket_view``, ``n_buckets``, ``bucket_mb`` (list, MB of each bucket in
        all-reduce order), ``step_s_median``, ``step_s_mean`` (s), ``rank``, ``world_size``,
        ``threads_per_rank``, ``model``, ``n_params``; timeline rows: ``kind`` (``forward``,
        ``backward``, ``optimizer``, ``allreduce launched``, ``allreduce``, ``step``),
        ``name``, ``thread``, ``start_ms``, ``dur_ms``, ``device``.
    """
    from helpers.launch import worker_device

    if threads:
        torch.set_num_threads(int(threads))
    device = worker_device()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(batch_per_rank, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (batch_per_rank,), generator=g).to(device)
    n_params = sum(p.numel() for p in build_bench_model(model, seed).parameters())
    rows = []
    for cap in bucket_caps_mb:
        for view in as_view:
            layout = _bucket_layout(model, seed, cap, view, x, y, device)
            ddp = _ddp(build_bench_model(model, seed), device, bucket_cap_mb=cap, gradient_as_bucket_view=view)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
            batch = lambda s: (x, y)  # noqa: E731
            _timed_steps(ddp, opt, batch, 0, warmup, device)
            times = _timed_steps(ddp, opt, batch, 0, steps, device)
            rows.append({"bucket_cap_mb": cap, "gradient_as_bucket_view": bool(view), "n_buckets": len(layout),
                         "bucket_mb": [b / 1e6 for b in layout], "step_s_median": _median(times),
                         "step_s_mean": sum(times) / len(times), "rank": rank, "world_size": world_size,
                         "threads_per_rank": torch.get_num_threads(), "model": model, "n_params": n_params})
    default_layout = _bucket_layout(model, seed, None, False, x, y, device)
    timeline = profile_layout = None
    if profile_cap_mb:
        profile_layout = _bucket_layout(model, seed, profile_cap_mb, False, x, y, device)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silence the profiler library's own log lines
        from torch.profiler import ProfilerActivity, profile, record_function

        ddp = _ddp(build_bench_model(model, seed), device, bucket_cap_mb=profile_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(warmup):
            _train_step(ddp, opt, x, y)
        dist.barrier()
        if rank == 0:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for s in range(profile_steps):
                    with record_function(f"step {s}"):
                        _train_step(ddp, opt, x, y)
                    _sync(device)
            timeline = _timeline_from_profile(prof)
        else:
            for s in range(profile_steps):
                _train_step(ddp, opt, x, y)
            _sync(device)
    return {"rows": rows, "timeline": timeline,
            "profile_bucket_mb": [b / 1e6 for b in profile_layout] if profile_layout is not None else None,
            "default_cap_bucket_mb": [b / 1e6 for b in default_layout]}


def bench_buckets(world_size: int = 2, bucket_caps_mb: Sequence[float] = (1.0, 25.0),
                  as_view: Sequence[bool] = (False, True), model: str = "mlp", steps: int = 10,
                  warmup: int = 3, threads: int | None = 1, profile_cap_mb: float | None = 1.0,
                  timeout: float = 900.0) -> dict[str, Any]:
    """The bucket sweep in one launch of ``world_size`` ranks.

    Returns:
        ``{"rows": [...], "timeline": [...], "profile_bucket_mb": [...], "default_cap_bucket_mb":
        [...]}``: one row per (cap, view) with ``step_ms`` (slowest rank's median step, ms) added
        to rank 0's row; the timeline from rank 0, the profiled model's bucket sizes (MB) and the
        bucket sizes (MB) with ``bucket_cap_mb`` left at DDP's default.
    """
    from helpers.launch import launch

    got = launch(bucket_worker, world_size, list(bucket_caps_mb), list(as_view), model, 64, steps, warmup,
                 threads, 0, profile_cap_mb, timeout=timeout)
    rows = []
    for i, r0 in enumerate(got[0]["rows"]):
        r = dict(r0)
        r["step_ms"] = max(g["rows"][i]["step_s_median"] for g in got) * 1e3
        r["rank"] = "all"
        rows.append(r)
    return {"rows": rows, "timeline": got[0]["timeline"], "profile_bucket_mb": got[0]["profile_bucket_mb"],
            "default_cap_bucket_mb": got[0]["default_cap_bucket_mb"]}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _run_one(name: str, cfg: dict[str, Any]) -> Any:
    if name == "pipeline":
        return bench_pipeline(cfg["world_sizes"], cfg["n_train"] or None, cfg["n_test"] or None,
                              cfg["threads"], cfg["repeats"])
    if name == "scaling":
        return bench_scaling(cfg["configs"], cfg["models"], cfg["global_batch_sizes"], cfg["steps"],
                             cfg["warmup"], cfg["local"])
    if name == "allreduce":
        return bench_allreduce(cfg["world_sizes"], cfg["sizes_kib"], cfg["threads"])
    if name == "launch":
        return bench_launch_overhead(cfg["world_sizes"], cfg["repeats"])
    if name == "memory":
        return bench_memory(cfg["world_sizes"], cfg["variants"], cfg["steps"])
    if name == "buckets":
        return bench_buckets(cfg["world_size"], cfg["bucket_caps_mb"], cfg["as_view"], steps=cfg["steps"],
                             warmup=cfg["warmup"], profile_cap_mb=cfg["profile_cap_mb"])
    raise ValueError(f"unknown benchmark {name!r}; choose from {BENCHMARKS}")


def _tables(name: str, result: Any) -> list[tuple[str, Any]]:
    """The table(s) the command line prints for one benchmark (pandas DataFrames)."""
    import pandas as pd

    if not result or (isinstance(result, dict) and not any(result.values())):
        return [("nothing to run in this profile", pd.DataFrame())]
    if name == "pipeline":
        cols = ["pipeline", "wrapper", "world_size", "repeat", "threads_per_rank", "samples", "seconds",
                "samples_per_s", "speedup_vs_seed", "test_accuracy"]
        return [("input pipeline (one epoch, Linear(784, 10), batch 64 per rank)", pd.DataFrame(result)[cols])]
    if name == "scaling":
        cols = ["mode", "model", "global_batch_size", "world_size", "threads_per_rank", "oversubscribed",
                "step_ms", "solo_step_ms", "nosync_step_ms", "comm_exposed_ms", "samples_per_s", "speedup",
                "efficiency"]
        df = pd.DataFrame(result)[cols].sort_values(["model", "global_batch_size", "mode", "world_size",
                                                      "threads_per_rank"])
        return [("scaling (speedup and efficiency against DDP with 1 rank, 1 thread)", df)]
    if name == "allreduce":
        cols = ["world_size", "bytes", "iters", "seconds", "algbw_GBps", "busbw_GBps", "copy_GBps", "busbw_over_copy"]
        return [("all-reduce (busbw = algbw * 2(n-1)/n)", pd.DataFrame(result["allreduce"])[cols]),
                ("memory copy (this process)", pd.DataFrame(result["memcpy"]))]
    if name == "launch":
        df = pd.DataFrame(result).groupby(["method", "world_size"])["seconds"].agg(["median", "min", "max", "count"])
        tables = [("launch overhead: seconds from call to results, trivial worker", df.reset_index())]
        med = df["median"].to_dict()
        cold, warm = med.get(("helpers.launch", 2)), med.get((WARM_RUN, 2))
        if cold and warm:
            tables.append(("warm ranks against a cold launch, 2 ranks (medians)", pd.DataFrame([{
                "start_ranks_s": med.get((WARM_START, 2)), "cold_launch_s": cold, "warm_run_s": warm,
                "warm_speedup_x": cold / warm}])))
        return tables
    if name == "memory":
        df = pd.DataFrame(result)
        per = df.groupby(["variant", "world_size"]).agg(
            peak_rss_mib_per_rank=("peak_rss_mib", "max"), sum_uss_mib=("uss_mib", "sum"),
            sum_pss_mib=("pss_mib", "sum"), dataset_mib_per_rank=("dataset_mib", "max")).reset_index()
        return [("memory per rank (MiB)", df[["variant", "world_size", "rank", "peak_rss_mib", "rss_mib",
                                             "uss_mib", "pss_mib", "dataset_mib"]]),
                ("memory summed over ranks (MiB)", per)]
    if name == "buckets":
        cols = ["bucket_cap_mb", "gradient_as_bucket_view", "n_buckets", "step_ms"]
        tl = timeline_overlap(result["timeline"]) if result["timeline"] else {}
        return [(f"DDP buckets (mlp, {MLP_PARAMS / 1e6:.1f} M parameters)", pd.DataFrame(result["rows"])[cols]),
                ("all-reduce overlapping backward (profiler, rank 0)", pd.DataFrame([tl]))]
    return []


def run_benchmarks(names: Sequence[str] = BENCHMARKS, profile: str = "full",
                   out_dir: str | os.PathLike | None = DEFAULT_OUT, verbose: bool = True) -> dict[str, Any]:
    """Run benchmarks by name with a profile's sizes; print tables; write ``<out_dir>/<name>.json``.

    Each JSON file holds ``{"benchmark", "profile", "config", "machine_before", "load_after",
    "seconds", "result"}``.

    Returns:
        ``{name: result}``.

    Raises:
        ValueError: unknown benchmark or profile.
    """
    cfg_all = profile_config(profile)
    for n in names:
        if n not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {n!r}; choose from {BENCHMARKS}")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        machine = machine_info()
        t0 = time.perf_counter()
        result = _run_one(name, cfg_all[name])
        seconds = time.perf_counter() - t0
        results[name] = result
        if verbose:
            import pandas as pd

            with pd.option_context("display.width", 200, "display.max_columns", 30,
                                   "display.float_format", "{:,.4g}".format):
                for title, df in _tables(name, result):
                    print(f"\n== {name}: {title}")
                    print(df.to_string(index=False))
            print(f"({name}: {seconds:.1f} s; load average before {machine['load_average']}, "
                  f"after {list(os.getloadavg())})")
        if out is not None:
            payload = {"benchmark": name, "profile": profile, "config": cfg_all[name], "machine_before": machine,
                       "load_after": list(os.getloadavg()), "seconds": seconds, "result": result}
            path = out / f"{name}.json"
            path.write_text(json.dumps(payload, indent=1, default=str))
            if verbose:
                print(f"wrote {path}")
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.bench [NAME ...] [--profile smoke|full] [--out DIR]``."""
    p = argparse.ArgumentParser(prog="python -m helpers.bench", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    p.add_argument("--profile", choices=sorted(PROFILES), default="full", help="sizes (default: full)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the JSON files (default: build/bench)")
    a = p.parse_args(argv)
    for n in a.names:
        if n not in BENCHMARKS:
            p.error(f"unknown benchmark {n!r}; choose from {', '.join(BENCHMARKS)}")
    run_benchmarks(a.names or BENCHMARKS, a.profile, a.out)
    return 0


if __name__ == "__main__":
    # Run the copy of this module imported as ``helpers.bench``, not ``__main__``: spawned workers
    # import their function by module name, and ``__main__`` is not importable in them.
    from helpers.bench import main as _main

    sys.exit(_main())
