"""Are my replicas in sync? :func:`assert_in_sync` checks, from inside the ranks, that every rank
holds the same parameters (optionally gradients and buffers) and, for a DDP model, that nothing
DDP wrapped has changed since the wrap.

Usable wherever a process group is initialised: a :func:`helpers.engine.launch` worker, a
:mod:`helpers.mp` worker, warm ranks (``ranks.run(...)``, ``%%px``) and a script under torchrun::

    from helpers.replicas import assert_in_sync
    for step, (x, y) in enumerate(loader):
        ...
        if step % 100 == 0:
            assert_in_sync(ddp, grads=True)   # every rank calls it: it is a collective

Cost: a 3-value header and a ``(number of tensors, 4)`` float64 table, each all-gathered once,
plus one pass over each tensor's elements (:func:`fingerprint`); extra collectives only on the
error path. ``python -m helpers.bench.replicas_cost`` prints it next to a training step.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["assert_in_sync", "fingerprint", "ReplicasDiverged", "SAMPLE"]

#: Elements of each tensor (evenly strided) in the fingerprint's pseudo-random projection.
SAMPLE = 64
_SHOWN = 3  # diverging tensors named in a message, then "and N more"
_SEED = 30  # the projection's weights: the same on every rank and every call

CAUSES = ("Usual causes: a call that bypassed the DDP wrapper (ddp.module(x), ddp.module.other(x)); "
          "parameters changed after wrapping (frozen, replaced); a rank-dependent seed; "
          "find_unused_parameters / static_graph misuse.")
BUFFERS_NOTE = ("Buffers: DDP copies rank 0's buffers to every rank at the start of each forward, then each "
                "rank updates its own (BatchNorm running stats): they differ after a training forward "
                "unless the model uses SyncBatchNorm; an eval-mode forward through DDP makes them agree.")


class ReplicasDiverged(AssertionError):
    """The replicas differ across ranks; every rank raises it with the same message."""


_weights: dict = {}


def _projection_weights(device: torch.device) -> torch.Tensor:
    if device not in _weights:
        g = torch.Generator().manual_seed(_SEED)
        _weights[device] = (torch.rand(SAMPLE, generator=g, dtype=torch.float64) * 2 - 1).to(device)
    return _weights[device]


def fingerprint(t: torch.Tensor | None, state: float = 1.0) -> torch.Tensor:
    """Four float64 values on ``t``'s device: ``[state, sum, sum of squares, projection]``.

    ``projection`` is the dot product of :data:`SAMPLE` evenly strided elements with fixed
    pseudo-random weights in [-1, 1). ``t=None`` gives ``[state, 0, 0, 0]`` on the CPU.

    What it can miss: a change that keeps the sum and the sum of squares (two elements swapped, or
    values permuted) where no sampled element changed; a change below float64 rounding of the sums
    (about 1e-16 of their size).
    """
    if t is None:
        return torch.tensor([state, 0.0, 0.0, 0.0], dtype=torch.float64)
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1).to(torch.float64)
    sample = x[::max(1, x.numel() // SAMPLE)][:SAMPLE]
    proj = torch.dot(sample, _projection_weights(x.device)[: sample.numel()])
    return torch.stack([torch.full((), state, dtype=torch.float64, device=x.device),
                        x.sum(), torch.dot(x, x), proj])


def _unwrap(module):
    """(the learner's module, names DDP ignores, the outermost DDP wrapper or None)."""
    ddp, ignored = None, set()
    while isinstance(module, DistributedDataParallel):
        ddp = ddp or module
        ignored |= set(getattr(module, "parameters_to_ignore", ()))
        module = module.module
    return module, ignored, ddp


def _entries(module, ignored, grads: bool, buffers: bool) -> list:
    """(kind, name, tensor, state, shape) for each checked tensor, in a fixed order."""
    params = [(n, p) for n, p in module.named_parameters() if n not in ignored]
    out = [("parameter", n, p, float(p.requires_grad), tuple(p.shape)) for n, p in params]
    if grads:
        out += [("gradient", n, p.grad, float(p.grad is not None), tuple(p.shape)) for n, p in params]
    if buffers:
        out += [("buffer", n, b, 1.0, tuple(b.shape)) for n, b in module.named_buffers()
                if n not in ignored]
    return out


def _ddp_notes(ddp, module, ignored) -> list[str]:
    """What changed in the module since ``DistributedDataParallel(...)`` wrapped it (this rank).

    Uses ``ddp._module_parameters`` (the list ``DistributedDataParallel.__init__`` builds from
    ``module.named_parameters()``, torch/nn/parallel/distributed.py, torch 2.14) for parameters
    added, replaced or removed; for requires_grad, the count of tensors the reducer got at the
    wrap (``ddp._get_ddp_logging_data()["num_parameter_tensors"]``) and, when it differs from
    the trainable ones now, the reducer's own parameters (``ddp.reducer._get_zeros_like_grad_buckets()``,
    each bucket's ``parameters()``; DDP calls it in ``_register_fused_optim``).
    """
    wrapped = getattr(ddp, "_module_parameters", None)
    if wrapped is None:
        return []
    notes = []
    named = [(n, p) for n, p in module.named_parameters() if n not in ignored]
    wrapped_ids = {id(p) for p in wrapped}
    added = [n for n, p in named if id(p) not in wrapped_ids]
    notes += [f"'{n}' was added or replaced after the wrap (a new nn.Parameter): DDP does not "
              "all-reduce its gradient" for n in added]
    gone = len(wrapped_ids - {id(p) for _, p in named})
    if gone > len(added):
        notes.append(f"{gone - len(added)} parameter(s) DDP wrapped are no longer in the module")
    try:
        at_wrap = int(ddp._get_ddp_logging_data()["num_parameter_tensors"])
    except (AssertionError, AttributeError, KeyError, RuntimeError):
        return notes
    if at_wrap != sum(p.requires_grad for p in wrapped):
        reduced = {id(t) for b in ddp.reducer._get_zeros_like_grad_buckets() for t in b.parameters()}
        for n, p in named:
            if id(p) not in wrapped_ids:
                continue
            if p.requires_grad and id(p) not in reduced:
                notes.append(f"'{n}': requires_grad set True after the wrap: DDP does not all-reduce its gradient")
            elif not p.requires_grad and id(p) in reduced:
                notes.append(f"'{n}': requires_grad set False after the wrap: DDP still expects its gradient")
    return notes


def _structure_hash(entries, grads, buffers) -> float:
    key = repr(([(k, n, s) for k, n, _, _, s in entries], grads, buffers)).encode()
    return float(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 12)  # exact in float64


def _gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return torch.stack(out).cpu()


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _describe(kind: str, row: torch.Tensor, show_proj: bool) -> str:
    state = row[0].item()
    if kind == "gradient" and state == 0:
        return "None"
    text = f"sum={_fmt(row[1].item())} sumsq={_fmt(row[2].item())}"
    if show_proj:
        text += f" proj={_fmt(row[3].item())}"
    if kind == "parameter":
        text += "" if state else " requires_grad=False"
    return text


def _ranks(rs, verbs: tuple[str, str] = ("", "")) -> str:
    """'rank 1 differs', 'ranks 1, 2 differ' for ``verbs=(' differs', ' differ')``."""
    rs = list(rs)
    one = len(rs) == 1
    return ("rank " if one else "ranks ") + ", ".join(str(r) for r in rs) + verbs[0 if one else 1]


def _structure_message(infos: list) -> str:
    """Which ranks hold a different model (or called with different options) than rank 0."""
    ref_opts, ref = infos[0]
    ref_map = {(k, n): s for k, n, s in ref}
    lines, differ = [], []
    for r, (opts, struct) in enumerate(infos[1:], start=1):
        mine = {(k, n): s for k, n, s in struct}
        if opts != ref_opts:
            lines.append(f"  rank {r} called assert_in_sync({opts}), rank 0 ({ref_opts})")
        elif mine != ref_map or [kn for kn, _ in mine.items()] != [kn for kn, _ in ref_map.items()]:
            diffs = [f"'{n}' shape {ref_map[(k, n)]} on rank 0, {s} on rank {r}"
                     for (k, n), s in mine.items() if (k, n) in ref_map and ref_map[(k, n)] != s]
            diffs += [f"'{n}' only on rank {r}" for (k, n) in mine if (k, n) not in ref_map]
            diffs += [f"'{n}' only on rank 0" for (k, n) in ref_map if (k, n) not in mine]
            diffs = diffs or ["the same names in another order"]
            more = f" and {len(diffs) - _SHOWN} more" if len(diffs) > _SHOWN else ""
            lines.append(f"  rank {r}: {'; '.join(diffs[:_SHOWN])}{more}")
        else:
            continue
        differ.append(r)
    return (f"Replicas differ: {_ranks(differ, (' holds', ' hold'))} a different model than rank 0 "
            f"({len(ref)} tensors on rank 0):\n" + "\n".join(lines) +
            "\nBuild the same model on every rank (same code, same arguments) before checking it.")


def assert_in_sync(module: torch.nn.Module, *, grads: bool = False, buffers: bool = False,
                   group=None, atol: float = 0.0) -> None:
    """Check that every rank of ``group`` holds the same ``module``; a collective.

    Every rank of the group must call it (the same number of times, with the same options): a
    rank that does not call it leaves the others waiting until the group's timeout. A DDP model is
    unwrapped (``.module``), so names are the module's own (no ``module.`` prefix); parameters DDP
    ignores are skipped.

    Args:
        module: an ``nn.Module`` or a ``DistributedDataParallel`` around one.
        grads: also compare each parameter's ``.grad`` (a None grad on some ranks only differs).
        buffers: also compare buffers (BatchNorm running statistics).
        group: the process group (default: the default group). Ranks in messages are group ranks.
        atol: allowed absolute difference of each fingerprint value (sum, sum of squares,
            projection: :func:`fingerprint`), not of each element; 0 means bitwise-equal sums.

    Raises:
        ReplicasDiverged: on every rank, with the same message: the first diverging tensors (at
            most 3 named), the ranks that differ from rank 0, their values, the usual causes; or a
            model whose names/shapes differ across ranks; or, for a DDP model, parameters added,
            replaced, removed or whose requires_grad changed since the wrap.
        RuntimeError: no process group is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("assert_in_sync needs a process group: call it inside the ranks (a launch or "
                           "helpers.mp worker, ranks.run, a %%px cell) after init_process_group.")
    world = dist.get_world_size(group)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    inner, ignored, ddp = _unwrap(module)
    entries = _entries(inner, ignored, grads, buffers)
    notes = _ddp_notes(ddp, inner, ignored) if ddp is not None else []

    header = torch.tensor([len(entries), _structure_hash(entries, grads, buffers), len(notes)],
                          dtype=torch.float64, device=device)
    headers = _gather(header, group, world)
    if not bool((headers[:, :2] == headers[0, :2]).all()):
        infos = [None] * world
        opts = f"grads={grads}, buffers={buffers}"
        dist.all_gather_object(infos, (opts, [(k, n, s) for k, n, _, _, s in entries]), group=group)
        raise ReplicasDiverged(_structure_message(infos))

    problems, differ = [], set()
    if entries:
        table = torch.stack([fingerprint(t, state).to(device) for _, _, t, state, _ in entries])
        tables = _gather(table, group, world)  # (world, tensors, 4)
        ref = tables[0]
        same = ((tables - ref).abs() <= atol) | (tables == ref) | (tables.isnan() & ref.isnan())
        bad = ~same.all(dim=2)  # (world, tensors)
        differ = {r for r in range(1, world) if bool(bad[r].any())}
        for i in bad.any(dim=0).nonzero().flatten().tolist():
            kind, name, _, _, shape = entries[i]
            rs = [r for r in range(1, world) if bad[r, i]]
            show_proj = all(bool(same[r, i, 1:3].all()) for r in rs)
            values = "; ".join(f"rank {r} {_describe(kind, tables[r, i], show_proj)}" for r in [0] + rs[:_SHOWN])
            problems.append(f"  {kind} '{name}' {shape}: {values}")

    ddp_lines = []
    if bool((headers[:, 2] > 0).any()):
        all_notes = [None] * world
        dist.all_gather_object(all_notes, notes, group=group)
        seen: dict[str, list[int]] = {}
        for r, ns in enumerate(all_notes):
            for n in ns:
                seen.setdefault(n, []).append(r)
        ddp_lines = [f"  {n} ({_ranks(rs)})" for n, rs in seen.items()]

    if not problems and not ddp_lines:
        return
    text = []
    if problems:
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        text.append(f"Replicas differ: {_ranks(sorted(differ), (' differs', ' differ'))} from rank 0 "
                    f"({len(problems)} of {len(entries)} tensors):\n" + "\n".join(problems[:_SHOWN]) + more)
    if ddp_lines:
        text.append("The DDP model changed after DistributedDataParallel(...) wrapped it (wrap it again "
                    "after the change):\n" + "\n".join(ddp_lines[:_SHOWN]) +
                    (f"\n  ... and {len(ddp_lines) - _SHOWN} more" if len(ddp_lines) > _SHOWN else ""))
    if any(p.startswith("  buffer ") for p in problems):
        text.append(BUFFERS_NOTE)
    text.append(CAUSES)
    raise ReplicasDiverged("\n".join(text))
