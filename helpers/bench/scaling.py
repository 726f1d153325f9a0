"""Scaling: training samples/s by world size, threads per rank, model and global batch (notebook 05a).

Every mode runs in **one** launch of ``max(world_size)`` ranks, the modes timed in alternation
(:func:`helpers.bench.common.run_interleaved`). A DDP configuration with ``world_size`` ranks runs
on the first ranks through a process subgroup (``dist.new_group``) while the others wait at a
barrier; a single process and ``nn.DataParallel`` run on rank 0 alone.

Units: seconds (s), milliseconds (ms), samples per second (samples/s), MiB (2**20 bytes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.bench.common import (
    MIB,
    batch_fn,
    build_bench_model,
    ddp_wrap,
    median,
    run_interleaved,
    spread,
    timed_block,
)
from helpers.data import load_mnist
from helpers.engine import launch, worker_device
from helpers.mnist_train import peak_rss_mib


def scaling_worker(rank: int, world_size: int, configs: Sequence[Sequence[int]] = ((1, 1), (2, 1)),
                   models: Sequence[str] = ("linear", "cnn"), global_batch_sizes: Sequence[int] = (64, 256, 1024),
                   steps: int = 5, warmup: int = 3, rounds: int = 4, local_threads: Sequence[int] = (),
                   seed: int = 0, lr: float = 0.01) -> list[dict[str, Any]]:
    """One rank of the scaling benchmark; run it with ``launch(scaling_worker, max_world_size, configs)``.

    Each rank loads MNIST into memory (its own copy). For every model and global batch size it
    sets up every mode, warms each up (``warmup`` untimed steps), then times ``rounds`` rounds;
    a round is one block of ``steps`` steps of every mode, in the same order:

    * ``"ddp WxT"`` for each ``(W, T)`` in ``configs`` (``W`` at most this launch's world size):
      DDP on ranks ``0..W-1`` (a subgroup when ``W < world_size``), ``T`` torch threads each,
      ``global_batch // W`` images per rank per step; ``"ddp WxT no_sync"``, the same steps in
      ``ddp.no_sync()`` (no all-reduce, no wait for the slowest rank); for ``W > 1``,
      ``"ddp WxT solo"``, one rank's share on rank 0 **alone** while the others wait;
    * ``"single T"`` and ``"dp T"`` for each ``T`` in ``local_threads``: the plain model and
      ``nn.DataParallel`` on rank 0 with the whole global batch.

    Returns:
        the same list on every rank: one row per (model, global batch, mode): ``label``, ``mode``,
        ``model``, ``global_batch_size``, ``rank``, ``world_size`` (the mode's), ``member``,
        ``threads_per_rank``, ``steps``, ``rounds``, ``step_s_median``/``_mean``/``_min``/``_max``
        (this rank's, s; ``None`` where it took no part), ``nosync_step_s_median``,
        ``solo_step_s_median``, ``timed_order``, ``dp_device_ids``, ``peak_rss_mib``,
        ``dataset_mib`` (from the shapes), ``dataset_storage_mib`` (allocated) and
        ``dataset_rss_growth_mib`` (the RSS the load added), MiB.

    Raises:
        ValueError: a world size above this launch's, or a global batch size not divisible by one.
    """
    for ws, _ in configs:
        if int(ws) > world_size:
            raise ValueError(f"configuration world_size={ws} needs at least {ws} ranks, this launch has {world_size}")
        for gb in global_batch_sizes:
            if gb % int(ws):
                raise ValueError(f"global_batch_size={gb} is not divisible by world_size={ws}")
    device = worker_device()
    rss_before = psutil.Process().memory_info().rss
    x, y = load_mnist(train=True)
    rss_growth_mib = (psutil.Process().memory_info().rss - rss_before) / MIB  # resident pages it now holds
    dataset_mib = (x.numel() * x.element_size() + y.numel() * y.element_size()) / MIB
    storage_mib = (x.untyped_storage().nbytes() + y.untyped_storage().nbytes()) / MIB  # what was allocated
    x, y = x.to(device), y.to(device)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed)).to(device)
    # every rank creates every subgroup, in the same order (dist.new_group is collective)
    groups = {ws: dist.new_group(list(range(ws))) for ws in sorted({int(w) for w, _ in configs}) if ws < world_size}
    rows = []
    for name in models:
        for gb in global_batch_sizes:
            blocks: dict[str, Callable | None] = {}
            meta: dict[str, dict[str, Any]] = {}
            for ws, t in ((int(w), int(t)) for w, t in configs):
                label = f"ddp {ws}x{t}"
                member = rank < ws
                meta[label] = {"mode": "ddp", "world_size": ws, "threads": t, "member": member}
                if member:
                    ddp = ddp_wrap(build_bench_model(name, seed), device, process_group=groups.get(ws))
                    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
                    batch = batch_fn(x, y, perm, gb, rank, ws)
                    blocks[label] = timed_block(ddp, opt, batch, steps, device, t)
                    blocks[label + " no_sync"] = timed_block(ddp, opt, batch, steps, device, t, sync=False)
                else:
                    blocks[label] = blocks[label + " no_sync"] = None
                if ws > 1:  # one rank's share, on rank 0 alone
                    plain = build_bench_model(name, seed).to(device)
                    blocks[label + " solo"] = (timed_block(plain, torch.optim.SGD(plain.parameters(), lr=lr),
                                                      batch_fn(x, y, perm, gb, 0, ws), steps, device, t)
                                               if rank == 0 else None)
            for mode, t in ((m, t) for m in ("single", "dp") for t in sorted(set(local_threads))):
                label = f"{mode} {t}"
                meta[label] = {"mode": mode, "world_size": 1, "threads": t, "member": rank == 0}
                blocks[label] = None
                if rank == 0:  # the whole global batch in one process
                    model = build_bench_model(name, seed).to(device)
                    if mode == "dp":  # on a CPU: device_ids == [], it just calls the module
                        model = nn.DataParallel(model)
                        meta[label]["dp_device_ids"] = list(model.device_ids)
                    blocks[label] = timed_block(model, torch.optim.SGD(model.parameters(), lr=lr),
                                           batch_fn(x, y, perm, gb, 0, 1), steps, device, t)
            times, order = run_interleaved(blocks, rounds, warmup, barrier=dist.barrier)
            for label, m in meta.items():
                rows.append({
                    "label": label, "mode": m["mode"], "model": name, "global_batch_size": gb, "rank": rank,
                    "world_size": m["world_size"], "member": m["member"], "threads_per_rank": m["threads"],
                    "device": str(device), "steps": steps, "rounds": rounds,
                    **spread(times.get(label, []), "step_s"),
                    "nosync_step_s_median": median(times.get(label + " no_sync")),
                    "solo_step_s_median": median(times.get(label + " solo")),
                    "timed_order": order, "dp_device_ids": m.get("dp_device_ids"),
                })
    peak = peak_rss_mib()
    for r in rows:
        r.update(peak_rss_mib=peak, dataset_mib=dataset_mib, dataset_storage_mib=storage_mib,
                 dataset_rss_growth_mib=rss_growth_mib)
    return rows


def bench_scaling(configs: Sequence[Sequence[int]] = ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1)),
                  models: Sequence[str] = ("linear", "cnn"), global_batch_sizes: Sequence[int] = (64, 256, 1024),
                  steps: int = 5, warmup: int = 3, rounds: int = 4, local: bool = True, seed: int = 0,
                  timeout: float = 900.0) -> list[dict[str, Any]]:
    """DDP samples/s for each ``(world_size, threads_per_rank)`` in ``configs`` plus, if ``local``,
    a single process and ``nn.DataParallel`` (1 thread and ``cpu_count`` threads), all in one
    launch of ``max(world_size)`` ranks, timed in alternation (see :func:`scaling_worker`).

    Returns:
        one row per (mode, world size, threads, model, global batch): ``label``, ``mode``
        (``"ddp"``, ``"single"``, ``"dp"``), ``world_size``, ``threads_per_rank``, ``total_threads``,
        ``oversubscribed`` (more threads than logical CPUs), ``model``, ``global_batch_size``,
        ``step_ms`` (the slowest rank's **median** step), ``step_ms_mean``, ``step_ms_min``,
        ``step_ms_max`` (over the taking-part ranks, the largest fastest and slowest step),
        ``samples_per_s`` and its ``_min`` / ``_max``, ``solo_step_ms`` (one rank's share alone;
        with one rank: ``nosync_step_ms``), ``nosync_step_ms`` (no all-reduce),
        ``interference_ms`` (``nosync - solo``), ``comm_exposed_ms`` (``step - nosync``),
        ``speedup`` and ``efficiency`` (``speedup / world_size``) against DDP with 1 rank and 1
        thread, ``steps``, ``rounds``, ``timed_order``, ``dp_device_ids``,
        ``peak_rss_mib_per_rank``, ``dataset_mib_per_rank``, ``dataset_storage_mib_per_rank``
        and ``dataset_rss_growth_mib_per_rank`` (MiB), ``launch_seconds``. Times in ms.

    Raises:
        ValueError: a global batch size not divisible by a world size (before any launch).
    """
    for ws, _ in configs:
        bad = [gb for gb in global_batch_sizes if gb % int(ws)]
        if bad:
            raise ValueError(f"global_batch_size {bad} not divisible by world_size={ws}: every rank must "
                             f"take the same share of each global batch")
    cpus = os.cpu_count() or 1
    t0 = time.perf_counter()
    per_rank = launch(scaling_worker, max(int(ws) for ws, _ in configs), [list(c) for c in configs], list(models),
                      list(global_batch_sizes), steps, warmup, rounds, sorted({1, cpus}) if local else [], seed,
                      timeout=timeout)
    launch_s = time.perf_counter() - t0
    out = []
    for i, r0 in enumerate(per_rank[0]):
        ranks = [pr[i] for pr in per_rank if pr[i]["member"]]
        ws, t = r0["world_size"], r0["threads_per_rank"]
        step = max(r["step_s_median"] for r in ranks)  # the slowest rank sets the pace
        lo, hi = max(r["step_s_min"] for r in ranks), max(r["step_s_max"] for r in ranks)
        nosync = max(r["nosync_step_s_median"] for r in ranks) if r0["nosync_step_s_median"] is not None else None
        solo = r0["solo_step_s_median"] if r0["solo_step_s_median"] is not None else (nosync if ws == 1 else None)
        out.append({
            "label": r0["label"], "mode": r0["mode"], "world_size": ws, "threads_per_rank": t,
            "total_threads": ws * t, "oversubscribed": ws * t > cpus, "model": r0["model"],
            "global_batch_size": r0["global_batch_size"], "device": r0["device"],
            "step_ms": step * 1e3, "step_ms_mean": max(r["step_s_mean"] for r in ranks) * 1e3,
            "step_ms_min": lo * 1e3, "step_ms_max": hi * 1e3,
            "samples_per_s": r0["global_batch_size"] / step,
            "samples_per_s_min": r0["global_batch_size"] / hi, "samples_per_s_max": r0["global_batch_size"] / lo,
            "solo_step_ms": solo * 1e3 if solo is not None else None,
            "nosync_step_ms": nosync * 1e3 if nosync is not None else None,
            "interference_ms": (nosync - solo) * 1e3 if solo is not None and nosync is not None else None,
            "comm_exposed_ms": (step - nosync) * 1e3 if nosync is not None else None,
            "steps": r0["steps"], "rounds": r0["rounds"], "timed_order": r0["timed_order"],
            "dp_device_ids": r0["dp_device_ids"],
            "peak_rss_mib_per_rank": max(r["peak_rss_mib"] for r in ranks),
            "dataset_mib_per_rank": r0["dataset_mib"],
            "dataset_storage_mib_per_rank": min(r["dataset_storage_mib"] for r in ranks),
            "dataset_rss_growth_mib_per_rank": min(r["dataset_rss_growth_mib"] for r in ranks),
            "launch_seconds": launch_s,
        })
    base = {(r["model"], r["global_batch_size"]): r["samples_per_s"] for r in out
            if r["mode"] == "ddp" and r["world_size"] == 1 and r["threads_per_rank"] == 1}
    for r in out:
        b = base.get((r["model"], r["global_batch_size"]))
        r["speedup"] = r["samples_per_s"] / b if b else None
        r["efficiency"] = r["speedup"] / r["world_size"] if b else None
    return out
