"""Benchmarks: where the time goes when DDP trains MNIST (notebooks 05a and 05b, the command line).

Run from the repository root; each benchmark prints its table(s) and writes JSON::

    python -m helpers.bench                       # all benchmarks, full profile, to build/bench/
    python -m helpers.bench --profile smoke       # small and quick (05a and 05b CI sizes)
    python -m helpers.bench pipeline allreduce    # only some (see BENCHMARKS for every name)

One module each, each with a ``bench_*`` function returning rows (plain dicts, for pandas):

``pipeline``  the seed recipe's per-item transforms against in-memory tensors, side by side.
``scaling``   DDP samples/s by world size, threads per rank, model and global batch, split
              into one rank alone, ranks under ``no_sync()`` and the real step; a single
              process and ``nn.DataParallel`` beside them.
``allreduce`` all-reduce ``algbw`` and ``busbw`` (nccl-tests' definitions) against the
              memory-copy bandwidth of the same size.
``launch``    call-to-results seconds: ``helpers.engine.launch``, ``mp.spawn``, warm ranks.
``memory``    peak RSS per rank: a private copy of MNIST against one shared read-only map.
``simulated`` lesson 09's DDP step on simulated ranks beside real gloo ranks, as ratios.
``buckets``   ``bucket_cap_mb`` against step time; a profiler timeline of the overlap.
``replicas``  ``assert_in_sync`` beside one DDP step, as a ratio (aim: 10%).
``checks``    ``against_one_process`` and ``data_coverage`` beside the runs they compare.
``threads``   the threads each launcher leaves a rank (notebook 05a; not on the command line).

``common`` holds the profiles, machine info, models and timing helpers, ``cli`` the command line.
Timings are wall-clock, GPU synced; each JSON file records the machine and the load before and
after. Tests check the rows' structure, never a timing.
"""

from __future__ import annotations

# the private names are shown by notebooks 05a and 05b (inspect.getsource) or used by tests
from helpers.bench.allreduce import allreduce_worker, bench_allreduce, memcpy_bandwidth
from helpers.bench.buckets import _allreduce_after_backward_step as _allreduce_after_backward_step
from helpers.bench.buckets import _bucket_layout_steps as _bucket_layout_steps
from helpers.bench.buckets import _counting_hook as _counting_hook
from helpers.bench.buckets import bench_buckets, bucket_worker, timeline_overlap
from helpers.bench.cli import _tables as _tables
from helpers.bench.cli import main, run_benchmarks
from helpers.bench.common import (
    BENCHMARKS,
    MLP_PARAMS,
    PROFILES,
    build_bench_model,
    load_line,
    machine_info,
    profile_config,
    run_interleaved,
)
from helpers.bench.launch_overhead import (
    LAUNCH_FIRST,
    WARM_RUN,
    WARM_START,
    WARM_START_FRESH,
    bench_launch_overhead,
    bench_warm_ranks,
    spawn_launch,
)
from helpers.bench.memory import _mmap_split as _mmap_split
from helpers.bench.memory import bench_memory
from helpers.bench.pipeline import _pipeline_epoch as _pipeline_epoch
from helpers.bench.pipeline import bench_pipeline
from helpers.bench.scaling import bench_scaling, scaling_worker
from helpers.bench.simulated import bench_simulated
from helpers.bench.threads import bench_threads_by_launcher

__all__ = [
    "BENCHMARKS", "LAUNCH_FIRST", "MLP_PARAMS", "PROFILES", "WARM_RUN", "WARM_START",
    "WARM_START_FRESH", "allreduce_worker", "bench_allreduce", "bench_buckets",
    "bench_launch_overhead", "bench_memory", "bench_pipeline", "bench_scaling", "bench_simulated",
    "bench_threads_by_launcher", "bench_warm_ranks", "bucket_worker", "build_bench_model",
    "load_line", "machine_info", "main", "memcpy_bandwidth", "profile_config", "run_benchmarks",
    "run_interleaved", "scaling_worker", "spawn_launch", "timeline_overlap",
]
