"""What every benchmark shares: profiles, machine info, the models, and timing helpers.

Units: seconds (s), MiB (2**20 bytes), MB (1e6 bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import REPO_ROOT
from helpers.mnist_train import build_model

#: Where the command line writes its JSON files.
DEFAULT_OUT = REPO_ROOT / "build" / "bench"

#: The benchmarks the command line knows, in the order it runs them.
BENCHMARKS = ("pipeline", "scaling", "allreduce", "launch", "memory", "buckets", "simulated", "replicas", "checks")

KIB = 2**10
MIB = 2**20

#: The bucket benchmark's MLP: 784 -> MLP_WIDTH (x MLP_HIDDEN hidden layers) -> 10.
MLP_WIDTH = 512
MLP_HIDDEN = 12
MLP_PARAMS = 784 * MLP_WIDTH + MLP_WIDTH + (MLP_HIDDEN - 1) * (MLP_WIDTH * MLP_WIDTH + MLP_WIDTH) + MLP_WIDTH * 10 + 10

#: Sizes of each benchmark per profile (keywords of its function): ``smoke`` is what 05a and 05b run
#: in CI (small, no timing claims); ``full`` is the real measurement (minutes on 2 CPU cores).
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "smoke": {
        "pipeline": {"world_sizes": [1], "n_train": 1024, "n_test": 1000, "threads": 1, "repeats": 2},
        "scaling": {"configs": [[1, 1], [2, 1]], "models": ["cnn"], "global_batch_sizes": [256],
                    "steps": 4, "warmup": 2, "rounds": 2, "local": True},
        "allreduce": {"world_sizes": [2], "sizes_kib": [4, 64, 1024, 4096], "threads": 1},
        "launch": {"world_sizes": [], "repeats": 1},  # only `import torch` in smoke; launches: full
        "memory": {"world_sizes": [], "variants": ["private", "mmap"], "steps": 20},  # two launches: full only
        "buckets": {"world_size": 2, "bucket_caps_mb": [1.0, 25.0], "as_view": [False, True],
                    "steps": 4, "warmup": 2, "rounds": 2, "profile_cap_mb": 4.0},
        "simulated": {"simulated": [8], "real": [2], "steps": 2, "batch": 32},
        "replicas": {"world_size": 2, "width": 64, "depth": 2, "batch": 16, "repeats": 3},
        "checks": {"world_size": 8, "steps": 2, "global_batch": 32, "items": 256, "rounds": 1, "warmup": 0},
    },
    "full": {
        "pipeline": {"world_sizes": [1, 2], "n_train": 0, "n_test": 0, "threads": 1, "repeats": 3},
        "scaling": {"configs": [[1, 1], [1, 2], [2, 1], [2, 2], [4, 1]], "models": ["linear", "cnn"],
                    "global_batch_sizes": [64, 256, 1024], "steps": 6, "warmup": 3, "rounds": 5, "local": True},
        "allreduce": {"world_sizes": [2, 4], "sizes_kib": [4, 16, 64, 256, 1024, 4096, 16384, 65536],
                      "threads": 1},
        "launch": {"world_sizes": [2, 4], "repeats": 3},
        "memory": {"world_sizes": [1, 2, 4], "variants": ["private", "mmap"], "steps": 100},
        "buckets": {"world_size": 2, "bucket_caps_mb": [0.5, 1.0, 2.0, 4.0, 8.0, 25.0, 100.0],
                    "as_view": [False, True], "steps": 15, "warmup": 3, "rounds": 5, "profile_cap_mb": 4.0},
        "simulated": {"simulated": [8, 64, 256], "real": [2, 4], "steps": 5, "batch": 32},
        "replicas": {"world_size": 2, "width": 256, "depth": 4, "batch": 64, "repeats": 50},
        "checks": {"world_size": 64, "steps": 10, "global_batch": 256, "items": 6400, "rounds": 3, "warmup": 1},
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


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model and count, GPUs, versions, load average.

    Returns a JSON-ready dict: ``cpu_model``, ``logical_cpus``, ``gpus`` (names),
    ``torch``, ``python``, ``platform``, ``load_average`` (1, 5, 15 minutes; the number of
    runnable processes averaged: above the core count the machine is busy), ``time`` (UTC).
    """
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # Linux: the model's name
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"cpu_model": cpu, "logical_cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def sync_device(device: torch.device) -> None:
    """Wait for the GPU's queued work (``torch.cuda.synchronize``) before a clock is read; no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def num_threads(n: int | None):
    """Temporarily ``torch.set_num_threads(n)`` in this process (``None``: leave as is)."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def load_line(when: str) -> str:
    """One line on the machine's load average (1 and 5 min) and logical CPUs, flagged BUSY when the
    1-minute load is above 3/4 of the CPUs: other processes then distort the timings."""
    cpus = os.cpu_count() or 1
    l1, l5, _ = os.getloadavg()
    busy = "  <-- BUSY: other processes compete for the cores, timings are distorted" if l1 > 0.75 * cpus else ""
    return f"load average ({when}): {l1:.2f} (1 min), {l5:.2f} (5 min) on {cpus} cores{busy}"


def memory_now_mib() -> dict[str, float | None]:
    """This process's RSS, USS (private pages) and PSS (shared pages split between sharers), MiB."""
    p = psutil.Process()
    out: dict[str, float | None] = {"rss_mib": p.memory_info().rss / MIB, "uss_mib": None, "pss_mib": None}
    try:
        full = p.memory_full_info()
        out["uss_mib"] = full.uss / MIB
        out["pss_mib"] = getattr(full, "pss", 0) / MIB or None
    except (psutil.Error, AttributeError, OSError):
        pass
    return out


def median(xs: Sequence[float] | None) -> float | None:
    """The median of ``xs`` as a float (``None`` for an empty sequence or ``None``)."""
    return float(statistics.median(xs)) if xs else None


def spread(times: Sequence[float], prefix: str) -> dict[str, float | None]:
    """``{prefix}_median``, ``_mean``, ``_min`` and ``_max`` of ``times`` (``None`` when empty)."""
    if not times:
        return {f"{prefix}_{k}": None for k in ("median", "mean", "min", "max")}
    return {f"{prefix}_median": median(times), f"{prefix}_mean": sum(times) / len(times),
            f"{prefix}_min": min(times), f"{prefix}_max": max(times)}


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
        return build_model(name, seed)
    if name != "mlp":
        raise ValueError(f"model must be 'linear', 'cnn' or 'mlp', got {name!r}")
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, MLP_WIDTH), nn.ReLU()]
    for _ in range(MLP_HIDDEN - 1):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, 10))


def ddp_wrap(model: nn.Module, device: torch.device, **kwargs) -> nn.Module:
    """``DistributedDataParallel`` of ``model`` moved to ``device`` (``device_ids`` only on a GPU);
    ``kwargs`` go to DDP (``process_group``, ``bucket_cap_mb``, ``gradient_as_bucket_view``...)."""
    return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None, **kwargs)


def train_step(model: nn.Module, opt, x, y, sync: bool = True) -> None:
    """One SGD step with cross-entropy; ``sync=False`` runs forward and backward inside
    ``model.no_sync()`` (DDP: no gradient all-reduce; a plain module has no ``no_sync``)."""
    opt.zero_grad(set_to_none=True)
    if sync or not hasattr(model, "no_sync"):
        F.cross_entropy(model(x), y).backward()
    else:
        with model.no_sync():  # forward and backward inside: no gradient all-reduce
            F.cross_entropy(model(x), y).backward()
    opt.step()


def timed_steps(model, opt, batch, first: int, steps: int, device, sync: bool = True) -> list[float]:
    """Run ``steps`` training steps on ``batch(first)``, ``batch(first + 1)``, ...; return each
    step's wall-clock seconds (GPU synced)."""
    sync_device(device)
    times = []
    t = time.perf_counter()
    for s in range(first, first + steps):
        x, y = batch(s)
        train_step(model, opt, x, y, sync)
        sync_device(device)
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def timed_block(model: nn.Module, opt, batch: Callable, steps: int, device: torch.device, threads: int | None,
                sync: bool = True) -> Callable[[int], list[float]]:
    """A mode for :func:`run_interleaved`: ``steps`` training steps per block (``threads``
    torch threads while they run), continuing through the data from block to block."""
    done = [0]

    def run(n: int | None = None) -> list[float]:
        n = steps if n is None else n
        with num_threads(threads):
            times = timed_steps(model, opt, batch, done[0], n, device, sync=sync)
        done[0] += n
        return times

    return run


def batch_fn(x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor, global_batch: int, rank: int,
              world_size: int):
    """``batch(step)`` -> this rank's ``(x, y)`` share of global batch number ``step``: the
    ``global_batch`` samples of ``perm`` from ``step * global_batch`` (wrapping round), every
    ``world_size``-th from ``rank`` (``global_batch // world_size`` rows)."""
    n = perm.numel()

    def batch(step: int):
        start = (step * global_batch) % max(1, n - global_batch)
        idx = perm[start:start + global_batch][rank::world_size]
        return x.index_select(0, idx), y.index_select(0, idx)

    return batch


def run_interleaved(blocks: dict[str, Callable[..., list[float]] | None], rounds: int, warmup: int = 1,
                    barrier: Callable[[], Any] | None = None) -> tuple[dict[str, list[float]], list[str]]:
    """Time several modes in alternation: warm every mode up (``warmup`` untimed steps each),
    then ``rounds`` rounds of one timed block of every mode (A B C A B C ..., never all of A
    first), so a drift of the machine (load, clock speed, caches) spreads over every mode.

    ``blocks``: label -> ``run(n=None)``, which runs one block (``n`` steps, or the mode's own
    block length) and returns each step's seconds; ``None`` where this process takes no part (a
    rank that waits). ``barrier``: called by every process before and after each block.

    Returns:
        ``(times, order)``: every timed step's seconds per label this process ran, and the label
        of every timed block in the order run (the same on every process).

    Raises:
        ValueError: ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    times: dict[str, list[float]] = {label: [] for label, run in blocks.items() if run is not None}
    order: list[str] = []
    plan = [(-1, label) for label in blocks] if warmup > 0 else []
    plan += [(r, label) for r in range(rounds) for label in blocks]
    for r, label in plan:
        run = blocks[label]
        if barrier is not None:
            barrier()
        if run is not None:
            got = run(warmup) if r < 0 else run()
            if r >= 0:
                times[label] += got
        if barrier is not None:
            barrier()
        if r >= 0:
            order.append(label)
    return times, order
