"""DDP gradient buckets (``bucket_cap_mb``, ``gradient_as_bucket_view``) against step time, and a
``torch.profiler`` timeline of all-reduce overlapping backward (notebook 05b).

Units: milliseconds (ms), seconds (s), MB (1e6 bytes), MiB (2**20 bytes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.profiler import ProfilerActivity, profile, record_function

from helpers.bench.common import (
    build_bench_model,
    ddp_wrap,
    run_interleaved,
    spread,
    sync_device,
    timed_block,
    train_step,
)
from helpers.engine import launch, worker_device


def _counting_hook(state: dict, bucket):
    """A DDP communication hook (public API) that records each bucket's size and the sizes of the
    tensors in it (``bucket.parameters()``, in bucket order), then all-reduces it exactly as DDP's
    default does (``allreduce_hook``: divide by world size, then all-reduce with SUM)."""
    buf = bucket.buffer()
    state["bytes"].append(buf.numel() * buf.element_size())
    state["tensor_bytes"].append([p.numel() * p.element_size() for p in bucket.parameters()])
    return allreduce_hook(None, bucket)


def _bucket_layout_steps(model_name: str, seed: int, cap_mb: float | None, view: bool, x, y,
                         device) -> list[dict[str, list]]:
    """The buckets DDP all-reduces in each of two steps with this cap, read with a comm hook on a
    throw-away DDP model: ``[first step, second step]``, each ``{"bytes": [bucket bytes, ...],
    "tensor_bytes": [[bytes of each tensor in the bucket], ...]}`` in all-reduce order. The first
    step runs on DDP's initial layout; DDP then rebuilds its buckets in the order the gradients
    arrived. ``cap_mb=None`` leaves ``bucket_cap_mb`` at DDP's default (the argument is not passed)."""
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    ddp = ddp_wrap(build_bench_model(model_name, seed), device, gradient_as_bucket_view=view, **kwargs)
    state: dict[str, list] = {}
    ddp.register_comm_hook(state, _counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    steps = []
    for _ in range(2):
        state["bytes"], state["tensor_bytes"] = [], []
        train_step(ddp, opt, x, y)
        steps.append({"bytes": list(state["bytes"]), "tensor_bytes": list(state["tensor_bytes"])})
    return steps


def _allreduce_after_backward_step(ddp, opt, x, y, bucket_tensor_bytes: Sequence[Sequence[int]]) -> None:
    """One step **without overlap**, for comparison with DDP's: forward and backward inside
    ``ddp.no_sync()`` (no all-reduce during backward), then the same buckets (``bucket_tensor_bytes``,
    DDP's rebuilt layout: tensors in gradient-arrival order) flattened, divided by the world size
    and all-reduced one after another, copied back, then the optimizer step.

    Raises:
        ValueError: the layout does not match the model's gradients (sizes in bytes)."""
    opt.zero_grad(set_to_none=True)
    with ddp.no_sync():
        F.cross_entropy(ddp(x), y).backward()
    grads = [p.grad for p in reversed(list(ddp.module.parameters()))]  # arrival order: last layer first
    i = 0
    for bucket in bucket_tensor_bytes:
        gs = grads[i:i + len(bucket)]
        i += len(bucket)
        if [g.numel() * g.element_size() for g in gs] != list(bucket):
            raise ValueError(f"bucket layout {list(bucket)} does not match the gradients "
                             f"{[g.numel() * g.element_size() for g in gs]}")
        flat = torch.cat([g.reshape(-1) for g in gs]).div_(dist.get_world_size())
        dist.all_reduce(flat)
        off = 0
        for g in gs:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
    opt.step()


_COMM_MARKERS = ("gloo:all_reduce", "nccl:all_reduce", "ncclDevKernel_AllReduce", "ncclKernel_AllReduce")


def _lane(name: str) -> str | None:
    """The timeline lane of a profiler event's name (``None``: not shown)."""
    if name == "DistributedDataParallel.forward":
        return "forward"
    if name.startswith("autograd::engine::evaluate_function:"):
        return "backward"
    if name.startswith("Optimizer.step"):
        return "optimizer"
    if name == "c10d::allreduce_":
        return "allreduce launched"
    if any(m in name for m in _COMM_MARKERS):
        return "allreduce"
    return "step" if name.startswith(("ProfilerStep", "step ")) else None


def _timeline_from_profile(prof) -> list[dict[str, Any]]:
    """Flatten profiler events into lanes: forward, backward ops, optimizer, all-reduce (launch
    on the main thread; execution on the backend's threads or GPU streams); times in ms from the
    first event shown."""
    shown = [(kind, e) for e in prof.events() if (kind := _lane(e.name))]
    t0 = min((e.time_range.start for _, e in shown), default=0)
    rows = [{"kind": kind, "name": e.name, "thread": int(e.thread), "start_ms": (e.time_range.start - t0) / 1e3,
             "dur_ms": (e.time_range.end - e.time_range.start) / 1e3,
             "device": "cuda" if "CUDA" in str(getattr(e, "device_type", "")) else "cpu"} for kind, e in shown]
    return sorted(rows, key=lambda r: r["start_ms"])


def _union_ms(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Length (ms) of the union of ``(start, end)`` intervals, clipped to ``[lo, hi]``."""
    total, reach = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b > a and b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def timeline_overlap(timeline: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the all-reduce did relative to backward, per profiled step of :func:`bucket_worker`.

    For each step (``kind == "step"`` windows), backward spans from its first backward op's start
    to its last one's end on the main thread. All-reduce events (``kind == "allreduce"``: a
    backend thread busy with one call, **including any wait for the other ranks**) may run on
    several threads at once, so times are of their union ("some all-reduce is running").

    Returns:
        ``allreduce_ms`` (summed event durations), ``overlapped_ms`` (summed, inside backward),
        ``overlap_fraction`` (their ratio, in [0, 1]; ``None`` without all-reduce events),
        ``busy_ms`` (union over the steps), ``busy_in_backward_ms``, ``busy_after_backward_ms``
        (union after the last backward op ended: what the step waited for once its gradients
        were computed), ``step_ms`` (list: each step window's duration), ``launches``
        (all-reduce calls made), ``launched_early`` (calls launched before the step's last
        backward op started: with ``k`` DDP buckets a step has ``k - 1``), ``launched_early_per_step``
        (list: that count for each step), ``backward_ms`` (summed backward spans), ``steps``. Times in ms.
    """
    steps = [r for r in timeline if r["kind"] == "step"]
    if not steps:
        steps = [{"start_ms": min((r["start_ms"] for r in timeline), default=0.0),
                  "dur_ms": max((r["start_ms"] + r["dur_ms"] for r in timeline), default=0.0)}]
    total = overlapped = backward = busy = busy_in = busy_after = 0.0
    early = launches = 0
    step_ms, early_per_step = [], []
    for s in steps:
        lo, hi = s["start_ms"], s["start_ms"] + s["dur_ms"]
        inside = [r for r in timeline if lo <= r["start_ms"] < hi and r["kind"] != "step"]
        bw = [r for r in inside if r["kind"] == "backward"]
        if not bw:
            continue
        step_ms.append(s["dur_ms"])
        b0 = min(r["start_ms"] for r in bw)
        b1 = max(r["start_ms"] + r["dur_ms"] for r in bw)
        last_start = max(r["start_ms"] for r in bw)
        backward += b1 - b0
        comm = [(r["start_ms"], r["start_ms"] + r["dur_ms"]) for r in inside if r["kind"] == "allreduce"]
        end = max([hi] + [c1 for _, c1 in comm])
        busy += _union_ms(comm, lo, end)
        busy_in += _union_ms(comm, b0, b1)
        busy_after += _union_ms(comm, b1, end)
        for a0, a1 in comm:
            total += a1 - a0
            overlapped += max(0.0, min(a1, b1) - max(a0, b0))
        launched = [r["start_ms"] for r in inside if r["kind"] == "allreduce launched"]
        launches += len(launched)
        early_per_step.append(sum(t < last_start for t in launched))
        early += early_per_step[-1]
    return {"allreduce_ms": total, "overlapped_ms": overlapped,
            "overlap_fraction": overlapped / total if total > 0 else None,
            "busy_ms": busy, "busy_in_backward_ms": busy_in, "busy_after_backward_ms": busy_after,
            "step_ms": step_ms, "launches": launches, "launched_early": early,
            "launched_early_per_step": early_per_step, "backward_ms": backward,
            "steps": len(step_ms)}


def bucket_worker(rank: int, world_size: int, bucket_caps_mb: Sequence[float] = (1.0, 25.0),
                  as_view: Sequence[bool] = (False, True), model: str = "mlp", batch_per_rank: int = 64,
                  steps: int = 10, warmup: int = 3, threads: int | None = 1, seed: int = 0,
                  profile_cap_mb: float | None = 1.0, profile_steps: int = 2,
                  rounds: int = 5) -> dict[str, Any]:
    """One rank of the bucket benchmark; run it with ``launch(bucket_worker, ws, ...)``.

    For every ``bucket_cap_mb`` (MiB) and ``gradient_as_bucket_view``: read the bucket layout
    with a counting communication hook (``register_comm_hook``, public API) on a throw-away DDP
    model, and build a fresh DDP model (no hook). Then time them all in alternation
    (:func:`~helpers.bench.common.run_interleaved`: ``warmup`` untimed steps of every
    configuration, then ``rounds`` rounds of one block of ``max(1, steps // rounds)`` steps per
    configuration), on a fixed random batch ``(batch_per_rank, 1, 28, 28)`` (the data does not
    change the step time), so a drift of the machine spreads over every cap. Then, if
    ``profile_cap_mb`` is set, profile ``profile_steps`` steps with ``torch.profiler`` on rank 0
    (all ranks run them), twice on the same model, buckets and batch: DDP's own steps (all-reduce
    launched during backward: ``timeline``) and the same buckets all-reduced only after backward
    (:func:`_allreduce_after_backward_step`: ``timeline_after_backward``).

    Returns:
        ``rows``: one per (cap, view): ``bucket_cap_mb``, ``gradient_as_bucket_view``,
        ``n_buckets``, ``bucket_mb`` (MB of each bucket, all-reduce order),
        ``bucket_tensor_bytes`` (each bucket's tensors' bytes), ``first_step_bucket_mb`` (on
        DDP's initial layout), ``step_s_median``/``_mean``/``_min``/``_max`` (s), ``timed_order``
        (the ``"cap/view"`` label of every timed block, in order), ``rank``, ``world_size``,
        ``threads_per_rank``, ``model``, ``n_params``; ``timeline`` and
        ``timeline_after_backward`` (rank 0's, else ``None``; rows ``kind``, ``name``,
        ``thread``, ``start_ms``, ``dur_ms``, ``device``), ``profile_bucket_mb`` (the profiled
        model's buckets, MB), ``default_cap_bucket_mb`` and ``default_cap_bucket_tensor_bytes``
        (the layout with ``bucket_cap_mb`` not passed: DDP's default).
    """
    if threads:
        torch.set_num_threads(int(threads))
    device = worker_device()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(batch_per_rank, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (batch_per_rank,), generator=g).to(device)
    n_params = sum(p.numel() for p in build_bench_model(model, seed).parameters())
    configs = [(cap, bool(view)) for cap in bucket_caps_mb for view in as_view]
    layouts, blocks = {}, {}
    block_steps = max(1, steps // max(1, rounds))

    for cap, view in configs:
        label = f"{cap:g}/{view}"
        layouts[label] = _bucket_layout_steps(model, seed, cap, view, x, y, device)
        ddp = ddp_wrap(build_bench_model(model, seed), device, bucket_cap_mb=cap, gradient_as_bucket_view=view)
        blocks[label] = timed_block(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), lambda s: (x, y), block_steps,
                                    device, None)
    times, order = run_interleaved(blocks, rounds, warmup=warmup, barrier=dist.barrier)
    rows = []
    for cap, view in configs:
        label, t = f"{cap:g}/{view}", times[f"{cap:g}/{view}"]
        first, rebuilt = layouts[label]
        rows.append({"bucket_cap_mb": cap, "gradient_as_bucket_view": view, "n_buckets": len(rebuilt["bytes"]),
                     "bucket_mb": [b / 1e6 for b in rebuilt["bytes"]], "bucket_tensor_bytes": rebuilt["tensor_bytes"],
                     "first_step_bucket_mb": [b / 1e6 for b in first["bytes"]], **spread(t, "step_s"),
                     "timed_order": order, "rank": rank, "world_size": world_size,
                     "threads_per_rank": torch.get_num_threads(), "model": model, "n_params": n_params})
    blocks.clear()  # free the timed models before the profiled one
    default_layout = _bucket_layout_steps(model, seed, None, False, x, y, device)[1]
    timeline = timeline_serial = profile_layout = None
    if profile_cap_mb:
        rebuilt = _bucket_layout_steps(model, seed, profile_cap_mb, False, x, y, device)[1]
        profile_layout = rebuilt["bytes"]
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silence the profiler library's own log lines

        ddp = ddp_wrap(build_bench_model(model, seed), device, bucket_cap_mb=profile_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        variants = {"overlap": lambda: train_step(ddp, opt, x, y),
                    "after_backward": lambda: _allreduce_after_backward_step(ddp, opt, x, y, rebuilt["tensor_bytes"])}
        for step in variants.values():
            for _ in range(warmup):
                step()
        timelines = {}
        for name, step in variants.items():  # the same model, buckets and batch: with and without overlap
            dist.barrier()
            if rank == 0:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    for s in range(profile_steps):
                        with record_function(f"step {s}"):
                            step()
                        sync_device(device)
                timelines[name] = _timeline_from_profile(prof)
            else:
                for _ in range(profile_steps):
                    step()
                sync_device(device)
        timeline, timeline_serial = timelines.get("overlap"), timelines.get("after_backward")
    return {"rows": rows, "timeline": timeline, "timeline_after_backward": timeline_serial,
            "profile_bucket_mb": [b / 1e6 for b in profile_layout] if profile_layout is not None else None,
            "default_cap_bucket_mb": [b / 1e6 for b in default_layout["bytes"]],
            "default_cap_bucket_tensor_bytes": default_layout["tensor_bytes"]}


def bench_buckets(world_size: int = 2, bucket_caps_mb: Sequence[float] = (1.0, 25.0),
                  as_view: Sequence[bool] = (False, True), steps: int = 10, warmup: int = 3,
                  profile_cap_mb: float | None = 1.0, timeout: float = 900.0, rounds: int = 5) -> dict[str, Any]:
    """The bucket sweep in one launch of ``world_size`` ranks, configurations timed in
    alternation (``rounds`` blocks each; see :func:`bucket_worker`).

    Returns:
        rank 0's result of :func:`bucket_worker`, each row with ``step_ms`` (the slowest rank's
        median step, ms) and ``step_ms_min`` / ``step_ms_max`` (the fastest and slowest timed
        step on any rank, ms) added.
    """
    got = launch(bucket_worker, world_size, list(bucket_caps_mb), list(as_view), steps=steps, warmup=warmup,
                 profile_cap_mb=profile_cap_mb, rounds=rounds, timeout=timeout)
    rows = []
    for i, r0 in enumerate(got[0]["rows"]):
        r = dict(r0)
        r["step_ms"] = max(g["rows"][i]["step_s_median"] for g in got) * 1e3
        r["step_ms_min"] = min(g["rows"][i]["step_s_min"] for g in got) * 1e3
        r["step_ms_max"] = max(g["rows"][i]["step_s_max"] for g in got) * 1e3
        r["rank"] = "all"
        rows.append(r)
    return {**got[0], "rows": rows}
