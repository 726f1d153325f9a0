"""The command line: ``python -m helpers.bench [NAME ...] [--profile smoke|full] [--out DIR]``.

Runs benchmarks by name with a profile's sizes, prints their tables and writes one JSON file per
benchmark (see :mod:`helpers.bench`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers.bench.allreduce import bench_allreduce
from helpers.bench.buckets import bench_buckets, timeline_overlap
from helpers.bench.common import BENCHMARKS, DEFAULT_OUT, MLP_PARAMS, PROFILES, machine_info, profile_config
from helpers.bench.launch_overhead import WARM_RUN, WARM_START, WARM_START_FRESH, bench_launch_overhead
from helpers.bench.memory import bench_memory
from helpers.bench.pipeline import bench_pipeline
from helpers.bench.scaling import bench_scaling
from helpers.bench.simulated import bench_simulated

#: The first line of ``--help``.
DESCRIPTION = "Benchmarks: where the time goes when DDP trains MNIST (notebooks 05a and 05b, and a command line)."

# pandas is imported where the tables are made, not here: every rank of every benchmark imports
# this package, and pandas adds about 0.3 s to each rank's start (python -X importtime).


def _run_one(name: str, cfg: dict[str, Any]) -> Any:
    """Run benchmark ``name`` with one profile's sizes (``cfg``: :data:`PROFILES[profile][name]`)."""
    if name == "pipeline":
        return bench_pipeline(cfg["world_sizes"], cfg["n_train"] or None, cfg["n_test"] or None,
                              cfg["threads"], cfg["repeats"])
    if name == "scaling":
        return bench_scaling(cfg["configs"], cfg["models"], cfg["global_batch_sizes"], cfg["steps"],
                             cfg["warmup"], cfg["rounds"], cfg["local"])
    if name == "allreduce":
        return bench_allreduce(cfg["world_sizes"], cfg["sizes_kib"], cfg["threads"])
    if name == "launch":
        return bench_launch_overhead(cfg["world_sizes"], cfg["repeats"])
    if name == "memory":
        return bench_memory(cfg["world_sizes"], cfg["variants"], cfg["steps"])
    if name == "buckets":
        return bench_buckets(cfg["world_size"], cfg["bucket_caps_mb"], cfg["as_view"], steps=cfg["steps"],
                             warmup=cfg["warmup"], profile_cap_mb=cfg["profile_cap_mb"], rounds=cfg["rounds"])
    if name == "simulated":
        return bench_simulated(cfg["simulated"], cfg["real"], cfg["steps"], cfg["batch"])
    if name == "replicas":  # imported here: ``python -m helpers.bench.replicas_cost`` runs it as __main__
        from helpers.bench.replicas_cost import bench_replicas_cost

        return bench_replicas_cost(**cfg)
    if name == "checks":
        from helpers.bench.checks_cost import bench_checks

        return bench_checks(**cfg)
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
        cold, warm = med.get(("helpers.engine.launch", 2)), med.get((WARM_RUN, 2))
        if cold and warm:
            tables.append(("warm ranks against a cold launch, 2 ranks (medians)", pd.DataFrame([{
                "start_ranks_s": med.get((WARM_START, 2)),
                "start_ranks_fresh_engines_s": med.get((WARM_START_FRESH, 2)),
                "cold_launch_s": cold, "warm_run_s": warm,
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
        cols = ["bucket_cap_mb", "gradient_as_bucket_view", "n_buckets", "step_ms", "step_ms_min", "step_ms_max"]
        tl = timeline_overlap(result["timeline"]) if result["timeline"] else {}
        return [(f"DDP buckets (mlp, {MLP_PARAMS / 1e6:.1f} M parameters)", pd.DataFrame(result["rows"])[cols]),
                ("all-reduce overlapping backward (profiler, rank 0)", pd.DataFrame([tl]))]
    if name == "simulated":
        cols = ["mode", "world_size", "step_s", "peak_rss_mib", "step_vs_real", "rss_vs_real"]
        return [("simulated ranks (threads, one process) against real gloo ranks: lesson 09's MLP, one DDP step "
                 "(ratios: to the smallest real world)", pd.DataFrame(result)[cols])]
    if name == "replicas":
        df = pd.DataFrame([result])
        for col in ("step_s", "check_s", "full_s"):
            df[col.replace("_s", "_ms")] = df[col] * 1e3
        cols = ["world_size", "parameters", "step_ms", "check_ms", "check_per_step", "target", "full_ms",
                "full_per_step"]
        return [("assert_in_sync beside one DDP step of an MLP (every-call check; full comparison when "
                 "replicas differ)", df[cols])]
    if name == "checks":
        cols = ["check", "compares", "world_size", "check_s", "check_min_s", "check_max_s", "runs_s", "runs_min_s",
                "runs_max_s", "ratio", "target"]
        return [("helpers.checks beside the runs they compare, simulated ranks (ratio: check / runs alone, "
                 "medians; target for against_one_process)", pd.DataFrame(result)[cols])]
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
    p = argparse.ArgumentParser(prog="python -m helpers.bench", description=DESCRIPTION)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    p.add_argument("--profile", choices=sorted(PROFILES), default="full", help="sizes (default: full)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the JSON files (default: build/bench)")
    a = p.parse_args(argv)
    for n in a.names:
        if n not in BENCHMARKS:
            p.error(f"unknown benchmark {n!r}; choose from {', '.join(BENCHMARKS)}")
    run_benchmarks(a.names or BENCHMARKS, a.profile, a.out)
    return 0

