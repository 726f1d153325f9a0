"""Simulated ranks against real ones: seconds per DDP step and peak memory of lesson 09's MLP.

Each simulated world runs in a fresh process (one rank of :func:`helpers.engine.launch`) that calls
:func:`helpers.engine.simulate`, so that its peak resident memory (VmHWM) is its own; the real worlds
are gloo ranks of :func:`helpers.engine.launch`, whose peaks are summed. Seconds per step: the
slowest rank's (every rank waits for the others in DDP's all-reduce).

Units: seconds (s), MiB (2**20 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from helpers.at_scale import ddp_steps
from helpers.engine import launch, simulate
from helpers.mnist_train import peak_rss_mib


def _real_rank(rank: int, world_size: int, steps: int, batch: int) -> dict[str, float]:
    out = ddp_steps(rank, world_size, steps, batch)
    return {"step_s": out["step_s"], "peak_rss_mib": peak_rss_mib()}


def _simulation(rank: int, world_size: int, n: int, steps: int, batch: int) -> dict[str, float]:
    """In a fresh process: ``n`` simulated ranks of :func:`helpers.at_scale.ddp_steps`."""
    outs = simulate(ddp_steps, n, steps, batch)
    return {"step_s": max(o["step_s"] for o in outs), "peak_rss_mib": peak_rss_mib()}


def bench_simulated(simulated: Sequence[int], real: Sequence[int], steps: int = 5,
                    batch: int = 32) -> list[dict[str, Any]]:
    """One row per world: ``mode`` (``simulated`` / ``gloo``), ``world_size``, ``step_s``, ``peak_rss_mib``
    (the whole job's: the simulating process, or the sum over real ranks), and the ratios of both to
    the smallest real world (``step_vs_real``, ``rss_vs_real``; ``None`` without a real world)."""
    rows = []
    for n in real:
        outs = launch(_real_rank, n, steps, batch, timeout=600)
        rows.append({"mode": "gloo", "world_size": n, "step_s": max(o["step_s"] for o in outs),
                     "peak_rss_mib": sum(o["peak_rss_mib"] for o in outs)})
    for n in simulated:
        out = launch(_simulation, 1, n, steps, batch, timeout=1200)[0]
        rows.append({"mode": "simulated", "world_size": n, **out})
    base = min((r for r in rows if r["mode"] == "gloo"), key=lambda r: r["world_size"], default=None)
    for r in rows:
        r["step_vs_real"] = r["step_s"] / base["step_s"] if base else None
        r["rss_vs_real"] = r["peak_rss_mib"] / base["peak_rss_mib"] if base else None
    return rows
