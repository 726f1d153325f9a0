"""The small tools of lesson 06a's section 0, imported by 06a, 06b and 06c (one home for them).

``bytes_written`` also serves the all-reduce benchmark (helpers/bench/allreduce.py).

Each runs inside a rank started by ``launch`` (the default process group is initialised).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.engine import worker_device


def wrap(model, **ddp_kwargs):
    """DDP(model) on this rank's device (cuda:<local_rank> under nccl, else cpu)."""
    device = worker_device()
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)


def short_timeout_group(seconds):
    """A new process group of all ranks whose collectives raise after `seconds` (gloo)."""
    dist.barrier()  # a rank still finishing a previous timed-out demonstration catches up first
    return dist.new_group(timeout=datetime.timedelta(seconds=seconds))


def is_timeout_error(text):
    """True for gloo's timeout texts: "Timed out waiting 3000ms for recv operation" or
    "Application timeout caused pair closure"."""
    return text is not None and ("timed out" in text.lower() or "timeout" in text.lower())


def cpu(t: torch.Tensor) -> torch.Tensor:
    """A detached copy on the CPU: safe to return from a rank."""
    return t.detach().cpu().clone()


def grads(module):
    """{parameter name: its gradient on the CPU, or None}."""
    return {n: None if p.grad is None else cpu(p.grad) for n, p in module.named_parameters()}


def params(module):
    """{parameter name: its value on the CPU}."""
    return {n: cpu(p) for n, p in module.named_parameters()}


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def bytes_written() -> int | None:
    """Bytes this process has passed to write system calls, its sockets' included: ``wchar`` of
    ``/proc/self/io`` (gloo sends over TCP that way). ``None`` where that file is missing (not Linux)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
