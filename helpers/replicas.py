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
import re
import weakref

import numpy
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from helpers import replicas_text as text

__all__ = ["assert_in_sync", "fingerprint", "digests", "ReplicasDiverged", "SAMPLE", "SLOTS"]

#: Elements of each tensor (evenly strided) in the fingerprint's pseudo-random projection.
SAMPLE = 64
#: Values the every-call check folds the per-tensor digests into (tensor i adds to slot i % SLOTS).
SLOTS = 64
_PRIME = 2_147_483_647  # digests are kept modulo this prime: they fit float64 and int64 sums exactly
_PROJECTION = torch.rand(SAMPLE, generator=torch.Generator().manual_seed(30), dtype=torch.float64) * 2 - 1
# Kept between calls, for the every-call check's speed: see the function that fills each.
_positions: dict = {}
_views: dict = {}  # id(tensor) -> (weak reference, data_ptr, numel, bits); dropped with the tensor
_digests: dict = {}
_wraps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_READ: dict = {}  # (class, attribute names) -> (public names, sorted; extra_repr() is not torch.nn's)

class ReplicasDiverged(AssertionError):
    """The replicas differ across ranks; every rank raises it with the same message."""


def fingerprint(t: torch.Tensor | None, state: float = 1.0) -> torch.Tensor:
    """Four float64 values on ``t``'s device: ``[state, sum, sum of squares, projection]``, the
    projection: :data:`SAMPLE` evenly strided elements dotted with fixed pseudo-random weights in
    [-1, 1). ``t=None`` gives ``[state, 0, 0, 0]`` on the CPU. It misses values permuted where no
    sampled element changed and changes below float64 rounding: :func:`digests` sees both."""
    if t is None:
        return torch.tensor([state, 0.0, 0.0, 0.0], dtype=torch.float64)
    t = t if t.layout == torch.strided else t.detach().coalesce().values() if t.is_sparse else t.to_dense()
    t = t.dequantize() if t.is_quantized else t
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
    it per length (views; forgotten every 4,096 lengths)."""
    if (w := _positions.get((n, dtype, device))) is not None:
        return w
    w = _positions.get((dtype, device))
    if w is None or w.numel() < n:
        h = torch.arange(max(n, 1024), dtype=torch.int64) * -7046029254386353131  # 0x9E3779B97F4A7C15
        h = (h ^ (h >> 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9, wrapping as in C
        h = ((h ^ (h >> 27)) * -7723592293110705685) if dtype == torch.int64 else (h >> 33)
        w = (h.to(dtype) | 1).to(device)
        _positions.clear()  # the slices of a shorter one kept it alive
    elif len(_positions) > 4096:
        _positions.clear()
    _positions[(dtype, device)] = w
    _positions[(n, dtype, device)] = w = w[:n]
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as flat int32/int64 (1, 2 bytes widened; complex as pairs), a view kept while
    ``t`` keeps its memory and stays contiguous, or a copy. Sparse COO: its indices, then its values;
    quantized: its values (dequantized)."""
    hit = _views.get(key := id(t))
    if hit is not None and hit[0]() is t and hit[1] == t.data_ptr() and hit[2] == t.numel() and t.is_contiguous():
        return hit[3]
    if t.layout != torch.strided or t.is_quantized:
        if not t.is_sparse:
            return _bits(t.dequantize() if t.is_quantized else t.to_dense())
        c = t.detach().coalesce()
        parts = [_bits(c.indices()), _bits(c.values())]
        return torch.cat([x if x.dtype == torch.int32 else x.view(torch.int32) for x in parts])
    with torch.no_grad():  # a view of the bits of a tensor that requires grad
        x = torch.view_as_real(t) if t.is_complex() else t
        view, acc = _INT_VIEW[x.element_size()]
        x = x.reshape(-1).view(view)
    if view != acc:
        return x.to(acc)
    if t.is_contiguous():  # a view, in the order of the elements (reshape copies a non-contiguous tensor)
        _views[key] = (weakref.ref(t, lambda _: _views.pop(key, None)), t.data_ptr(), t.numel(), x)
    return x


def _raw_digests(tensors: list) -> list[int]:
    """Per tensor ``sum(bits[i] * w[i])`` (:func:`_bits`, :func:`_position_weights`), wrapping, as a
    Python int. No None in ``tensors``."""
    out = []
    for t in tensors:
        x = _bits(t)
        w = _position_weights(x.numel(), x.dtype, x.device)
        out.append(int(torch.dot(x, w) if x.is_cpu else x.mul(w).sum(dtype=x.dtype)))  # CPU: no temporary
    return out


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
    """(the learner's module, names DDP ignores, the outermost DDP wrapper or None); looks through
    DDP (``.module``) and torch.compile (``._orig_mod``)."""
    ddp, ignored = None, set()
    while isinstance(module, DistributedDataParallel) or isinstance(getattr(module, "_orig_mod", None),
                                                                    torch.nn.Module):
        if isinstance(module, DistributedDataParallel):
            ddp = ddp or module
            ignored |= set(getattr(module, "parameters_to_ignore", ()))
        module = module.module if isinstance(module, DistributedDataParallel) else module._orig_mod
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
    if empty := [n for n, p in params if isinstance(p, torch.nn.parameter.UninitializedTensorMixin) or p.is_meta]:
        raise RuntimeError(f"assert_in_sync: parameter '{empty[0]}' holds no values yet (a lazy module before its "
                           "first forward, or a module on the meta device): run one forward, or materialise it, "
                           "on every rank first.")
    out = [("parameter", n, p, float(p.requires_grad), tuple(p.shape)) for n, p in params]
    if grads:
        out += [("gradient", n, p.grad, float(p.grad is not None), tuple(p.shape)) for n, p in params]
    return out + bufs, modes


_SCALARS = {bool, int, float, str, type(None)}
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)  # training, _parameters, _buffers, hooks, ...
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # "<function f at 0x7f...>": another address in each process


def _plain(v) -> bool:
    return type(v) in _SCALARS or (type(v) is tuple and all(map(_plain, v)))


def _config(m) -> tuple:
    """A module's hyperparameters, as ``(name, repr of the value)`` pairs: its public attributes of
    plain types (bool, int, float, str, None, tuples of them), such as Dropout's ``p``, BatchNorm's ``eps`` and
    ``momentum`` or ``self.scale = 2.0``, then its ``extra_repr()`` (memory addresses left out) unless
    torch.nn defines it (torch.nn's show only plain attributes)."""
    d = m.__dict__
    key = (type(m), tuple(d))
    if (read := _READ.get(key)) is None:
        if len(_READ) > 256:
            _READ.clear()
        names = sorted(k for k in d if k[0] != "_" and k not in _MODULE_KEYS)
        _READ[key] = read = (names, not type(m).extra_repr.__module__.startswith("torch.nn."))
    plain = tuple([(k, repr(d[k])) for k in read[0] if _plain(d[k])])  # repr: -0.0 is not 0.0, True not 1
    if not read[1]:
        return plain
    try:
        own = _ADDRESS.sub("", m.extra_repr())
    except Exception as e:  # noqa: BLE001 - the rank must still take part in the exchange
        own = f"<extra_repr() raised {type(e).__name__}>"
    return (*plain, ("extra_repr()", own))


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


def assert_in_sync(module: torch.nn.Module, *, grads: bool = False, buffers: bool = False,
                   group=None, atol: float = 0.0) -> None:
    """Check that every rank of ``group`` holds the same ``module``; a collective.

    Every rank of the group must call it (the same number of times, with the same options): a
    rank that does not call it leaves the others waiting until the group's timeout. A DDP model is
    unwrapped (``.module``), so names are the module's own (no ``module.`` prefix); parameters DDP
    ignores are skipped. Always compared: parameters (values, their order, dtypes), the submodules
    (names, classes, ``train()``/``eval()`` mode, hyperparameters), integer buffers (counters). One
    small exchange when they agree (the module docstring); the full comparison and its message only
    when they do not. Not seen: a float and its negative swapped (:func:`digests`). A rank outside
    ``group`` returns at once, as torch's collectives do.

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
            values, the usual causes; modules in another train()/eval() mode than on rank 0, of
            another class, on some ranks only, or with other hyperparameters (``p=0.5 on rank 0,
            p=0.0 on rank 1``); or a model whose names, shapes or dtypes differ across ranks; or,
            for a DDP model, parameters added, replaced, removed or whose requires_grad changed
            since the wrap.
        RuntimeError: no process group is initialised.
    """
    _check(module, grads, buffers, group, atol, quick=True)


def _check(module, grads: bool, buffers: bool, group, atol: float, quick: bool) -> None:
    """:func:`assert_in_sync`; ``quick=False`` skips the every-call check (the benchmark times both)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("assert_in_sync needs a process group: call it inside the ranks (a launch or "
                           "helpers.mp worker, ranks.run, a %%px cell) after init_process_group.")
    if group is not None and dist.get_rank(group) < 0:
        return  # this rank is not in ``group``: torch's collectives return at once there too
    world = dist.get_world_size(group)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    inner, ignored, ddp = _unwrap(module)
    entries, modes = _walk(inner, ignored, grads, buffers)
    named = [(n, t) for kind, n, t, _, _ in entries if kind == "parameter"]
    notes = _ddp_notes(ddp, named) if ddp is not None else []
    if quick and _quick_agree(entries, modes, notes, grads, buffers, group, world, device):
        return
    _full_check(inner, entries, modes, notes, grads, buffers, group, world, device, atol, quick)


def _dtype(kind: str, t):
    """The dtype compared for a tensor: a gradient's is its parameter's, a None one has none."""
    return None if kind == "gradient" or t is None else t.dtype


def _digest(entries, modes, grads, buffers) -> int:
    """63 bits of a hash of everything but the values: names, shapes, dtypes, states, modules (name,
    class, mode, hyperparameters; sorted by name: the order they were registered in does not count),
    options (the same on every rank, unlike Python's ``hash``; remembered for the last few models)."""
    key = (tuple([(k, n, st, s, _dtype(k, t)) for k, n, t, st, s in entries]), tuple(sorted(modes)), grads, buffers)
    if key not in _digests:
        if len(_digests) > 64:
            _digests.clear()
        blob = repr(([list(e) for e in key[0]], list(key[1]), grads, buffers)).encode()
        _digests[key] = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "big") >> 1
    return _digests[key]


def _quick_agree(entries, modes, notes, grads, buffers, group, world, device) -> bool:
    """The every-call check: one exchange of ``2 + SLOTS`` int64 (:func:`_digest`, the count of notes,
    the digests: digest i adds to slot i % SLOTS, times the odd 2 * (i // SLOTS) + 1, modulo 2**64, so
    that any one digest's change, 2**63 included, changes its slot); True when all ranks agree and no
    rank has a note about its DDP wrap. One rank agrees with itself: no exchange."""
    if world == 1:
        return not notes
    slots = [_digest(entries, modes, grads, buffers), len(notes)] + [0] * SLOTS
    for i, d in enumerate(_raw_digests([e[2] for e in entries if e[2] is not None])):
        slots[2 + i % SLOTS] = (slots[2 + i % SLOTS] + d * (2 * (i // SLOTS) + 1)) % 2**64
    vec = torch.from_numpy(numpy.array(slots, dtype=numpy.uint64).view(numpy.int64)).to(device)  # numpy: faster
    return torch.equal(_exchange(vec, group, world), vec.expand(world, -1)) and not notes


def _full_check(inner, entries, modes, notes, grads, buffers, group, world, device, atol, quick) -> None:
    """The comparison that names what differs (extra collectives); raises ReplicasDiverged, or returns
    when nothing differs (with ``quick``, the every-call check found a difference: then it raises)."""
    names = _digest([(k, n, t, 0.0, s) for k, n, t, _, s in entries], [], grads, buffers)  # not states
    header = torch.tensor([len(entries), names, len(notes)], dtype=torch.int64, device=device)
    headers = _exchange(header, group, world).cpu()
    if not bool((headers[:, :2] == headers[0, :2]).all()):
        infos = [None] * world
        struct = [(k, n, s, str(_dtype(k, t))) for k, n, t, _, s in entries]
        dist.all_gather_object(infos, (f"grads={grads}, buffers={buffers}", struct), group=group)
        raise ReplicasDiverged(text.structure_message(infos))

    all_modes = [None] * world
    dist.all_gather_object(all_modes, modes, group=group)
    tensors = [], set()
    if entries:
        table = torch.cat([torch.stack([fingerprint(t, state).to(device) for _, _, t, state, _ in entries]),
                           digests([e[2] for e in entries], device).to(torch.float64)[:, None]], dim=1)
        tables = _exchange(table, group, world).cpu()  # (world, tensors, 5)
        ref = tables[0]
        same = ((tables - ref).abs() <= atol) | (tables == ref) | (tables.isnan() & ref.isnan())
        same[..., 4] = True if atol > 0 else tables[..., 4] == ref[..., 4]  # atol: the 4 values only
        tensors = text.tensor_lines(inner, entries, tables, same)

    ddp_lines = []
    if bool((headers[:, 2] > 0).any()):
        all_notes = [None] * world
        dist.all_gather_object(all_notes, notes, group=group)
        ranks_of = {n: [r for r, ns in enumerate(all_notes) if n in ns] for ns in all_notes for n in ns}
        ddp_lines = [f"  {n} ({text.ranks(rs)})" for n, rs in ranks_of.items()]
    said = text.message(world, len(entries), text.config_lines(all_modes), text.modes_lines(all_modes), tensors,
                        ddp_lines)
    if said or (quick and atol == 0):
        raise ReplicasDiverged(said or text.UNNAMED)
