"""All-reduce bandwidth (algbw, busbw) and the memory-copy bandwidth it is bounded by on one host.

Units: bytes, seconds (s), GB/s (1e9 bytes/s), KiB/MiB (2**10/2**20 bytes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from helpers.bench.common import KIB, MIB, num_threads, sync_device
from helpers.costmodel import algbw as _algbw
from helpers.costmodel import busbw as _busbw
from helpers.ddp_tools import bytes_written as _bytes_written
from helpers.engine import launch, worker_device


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
    the ring formula ``2(n-1)/n * S`` that defines busbw (notebook 05b compares the two).

    Returns:
        rank 0: one row per size: ``bytes``, ``world_size``, ``iters``, ``seconds`` (one
        all-reduce, s), ``algbw_GBps`` (``S / t``, GB/s), ``busbw_GBps`` (``algbw * 2(n-1)/n``,
        GB/s), ``sent_bytes_per_call`` (list, one per rank: bytes written per all-reduce,
        measured; ``None`` where ``/proc/self/io`` is missing, or on GPUs, where NCCL does not
        go through system calls), ``backend``, ``threads_per_rank``; other ranks: ``[]``.
    """
    if threads:
        torch.set_num_threads(int(threads))
    device = worker_device()
    rows = []
    for nbytes in sizes_bytes:
        t = torch.zeros(max(1, int(nbytes) // 4), dtype=torch.float32, device=device)
        iters = _iters_for(int(nbytes), target_bytes, min_iters, max_iters)
        for _ in range(warmup):
            dist.all_reduce(t)
        sync_device(device)
        dist.barrier()
        written0 = _bytes_written()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        sync_device(device)
        elapsed = time.perf_counter() - t0
        written1 = _bytes_written()
        sent = (written1 - written0) / iters if None not in (written0, written1) else -1.0
        per_call = torch.tensor([elapsed / iters], dtype=torch.float64, device=device)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
        sent_all = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
        dist.all_gather(sent_all, torch.tensor([sent], dtype=torch.float64, device=device))
        seconds, size = float(per_call.item()), t.numel() * t.element_size()
        a, sent_bytes = _algbw(size, seconds), [float(x.item()) for x in sent_all]
        rows.append({"bytes": size, "world_size": world_size, "iters": iters, "seconds": seconds,
                     "algbw_GBps": a / 1e9, "busbw_GBps": _busbw(a, world_size) / 1e9,
                     "sent_bytes_per_call": None if device.type == "cuda" or min(sent_bytes) < 0 else sent_bytes,
                     "backend": dist.get_backend(), "threads_per_rank": torch.get_num_threads()})
    return rows if rank == 0 else []


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
    with num_threads(threads):
        for nbytes in sizes_bytes:
            n = max(1, int(nbytes) // 4)
            src = torch.rand(n, device=dev)
            dst = torch.empty_like(src)
            iters = _iters_for(int(nbytes), target_bytes, repeats_min, 2000)
            for _ in range(3):
                dst.copy_(src)
            sync_device(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            sync_device(dev)
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
    sizes = [int(k) * KIB for k in sizes_kib]
    copy = memcpy_bandwidth(sizes, threads=threads)
    by_size = {r["bytes"]: r["copy_GBps"] for r in copy}
    rows = [r for ws in world_sizes for r in launch(allreduce_worker, ws, sizes, threads=threads, timeout=timeout)[0]]
    for r in rows:
        r["copy_GBps"] = by_size.get(r["bytes"])
        r["busbw_over_copy"] = r["busbw_GBps"] / r["copy_GBps"] if r["copy_GBps"] else None
    return {"allreduce": rows, "memcpy": copy}

