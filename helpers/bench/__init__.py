"""Benchmarks: where the time goes when DDP trains MNIST (notebooks 05a and 05b, and a command line).

Run every benchmark from the repository root; each prints a table and writes JSON::

    python -m helpers.bench                       # all benchmarks, full profile, to build/bench/
    python -m helpers.bench --profile smoke       # small and quick (05a and 05b CI sizes; no memory/launch runs)
    python -m helpers.bench pipeline allreduce    # only some (see BENCHMARKS for every name)
    python -m helpers.bench --out /tmp/bench      # another output folder

The benchmarks (each has a ``bench_*`` function returning rows, plain dicts, for pandas), one
module each: ``pipeline``, ``scaling``, ``allreduce`` (and the memory copy), ``launch_overhead``
(and warm ranks), ``memory``, ``threads`` (threads per rank by launcher), ``buckets`` (and the
profiler timeline); ``common`` holds the profiles, machine info, the models and the timing
helpers, ``cli`` the command line:

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
``launch``    Seconds from a call to results for a trivial worker: :func:`helpers.engine.launch`
              against ``torch.multiprocessing.spawn``, and the cost of ``import torch``.
``memory``    Peak RSS per rank when every rank holds its own copy of MNIST, against ranks that
              share one read-only memory map of the raw file.
``simulated`` Seconds per DDP step and peak memory of lesson 09's MLP on 8, 64 and 256 simulated ranks
              (:func:`helpers.engine.simulate`: threads of one process) beside 2 and 4 real gloo
              ranks, as ratios to the real ones.
``buckets``   DDP ``bucket_cap_mb`` and ``gradient_as_bucket_view`` against step time, and a
              ``torch.profiler`` timeline of all-reduce overlapping backward.
``replicas``  :func:`helpers.replicas.assert_in_sync` beside one DDP step of an MLP, as a ratio:
              the every-call check (target: 5% of a step) and the full comparison.
``checks``    :func:`helpers.checks.against_one_process` on lesson 09's MLP (64 simulated ranks, 10
              steps) beside its two runs alone (target: 3x), and :func:`helpers.checks.data_coverage`
              beside the epoch it watches.

Timings are wall-clock (``time.perf_counter``), with ``torch.cuda.synchronize`` on GPUs. They
depend on the machine and on whatever else runs on it: every JSON file records the machine and
the load average before and after. Tests check the structure of the rows, never a timing.

Units: seconds (s), milliseconds (ms), samples per second (samples/s), bytes, GB/s (1e9
bytes/s), MiB (2**20 bytes).
"""

from __future__ import annotations

from helpers.bench.allreduce import (
    allreduce_worker,
    bench_allreduce,
    memcpy_bandwidth,
)
from helpers.bench.buckets import (
    _allreduce_after_backward_step as _allreduce_after_backward_step,
)
from helpers.bench.buckets import (
    _bucket_layout as _bucket_layout,
)
from helpers.bench.buckets import (
    _bucket_layout_steps as _bucket_layout_steps,
)
from helpers.bench.buckets import (
    _counting_hook as _counting_hook,
)
from helpers.bench.buckets import (
    bench_buckets,
    bucket_worker,
    timeline_overlap,
)
from helpers.bench.cli import (
    _tables as _tables,
)
from helpers.bench.cli import (
    main,
    run_benchmarks,
)
from helpers.bench.common import (
    BENCHMARKS,
    DEFAULT_OUT,
    KIB,
    MIB,
    MLP_HIDDEN,
    MLP_PARAMS,
    MLP_WIDTH,
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
    import_torch_seconds,
    spawn_launch,
    trivial_worker,
)
from helpers.bench.memory import (
    _mmap_split as _mmap_split,
)
from helpers.bench.memory import (
    bench_memory,
    memory_worker,
)
from helpers.bench.pipeline import (
    WRAPPERS,
    bench_pipeline,
    pipeline_worker,
)
from helpers.bench.pipeline import (
    _pipeline_epoch as _pipeline_epoch,
)
from helpers.bench.scaling import (
    bench_scaling,
    local_throughput,
    scaling_worker,
)
from helpers.bench.simulated import bench_simulated
from helpers.bench.threads import (
    THREADS_REPORT_CODE,
    bench_threads_by_launcher,
    threads_worker,
)

# the private names above are shown by notebooks 05a and 05b (inspect.getsource) and used by tests/course/test_bench.py

__all__ = [
    "BENCHMARKS",
    "DEFAULT_OUT",
    "KIB",
    "MIB",
    "MLP_HIDDEN",
    "MLP_PARAMS",
    "MLP_WIDTH",
    "PROFILES",
    "THREADS_REPORT_CODE",
    "LAUNCH_FIRST",
    "WARM_RUN",
    "WARM_START",
    "WARM_START_FRESH",
    "WRAPPERS",
    "allreduce_worker",
    "bench_allreduce",
    "bench_buckets",
    "bench_launch_overhead",
    "bench_memory",
    "bench_pipeline",
    "bench_scaling",
    "bench_simulated",
    "bench_threads_by_launcher",
    "bench_warm_ranks",
    "bucket_worker",
    "build_bench_model",
    "import_torch_seconds",
    "local_throughput",
    "load_line",
    "machine_info",
    "main",
    "memcpy_bandwidth",
    "memory_worker",
    "pipeline_worker",
    "profile_config",
    "run_benchmarks",
    "run_interleaved",
    "scaling_worker",
    "spawn_launch",
    "threads_worker",
    "timeline_overlap",
    "trivial_worker",
]
