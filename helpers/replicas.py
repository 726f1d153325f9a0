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

Cost: every call takes each tensor's order-sensitive digest (:func:`digests`) and exchanges one
fixed-size int64 vector (:func:`_exchange`): a hash of the names, shapes, states, modes and
hyperparameters (:func:`_config`), and the digests folded into :data:`SLOTS` values. Only when they
differ does the full comparison run (:func:`fingerprint` of each tensor, a table exchanged, the message).
``python -m helpers.bench replicas`` prints both next to a training step.
"""

from __future__ import annotations

import hashlib
import weakref

import numpy
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["assert_in_sync", "fingerprint", "digests", "ReplicasDiverged", "SAMPLE", "SLOTS"]

#: Elements of each tensor (evenly strided) in the fingerprint's pseudo-random projection.
SAMPLE = 64
#: Values the every-call check folds the per-tensor digests into (tensor i adds to slot i % SLOTS).
SLOTS = 64
_PRIME = 2_147_483_647  # digests are kept modulo this prime: they fit float64 and int64 sums exactly
_SHOWN = 3  # diverging tensors named in a message, then "and N more"
_JOIN = 4096  # the every-call check digests CPU tensors of at most this many int32 together
_PROJECTION = torch.rand(SAMPLE, generator=torch.Generator().manual_seed(30), dtype=torch.float64) * 2 - 1
# Kept between calls, for the every-call check's speed: see the function that fills each.
_positions: dict = {}
_views: dict = {}  # id(tensor) -> (weak reference, data_ptr, numel, bits); dropped with the tensor
_digests: dict = {}
_wraps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_READ: dict = {}  # (class, attribute names) -> (public names, sorted; extra_repr() is not torch.nn's)

CAUSES = ("Usual causes: a call that bypassed the DDP wrapper (ddp.module(x), ddp.module.other(x)); "
          "parameters changed after wrapping (frozen, replaced); a rank-dependent seed; "
          "find_unused_parameters / static_graph misuse.")
BUFFERS_NOTE = ("Buffers: DDP copies rank 0's buffers to every rank at the start of each forward, then each "
                "rank updates its own (BatchNorm running stats): they differ after a training forward "
                "unless the model uses SyncBatchNorm; an eval-mode forward through DDP makes them agree.")
COUNTERS_NOTE = ("A counter buffer (BatchNorm's num_batches_tracked) differs: a rank ran more or fewer "
                 "forwards in train() mode, or stopped updating its statistics (left in eval()).")
MODES_NOTE = ("A rank in eval() trains another model than a rank in train(): BatchNorm uses its running "
              "statistics, Dropout is off. Usual cause: a validate() on one rank that never calls "
              "model.train() again; restore the mode after evaluating, on every rank.")


class ReplicasDiverged(AssertionError):
    """The replicas differ across ranks; every rank raises it with the same message."""


def fingerprint(t: torch.Tensor | None, state: float = 1.0) -> torch.Tensor:
    """Four float64 values on ``t``'s device: ``[state, sum, sum of squares, projection]``, the
    projection: :data:`SAMPLE` evenly strided elements dotted with fixed pseudo-random weights in
    [-1, 1). ``t=None`` gives ``[state, 0, 0, 0]`` on the CPU. It misses values permuted where no
    sampled element changed and changes below float64 rounding: :func:`digests` sees both."""
    if t is None:
        return torch.tensor([state, 0.0, 0.0, 0.0], dtype=torch.float64)
    x = (torch.view_as_real(t.detach()) if t.is_complex() else t.detach()).reshape(-1).to(torch.float64)
    sample = x[::max(1, x.numel() // SAMPLE)][:SAMPLE]
    proj = torch.dot(sample, _PROJECTION[: sample.numel()].to(x.device))
    return torch.stack([torch.full((), state, dtype=torch.float64, device=x.device),
                        x.sum(), torch.dot(x, x), proj])


_INT_VIEW = {8: (torch.int64, torch.int64), 4: (torch.int32, torch.int32),
             2: (torch.int16, torch.int32), 1: (torch.uint8, torch.int32)}


def _position_weights(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(n,)`` odd pseudo-random ``dtype`` (int32 or int64) integers, a function of the position only
    (splitmix64's mixer of the index), the same on every rank; kept: the longest asked, and a slice of
    it per length (at most 64)."""
    if (w := _positions.get((n, dtype, device))) is not None:
        return w
    w = _positions.get((dtype, device))
    if w is None or w.numel() < n or len(_positions) > 64:
        h = torch.arange(max(n, 1024), dtype=torch.int64) * -7046029254386353131  # 0x9E3779B97F4A7C15
        h = (h ^ (h >> 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9, wrapping as in C
        h = ((h ^ (h >> 27)) * -7723592293110705685) if dtype == torch.int64 else (h >> 33)
        _positions.clear()
        _positions[(dtype, device)] = w = (h.to(dtype) | 1).to(device)
    _positions[(n, dtype, device)] = w = w[:n]
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as flat int32/int64 (1, 2 bytes widened; complex as pairs), a view kept while
    ``t`` keeps its memory, or a copy."""
    hit = _views.get(key := id(t))
    if hit is not None and hit[0]() is t and hit[1] == t.data_ptr() and hit[2] == t.numel():
        return hit[3]
    with torch.no_grad():  # a view of the bits of a tensor that requires grad
        x = torch.view_as_real(t) if t.is_complex() else t
        view, acc = _INT_VIEW[x.element_size()]
        x = x.reshape(-1).view(view)
    if view != acc:
        return x.to(acc)
    if x.data_ptr() == t.data_ptr():  # not a copy (reshape copies a non-contiguous tensor)
        _views[key] = (weakref.ref(t, lambda _: _views.pop(key, None)), t.data_ptr(), t.numel(), x)
    return x


def _raw_digests(tensors: list, join: int = 0) -> list[int]:
    """Per tensor ``sum(bits[i] * w[i])`` (:func:`_bits`, :func:`_position_weights`), wrapping, as a
    Python int. No None in ``tensors``. ``join``: CPU tensors of at most ``join``
    int32 are digested as one, after the others (fewer small operations)."""
    xs, small = [], []
    for t in tensors:
        x = _bits(t)
        (small if x.dtype == torch.int32 and x.numel() <= join and x.is_cpu else xs).append(x)
    xs += [torch.cat(small)] if len(small) > 1 else small
    # mul then sum: both vectorised, faster than torch.dot's integer loop (which torch does not vectorise)
    return [int(x.mul(_position_weights(x.numel(), x.dtype, x.device)).sum(dtype=x.dtype)) for x in xs]


def digests(tensors: list, device: torch.device) -> torch.Tensor:
    """``(len(tensors),)`` int64 on ``device``: an order-sensitive digest of each tensor's bits,
    modulo 2**31 - 1 (exact in float64); a None tensor gives -1.

    The elements are read as integers (float32 as int32, ...), times odd pseudo-random weights of
    their position, summed with wrapping (modulo 2**32, 2**64 for 8-byte elements): the order of
    the additions does not matter. One element that differs always changes the wrapped sum (an odd
    weight times a nonzero difference); values moved within the tensor change it unless their
    weighted differences cancel (about one chance in 2**31 for two elements swapped), or the two
    differ only in their top bit (a float and its negative, x and -x swapped: the weights'
    difference is even, so it cancels); full-width (int64) products would see that pair, at several
    times the cost."""
    sums = iter(_raw_digests([t for t in tensors if t is not None]))
    return torch.tensor([-1 if t is None else next(sums) % _PRIME for t in tensors],
                        dtype=torch.int64, device=device)


def _unwrap(module):
    """(the learner's module, names DDP ignores, the outermost DDP wrapper or None)."""
    ddp, ignored = None, set()
    while isinstance(module, DistributedDataParallel):
        ddp = ddp or module
        ignored |= set(getattr(module, "parameters_to_ignore", ()))
        module = module.module
    return module, ignored, ddp


def _walk(module, ignored, grads: bool, buffers: bool) -> tuple[list, list]:
    """One pass over the modules (``named_modules()``'s order): (kind, name, tensor, state, shape)
    for each checked tensor, in ``named_parameters()`` order (shared tensors once), then gradients,
    then buffers; and (name, class name, training, :func:`_config`) of the module and each submodule."""
    params, bufs, modes, seen, memo, stack = [], [], [], set(), set(), [("", module)]
    while stack:
        prefix, m = stack.pop()
        if m in memo:
            continue
        memo.add(m)
        modes.append((prefix, type(m).__name__, m.training, _config(m)))
        dot = prefix + "." if prefix else ""
        if m._modules:
            stack += reversed([(dot + k, c) for k, c in m._modules.items() if c is not None])
        for k, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if not (ignored and dot + k in ignored):
                    params.append((dot + k, p))
        for k, b in m._buffers.items() if m._buffers else ():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                if dot + k not in ignored and (buffers or not (b.is_floating_point() or b.is_complex())):
                    bufs.append(("buffer", dot + k, b, 1.0, tuple(b.shape)))
    out = [("parameter", n, p, float(p.requires_grad), tuple(p.shape)) for n, p in params]
    if grads:
        out += [("gradient", n, p.grad, float(p.grad is not None), tuple(p.shape)) for n, p in params]
    return out + bufs, modes


_PLAIN = {bool, int, float, str, type(None), tuple}
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)  # training, _parameters, _buffers, hooks, ...


def _config(m) -> tuple:
    """A module's hyperparameters, as ``(name, value)`` pairs: its public attributes of plain types
    (bool, int, float, str, None, tuple), such as Dropout's ``p``, BatchNorm's ``eps`` and
    ``momentum`` or ``self.scale = 2.0``, then its ``extra_repr()`` unless torch.nn defines it
    (torch.nn's show only plain attributes)."""
    d = m.__dict__
    key = (type(m), tuple(d))
    if (read := _READ.get(key)) is None:
        if len(_READ) > 256:
            _READ.clear()
        names = sorted(k for k in d if k[0] != "_" and k not in _MODULE_KEYS)
        _READ[key] = read = (names, not type(m).extra_repr.__module__.startswith("torch.nn."))
    plain = tuple([(k, d[k]) for k in read[0] if type(d[k]) in _PLAIN])
    return (*plain, ("extra_repr()", m.extra_repr())) if read[1] else plain


def _wrap_record(ddp):
    """(ids of the parameters DDP wrapped, those parameters, tensors the reducer got), read once
    per wrapper; None when this DDP keeps no list."""
    if ddp not in _wraps:
        wrapped = getattr(ddp, "_module_parameters", None)
        try:
            at_wrap = int(ddp._get_ddp_logging_data()["num_parameter_tensors"])
        except (AssertionError, AttributeError, KeyError, RuntimeError):
            at_wrap = None
        _wraps[ddp] = None if wrapped is None else (frozenset(id(p) for p in wrapped), list(wrapped), at_wrap)
    return _wraps[ddp]


def _ddp_notes(ddp, named: list) -> list[str]:
    """What changed in the module since DDP wrapped it (this rank); ``named``: its (name, parameter)
    pairs now, without those DDP ignores. Sources (torch/nn/parallel/distributed.py, torch 2.14):
    ``ddp._module_parameters`` (added, replaced, removed); requires_grad: the reducer's tensor count
    in ``_get_ddp_logging_data()``, then each bucket of ``reducer._get_zeros_like_grad_buckets()``."""
    record = _wrap_record(ddp)
    if record is None:
        return []
    wrapped_ids, wrapped, at_wrap = record
    added = [n for n, p in named if id(p) not in wrapped_ids]
    notes = [f"'{n}' was added or replaced after the wrap (a new nn.Parameter): DDP does not "
             "all-reduce its gradient" for n in added]
    if len(named) - len(added) < len(wrapped_ids):
        gone = len(wrapped_ids - {id(p) for _, p in named})
        if gone > len(added):
            notes.append(f"{gone - len(added)} parameter(s) DDP wrapped are no longer in the module")
    if at_wrap is not None and at_wrap != sum(p.requires_grad for p in wrapped):
        reduced = {id(t) for b in ddp.reducer._get_zeros_like_grad_buckets() for t in b.parameters()}
        for n, p in [(n, p) for n, p in named if id(p) in wrapped_ids]:
            if p.requires_grad and id(p) not in reduced:
                notes.append(f"'{n}': requires_grad set True after the wrap: DDP does not all-reduce its gradient")
            elif not p.requires_grad and id(p) in reduced:
                notes.append(f"'{n}': requires_grad set False after the wrap: DDP still expects its gradient")
    return notes


def _exchange(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """``(world, *t.shape)``: every rank's ``t``, by an all-to-all (gloo's costs less than its all-gather)."""
    rows = torch.empty((world, *t.shape), dtype=t.dtype, device=t.device)
    dist.all_to_all_single(rows, t.expand(world, *t.shape).contiguous(), group=group)
    return rows


def _first(lines: list[str]) -> str:
    """The first :data:`_SHOWN` lines, then "... and N more"."""
    more = [f"  ... and {len(lines) - _SHOWN} more"] if len(lines) > _SHOWN else []
    return "\n".join(lines[:_SHOWN] + more)


def _describe(kind: str, row: torch.Tensor, shape: tuple, detail: int) -> str:
    """One rank's values; ``detail`` 0: sums, 1: and the projection, 2: and the digest."""
    state = row[0].item()
    if kind == "gradient" and state == 0:
        return "None"
    if kind == "buffer" and shape == ():
        return f"value={row[1].item():.6g}"
    text = f"sum={row[1].item():.6g} sumsq={row[2].item():.6g}"
    text += f" proj={row[3].item():.6g}" if detail >= 1 else ""
    text += f" digest={int(row[4].item())}" if detail >= 2 else ""
    return text + (" requires_grad=False" if kind == "parameter" and not state else "")


def _owner(module, name: str) -> str:
    """"in BatchNorm1d '1'" for buffer '1.running_mean'; "in Net (the model)" for a root buffer."""
    path = name.rpartition(".")[0]
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        return ""
    return f" in {type(owner).__name__} " + (f"'{path}'" if path else "(the model)")


def _config_lines(all_modes: list) -> tuple[list[str], list[int]]:
    """Modules whose hyperparameters (:func:`_config`) differ from rank 0's, or that only some
    ranks hold; the ranks that differ."""
    ref = {n: dict(cfg) for n, _, _, cfg in all_modes[0]}
    lines, differ = [], []
    for r, modes in enumerate(all_modes[1:], start=1):
        for n, c, _, cfg in modes:
            what = f"module '{n}' ({c})" if n else f"the model ({c})"
            if n not in ref:
                lines.append(f"  {what} only on rank {r}")
                differ += [r] if r not in differ else []
                continue
            theirs = ref[n]
            pairs = [(f"{k}={theirs[k]!r}", f"{k}={v!r}") for k, v in cfg
                     if k in theirs and k != "extra_repr()" and repr(v) != repr(theirs[k])]
            a, b = str(theirs.get("extra_repr()", "")), str(dict(cfg).get("extra_repr()", ""))
            if not pairs and a != b:  # the parts of extra_repr() that differ
                x, y = a.split(", "), b.split(", ")
                pairs = [(p, q) for p, q in zip(x, y) if p != q] if len(x) == len(y) else [(repr(a), repr(b))]
            if pairs:
                lines.append(f"  {what}: " + ", ".join(f"{x} on rank 0, {y} on rank {r}" for x, y in pairs))
                differ += [r] if r not in differ else []
    return lines, differ


def _modes_lines(all_modes: list) -> tuple[list[str], list[int]]:
    """Modules whose train()/eval() mode differs from rank 0's, top-most only; the ranks that differ."""
    ref = {n: (c, t) for n, c, t, _ in all_modes[0]}
    lines, differ = [], []
    for r, modes in enumerate(all_modes[1:], start=1):
        diff = [(n, c, t) for n, c, t, _ in modes if n in ref and ref[n][1] != t]
        if not diff:
            continue
        differ.append(r)
        names = [n for n, _, _ in diff]
        for n, c, t in diff:
            if any(m != n and (m == "" or n.startswith(m + ".")) for m in names):
                continue  # a parent module is named
            below = sum(1 for m in names if m != n and (n == "" or m.startswith(n + ".")))
            what = f"module '{n}' ({c})" if n else f"the model ({c})"
            what += f" and {below} submodule{'s' * (below != 1)}" if below else ""
            ref_mode = "train()" if ref[n][1] else "eval()"
            lines.append(f"  {what}: {ref_mode} on rank 0, {'train()' if t else 'eval()'} on rank {r}")
    return lines, differ


def _ranks(rs, verbs: tuple[str, str] = ("", "")) -> str:
    """'rank 1 differs', 'ranks 1, 2 differ' for ``verbs=(' differs', ' differ')``."""
    one = len(rs := list(rs)) == 1
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
        elif mine != ref_map or list(mine) != list(ref_map):
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
    ignores are skipped. Always compared: parameters (values and their order), the
    ``train()``/``eval()`` mode and the hyperparameters of each submodule, integer buffers
    (counters). One small exchange when they agree (the module docstring); the full comparison
    and its message only when they do not. Not seen: a float and its negative swapped (:func:`digests`).

    Args:
        module: an ``nn.Module`` or a ``DistributedDataParallel`` around one.
        grads: also compare each parameter's ``.grad`` (a None grad on some ranks only differs).
        buffers: also compare floating-point buffers (BatchNorm running statistics); integer
            buffers (counters) are always compared.
        group: the process group (default: the default group). Ranks in messages are group ranks.
        atol: allowed absolute difference of each fingerprint value (sum, sum of squares,
            projection: :func:`fingerprint`), not of each element; 0 means bitwise-equal tensors.

    Raises:
        ReplicasDiverged: on every rank, with the same message: the first diverging tensors (at
            most 3 named, a buffer with its module), the ranks that differ from rank 0, their
            values, the usual causes; modules in another train()/eval() mode than on rank 0, or
            with other hyperparameters (``p=0.5 on rank 0, p=0.0 on rank 1``); or a
            model whose names/shapes differ across ranks; or, for a DDP model, parameters added,
            replaced, removed or whose requires_grad changed since the wrap.
        RuntimeError: no process group is initialised.
    """
    _check(module, grads, buffers, group, atol, quick=True)


def _check(module, grads: bool, buffers: bool, group, atol: float, quick: bool) -> None:
    """:func:`assert_in_sync`; ``quick=False`` skips the every-call check (the benchmark times both)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("assert_in_sync needs a process group: call it inside the ranks (a launch or "
                           "helpers.mp worker, ranks.run, a %%px cell) after init_process_group.")
    world = dist.get_world_size(group)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    inner, ignored, ddp = _unwrap(module)
    entries, modes = _walk(inner, ignored, grads, buffers)
    named = [(n, t) for kind, n, t, _, _ in entries if kind == "parameter"]
    notes = _ddp_notes(ddp, named) if ddp is not None else []
    if quick and _quick_agree(entries, modes, notes, grads, buffers, group, world, device):
        return
    _full_check(inner, entries, modes, notes, grads, buffers, group, world, device, atol)


def _digest(entries, modes, grads, buffers) -> int:
    """63 bits of a hash of everything but the values: names, shapes, states, modes, hyperparameters, options (the
    same on every rank, unlike Python's ``hash``; remembered for the last few models)."""
    key = (tuple([(k, n, st, s) for k, n, _, st, s in entries]), tuple([m[2:] for m in modes]), grads, buffers)
    if key not in _digests:
        if len(_digests) > 64:
            _digests.clear()
        text = repr(([list(e) for e in key[0]], list(key[1]), grads, buffers)).encode()
        _digests[key] = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1
    return _digests[key]


def _quick_agree(entries, modes, notes, grads, buffers, group, world, device) -> bool:
    """The every-call check: one exchange of ``2 + SLOTS`` int64 (:func:`_digest`, the count of notes,
    the digests: digest i adds to slot i % SLOTS, times 1 + i // SLOTS, modulo 2**63); True when all
    ranks agree and no rank has a note about its DDP wrap."""
    slots = [_digest(entries, modes, grads, buffers), len(notes)] + [0] * SLOTS
    for i, d in enumerate(_raw_digests([e[2] for e in entries if e[2] is not None], _JOIN)):
        slots[2 + i % SLOTS] = (slots[2 + i % SLOTS] + d * (i // SLOTS + 1)) % 2**63
    vec = torch.from_numpy(numpy.array(slots, dtype=numpy.int64)).to(device)  # numpy: faster from ints
    return torch.equal(_exchange(vec, group, world), vec.expand(world, -1)) and not notes


def _full_check(inner, entries, modes, notes, grads, buffers, group, world, device, atol) -> None:
    """The comparison that names what differs (extra collectives); raises ReplicasDiverged or returns."""
    names = _digest([(k, n, None, 0.0, s) for k, n, _, _, s in entries], [], grads, buffers)  # not states
    header = torch.tensor([len(entries), names, len(notes)], dtype=torch.int64, device=device)
    headers = _exchange(header, group, world).cpu()
    if not bool((headers[:, :2] == headers[0, :2]).all()):
        infos = [None] * world
        opts = f"grads={grads}, buffers={buffers}"
        dist.all_gather_object(infos, (opts, [(k, n, s) for k, n, _, _, s in entries]), group=group)
        raise ReplicasDiverged(_structure_message(infos))

    all_modes = [None] * world
    dist.all_gather_object(all_modes, modes, group=group)
    mode_lines, mode_ranks = _modes_lines(all_modes)
    config_lines, config_ranks = _config_lines(all_modes)

    problems, differ = [], set()
    if entries:
        tensors = [t for _, _, t, _, _ in entries]
        table = torch.cat([torch.stack([fingerprint(t, state).to(device) for _, _, t, state, _ in entries]),
                           digests(tensors, device).to(torch.float64)[:, None]], dim=1)
        tables = _exchange(table, group, world).cpu()  # (world, tensors, 5)
        ref = tables[0]
        same = ((tables - ref).abs() <= atol) | (tables == ref) | (tables.isnan() & ref.isnan())
        same[..., 4] = True if atol > 0 else tables[..., 4] == ref[..., 4]  # atol: the 4 values only
        bad = ~same.all(dim=2)  # (world, tensors)
        differ = {r for r in range(1, world) if bool(bad[r].any())}
        for i in bad.any(dim=0).nonzero().flatten().tolist():
            kind, name, _, _, shape = entries[i]
            rs = [r for r in range(1, world) if bad[r, i]]
            detail = max(int(bool(same[r, i, 1:3].all())) + int(bool(same[r, i, 1:4].all())) for r in rs)
            near = any(torch.isclose(tables[r, i, 1:3], ref[i, 1:3], rtol=1e-12, atol=0).all() for r in rs)
            detail = 2 if near else detail  # the sums agree up to their rounding: show the digests
            values = "; ".join(f"rank {r} {_describe(kind, tables[r, i], shape, detail)}"
                               for r in [0] + rs[:_SHOWN])
            where = _owner(inner, name) if kind == "buffer" else ""
            moved = (" (the same sum and sum of squares: values moved within the tensor, or changed below "
                     "their rounding)") if near else ""
            problems.append((kind, tensors[i], f"  {kind} '{name}' {shape}{where}: {values}{moved}"))

    ddp_lines = []
    if bool((headers[:, 2] > 0).any()):
        all_notes = [None] * world
        dist.all_gather_object(all_notes, notes, group=group)
        ranks_of = {n: [r for r, ns in enumerate(all_notes) if n in ns] for ns in all_notes for n in ns}
        ddp_lines = [f"  {n} ({_ranks(rs)})" for n, rs in ranks_of.items()]

    if not problems and not ddp_lines and not mode_lines and not config_lines:
        return
    text, differs = [], (" differs", " differ")
    if config_lines:
        text.append(f"Replicas differ: {_ranks(config_ranks, differs)} from rank 0 in module configuration "
                    f"(hyperparameters):\n{_first(config_lines)}\nBuild the model with the same arguments "
                    "on every rank (a rank-dependent branch or config).")
    if mode_lines:
        text.append(f"Replicas differ: {_ranks(mode_ranks, differs)} from rank 0 in train()/eval() mode:\n"
                    + _first(mode_lines))
    if problems:
        text.append(f"Replicas differ: {_ranks(sorted(differ), differs)} from rank 0 ({len(problems)} of "
                    f"{len(entries)} tensors):\n" + _first([line for _, _, line in problems]))
    if ddp_lines:
        text.append("The DDP model changed after DistributedDataParallel(...) wrapped it (wrap it again "
                    "after the change):\n" + _first(ddp_lines))
    floats = {t.is_floating_point() for k, t, _ in problems if k == "buffer"}  # buffers that differ
    for note, show in ((MODES_NOTE, mode_lines), (BUFFERS_NOTE, True in floats), (COUNTERS_NOTE, False in floats),
                       (CAUSES, problems or ddp_lines)):
        text += [note] if show else []
    raise ReplicasDiverged("\n".join(text))
