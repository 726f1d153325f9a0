"""The command line: ``python -m helpers.bench [NAME ...] [--profile smoke|full] [--out DIR]``.

Runs benchmarks by name with a profile's sizes, prints their tables and writes one JSON file per
benchmark (see :mod:`helpers.bench`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers.bench.buckets import timeline_overlap
from helpers.bench.common import BENCHMARKS, DEFAULT_OUT, MLP_PARAMS, PROFILES, machine_info, profile_config
from helpers.bench.launch_overhead import WARM_RUN, WARM_START, WARM_START_FRESH

# pandas is imported where the tables are made, not here: every rank of every benchmark imports
# this package, and pandas adds about 0.3 s to each rank's start (python -X importtime).

#: Where each benchmark's function lives, when not ``<name>.bench_<name>``; each takes its
#: profile's sizes as keywords. Imported when run: ``python -m helpers.bench.replicas_cost`` runs
#: that module as __main__.
_FUNCTIONS = {"launch": "launch_overhead.bench_launch_overhead",
              "replicas": "replicas_cost.bench_replicas_cost", "checks": "checks_cost.bench_checks"}
#: The key of a result's rows, where the result is a dict.
_ROWS = {"allreduce": "allreduce", "buckets": "rows"}
_TITLES = {
    "pipeline": "input pipeline (one epoch, Linear(784, 10), batch 64 per rank)",
    "scaling": "scaling (speedup and efficiency against DDP with 1 rank, 1 thread)",
    "allreduce": "all-reduce (busbw = algbw * 2(n-1)/n)",
    "memory": "memory per rank (MiB)",
    "buckets": f"DDP buckets (mlp, {MLP_PARAMS / 1e6:.1f} M parameters)",
    "simulated": "simulated ranks (threads, one process) against real gloo ranks: lesson 09's MLP, "
                 "one DDP step (ratios: to the smallest real world)",
    "replicas": "assert_in_sync beside one DDP step of an MLP (every-call check; full comparison "
                "when replicas differ)",
    "checks": "helpers.checks beside the runs they compare, simulated ranks (ratio: check / runs "
              "alone, medians; target for against_one_process)",
}
_COLUMNS = {
    "pipeline": ["pipeline", "wrapper", "world_size", "repeat", "threads_per_rank", "samples",
                 "seconds", "samples_per_s", "speedup_vs_seed", "test_accuracy"],
    "scaling": ["mode", "model", "global_batch_size", "world_size", "threads_per_rank",
                "oversubscribed", "step_ms", "solo_step_ms", "nosync_step_ms", "comm_exposed_ms",
                "samples_per_s", "speedup", "efficiency"],
    "allreduce": ["world_size", "bytes", "iters", "seconds", "algbw_GBps", "busbw_GBps",
                  "copy_GBps", "busbw_over_copy"],
    "memory": ["variant", "world_size", "rank", "peak_rss_mib", "rss_mib", "uss_mib", "pss_mib",
               "dataset_mib"],
    "buckets": ["bucket_cap_mb", "gradient_as_bucket_view", "n_buckets", "step_ms", "step_ms_min",
                "step_ms_max"],
    "simulated": ["mode", "world_size", "step_s", "peak_rss_mib", "step_vs_real", "rss_vs_real"],
    "replicas": ["world_size", "parameters", "step_ms", "check_ms", "check_per_step", "target",
                 "full_ms", "full_per_step"],
    "checks": ["check", "compares", "world_size", "check_s", "check_min_s", "check_max_s", "runs_s",
               "runs_min_s", "runs_max_s", "ratio", "target", "largest_difference"],
}


def _run_one(name: str, cfg: dict[str, Any]) -> Any:
    """Run benchmark ``name`` with one profile's sizes (``cfg``: :data:`PROFILES[profile][name]`)."""
    module, function = _FUNCTIONS.get(name, f"{name}.bench_{name}").split(".")
    return getattr(importlib.import_module(f"helpers.bench.{module}"), function)(**cfg)


def _tables(name: str, result: Any) -> list[tuple[str, Any]]:
    """The table(s) the command line prints for one benchmark (pandas DataFrames)."""
    import pandas as pd

    if not result or (isinstance(result, dict) and not any(result.values())):
        return [("nothing to run in this profile", pd.DataFrame())]
    rows = [result] if name == "replicas" else result[_ROWS[name]] if name in _ROWS else result
    df = pd.DataFrame(rows)
    if name == "scaling":
        df = df.sort_values(["model", "global_batch_size", "mode", "world_size", "threads_per_rank"])
    if name == "launch":
        df = df.groupby(["method", "world_size"])["seconds"].agg(["median", "min", "max", "count"])
        med = df["median"].to_dict()
        cold, warm = med.get(("helpers.engine.launch", 2)), med.get((WARM_RUN, 2))
        tables = [("launch overhead: seconds from call to results, trivial worker", df.reset_index())]
        if cold and warm:
            tables.append(("warm ranks against a cold launch, 2 ranks (medians)", pd.DataFrame([{
                "start_ranks_s": med.get((WARM_START, 2)), "start_ranks_fresh_engines_s":
                med.get((WARM_START_FRESH, 2)), "cold_launch_s": cold, "warm_run_s": warm,
                "warm_speedup_x": cold / warm}])))
        return tables
    if name == "memory":
        per = df.groupby(["variant", "world_size"]).agg(
            peak_rss_mib_per_rank=("peak_rss_mib", "max"), sum_uss_mib=("uss_mib", "sum"),
            sum_pss_mib=("pss_mib", "sum"), dataset_mib_per_rank=("dataset_mib", "max")).reset_index()
        return [(_TITLES[name], df[_COLUMNS[name]]), ("memory summed over ranks (MiB)", per)]
    if name == "replicas":
        for col in ("step_s", "check_s", "full_s"):
            df[col.replace("_s", "_ms")] = df[col] * 1e3
    tables = [(_TITLES[name], df[_COLUMNS[name]])]
    if name == "allreduce":
        tables.append(("memory copy (this process)", pd.DataFrame(result["memcpy"])))
    if name == "buckets":
        tl = timeline_overlap(result["timeline"]) if result["timeline"] else {}
        tables.append(("all-reduce overlapping backward (profiler, rank 0)", pd.DataFrame([tl])))
    return tables


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
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r}; choose from {BENCHMARKS}")
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        machine = machine_info()
        t0 = time.perf_counter()
        results[name] = result = _run_one(name, cfg_all[name])
        seconds = time.perf_counter() - t0
        if verbose:
            import pandas as pd

            with pd.option_context("display.width", 200, "display.max_columns", 30,
                                   "display.float_format", "{:,.4g}".format):
                for title, df in _tables(name, result):
                    print(f"\n== {name}: {title}\n{df.to_string(index=False)}")
            print(f"({name}: {seconds:.1f} s; load average before {machine['load_average']}, "
                  f"after {list(os.getloadavg())})")
        if out_dir is not None:
            path = Path(out_dir) / f"{name}.json"
            path.write_text(json.dumps({"benchmark": name, "profile": profile, "config": cfg_all[name],
                                        "machine_before": machine, "load_after": list(os.getloadavg()),
                                        "seconds": seconds, "result": result}, indent=1, default=str))
            if verbose:
                print(f"wrote {path}")
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.bench [NAME ...] [--profile smoke|full] [--out DIR]``."""
    p = argparse.ArgumentParser(prog="python -m helpers.bench", description="Benchmarks: where the time "
                                "goes when DDP trains MNIST (notebooks 05a and 05b, and a command line).")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    p.add_argument("--profile", choices=sorted(PROFILES), default="full", help="sizes (default: full)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the JSON files (default: build/bench)")
    a = p.parse_args(argv)
    unknown = [n for n in a.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    run_benchmarks(a.names or BENCHMARKS, a.profile, a.out)
    return 0
