"""Memory: every rank holding its own copy of MNIST, against ranks sharing one read-only map.

Units: MiB (2**20 bytes), seconds (s).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from helpers.bench.common import MIB, build_bench_model, ddp_wrap, memory_now_mib, train_step
from helpers.data import MNIST_FILES, MNIST_MEAN, MNIST_STD, ensure_mnist, load_mnist
from helpers.engine import launch
from helpers.mnist_train import peak_rss_mib


def _mmap_split(train: bool):
    """uint8 images ``(N, 28, 28)`` and labels ``(N,)`` mapped copy-on-write from the raw IDX
    files: the pages are the page cache's, shared by every process that maps the file."""
    raw = Path(ensure_mnist()) / "MNIST" / "raw"
    prefix = "train" if train else "t10k"
    n = MNIST_FILES[f"{prefix}-images-idx3-ubyte"].count
    imgs = np.memmap(raw / f"{prefix}-images-idx3-ubyte", dtype=np.uint8, mode="c", offset=16, shape=(n, 28, 28))
    labs = np.memmap(raw / f"{prefix}-labels-idx1-ubyte", dtype=np.uint8, mode="c", offset=8, shape=(n,))
    return torch.from_numpy(imgs), torch.from_numpy(labs)


def memory_worker(rank: int, world_size: int, variant: str = "private", steps: int = 100,
                  batch_per_rank: int = 64, threads: int | None = 1, seed: int = 0) -> dict[str, Any]:
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
    if threads:
        torch.set_num_threads(int(threads))
    if variant == "private":
        xtr, ytr = load_mnist(train=True)
        xte, yte = load_mnist(train=False)

        def get(idx):
            return xtr[idx], ytr[idx]
    elif variant == "mmap":
        xtr, ytr = _mmap_split(True)
        xte, yte = _mmap_split(False)

        def get(idx):
            x = xtr[idx].unsqueeze(1).float().mul_(1.0 / (255.0 * MNIST_STD)).sub_(MNIST_MEAN / MNIST_STD)
            return x, ytr[idx].long()
    else:
        raise ValueError(f"variant must be 'private' or 'mmap', got {variant!r}")
    dataset_mib = sum(t.numel() * t.element_size() for t in (xtr, ytr, xte, yte)) / MIB
    model = ddp_wrap(build_bench_model("linear", seed), torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    perm = torch.randperm(xtr.shape[0], generator=torch.Generator().manual_seed(seed))
    mine = perm[rank::world_size]
    for s in range(steps):
        idx = mine[(s * batch_per_rank) % max(1, mine.numel() - batch_per_rank):][:batch_per_rank]
        train_step(model, opt, *get(idx))
    # every rank touches every page of its data once (as an epoch would), then we measure
    checksum = float(xtr.reshape(xtr.shape[0], -1)[:, ::512].float().sum()) + float(xte.float().sum())
    dist.barrier()  # every rank holds its data (and maps) while every rank measures
    now = memory_now_mib()
    dist.barrier()
    return {"variant": variant, "rank": rank, "world_size": world_size, "peak_rss_mib": peak_rss_mib(),
            **now, "dataset_mib": dataset_mib, "checksum": checksum}


def bench_memory(world_sizes: Sequence[int] = (1, 2, 4), variants: Sequence[str] = ("private", "mmap"),
                 steps: int = 100, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Per-rank memory for each world size and variant (one launch each, backend gloo: the
    data lives in host memory).

    Returns:
        the rows of :func:`memory_worker` for every rank, with ``launch_seconds`` added.
    """
    rows = []
    for ws in world_sizes:
        for v in variants:
            t0 = time.perf_counter()
            got = launch(memory_worker, ws, v, steps, backend="gloo", timeout=timeout)  # host memory: CPU
            rows += [{**r, "launch_seconds": time.perf_counter() - t0} for r in got]
    return rows
