"""What :mod:`helpers.checks` records inside each rank, with no change to the learner's code, and
how the records come back: torch's global optimizer step hooks (parameters before the first and
after every step, by module path from the global forward pre-hook), the ``DataLoader`` iterator's
``_next_index`` and ``DistributedSampler.__iter__`` (the indices each pass reads). The hooks are
process-wide; each rank's records are per thread, so simulated ranks (threads) and real ones
(processes, :class:`Recorded` pickled by cloudpickle) work alike.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import weakref

import torch
import torch.nn as nn
import torch.utils.data as tud
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["Recorded", "run_recorded"]

_local = threading.local()  # .rec: the _Records of the rank running on this thread (None outside)
_lock = threading.Lock()
_installed: list = []  # [count, handles...]


def _rec():
    return getattr(_local, "rec", None)


def _forward_pre(module, args):
    rec = _rec()
    if rec is not None and rec.naming and module not in rec.seen:
        rec.seen[module] = None


def _value(p: torch.Tensor, seen: list) -> torch.Tensor:
    """A detached CPU copy of ``p`` (a DTensor, FSDP2's, gives its full tensor: a collective), or the
    copy another simulated rank stored with the same bits: ``seen`` holds ``(bytes, copy)`` of each
    distinct value at this step, so 64 equal replicas are stored and compared once."""
    if hasattr(p, "full_tensor"):
        p = p.full_tensor()
    p = p.detach().to("cpu", copy=True)
    bits = p.reshape(-1).view(torch.uint8).numpy().tobytes()  # any dtype, bfloat16 included
    with _lock:
        for other_bits, other in seen:
            if other_bits == bits and other.dtype == p.dtype and other.shape == p.shape:  # bytes: 40x torch.equal
                return other
        seen.append((bits, p))
    return p


def _step_pre(opt, args, kwargs):
    rec = _rec()
    if rec is None:
        return
    rec.depth += 1
    if rec.depth == 1 and not rec.steps:  # the parameters before the first step: "step 0"
        rec.steps.append(rec.snapshot(opt))


def _step_post(opt, args, kwargs):
    rec = _rec()
    if rec is None:
        return
    rec.depth -= 1
    if rec.depth == 0:  # ZeroRedundancyOptimizer's inner optimizer steps inside the outer one
        rec.steps.append(rec.snapshot(opt))
        if rec.perturb is not None:
            torch.manual_seed(rec.perturb + len(rec.steps))


def _next_index(self):
    try:
        index = _ORIGINAL_NEXT_INDEX(self)
    except StopIteration:
        self.__dict__.setdefault("_check", {"read": []})["done"] = True
        raise
    if _rec() is not None:  # a multi-worker iterator prefetches from its __init__: the record starts here
        read = self.__dict__.setdefault("_check", {"read": []})["read"]
        read += index if isinstance(index, (list, tuple)) else [index]
    return index


_ORIGINAL_NEXT_INDEX = _BaseDataLoaderIter._next_index
_ORIGINAL_ITER = tud.DataLoader.__iter__


def _loader_iter(self):
    if _rec() is not None and getattr(self, "_iterator", None) is not None:  # persistent workers: one
        self._iterator.__dict__.pop("_check", None)  # iterator for every pass, so a new record per pass
    it = _ORIGINAL_ITER(self)
    rec = _rec()
    if rec is not None:
        rec.new_pass(self, it, self.dataset, _sampler_facts(self.sampler, self.drop_last))
    return it


def _sampler_pass(it, check: dict):
    """A DistributedSampler iterated outside a DataLoader (``list(sampler)``, indexing in-memory
    tensors): one pass, recorded as it is consumed."""
    for i in it:
        check["read"].append(i)
        yield i
    check["done"] = True


def _sampler_iter(self):
    it = _ORIGINAL_SAMPLER_ITER(self)
    rec = _rec()
    if rec is None or sys._getframe(1).f_code.co_filename.startswith(_TORCH_DATA):  # a DataLoader's own
        return it
    check = {"read": []}
    rec.new_pass(self, None, self.dataset, _sampler_facts(self, False), check)
    return _sampler_pass(it, check)


_ORIGINAL_SAMPLER_ITER = tud.DistributedSampler.__iter__
_TORCH_DATA = os.path.dirname(tud.__file__)


def _install() -> None:
    with _lock:
        if not _installed:
            _installed[:] = [0, register_optimizer_step_pre_hook(_step_pre),
                             register_optimizer_step_post_hook(_step_post),
                             nn.modules.module.register_module_forward_pre_hook(_forward_pre)]
            _BaseDataLoaderIter._next_index, tud.DataLoader.__iter__ = _next_index, _loader_iter
            tud.DistributedSampler.__iter__ = _sampler_iter
        _installed[0] += 1


def _uninstall() -> None:
    with _lock:
        _installed[0] -= 1
        if _installed[0] == 0:
            for h in _installed[1:]:
                h.remove()
            _BaseDataLoaderIter._next_index, tud.DataLoader.__iter__ = _ORIGINAL_NEXT_INDEX, _ORIGINAL_ITER
            tud.DistributedSampler.__iter__ = _ORIGINAL_SAMPLER_ITER
            _installed.clear()


def _sampler_facts(s, drop_last: bool) -> dict:
    """What explains a pass's duplicates and gaps: the DistributedSampler's and DataLoader's settings."""
    facts = {"drop_last": bool(drop_last)}
    if isinstance(s, tud.DistributedSampler):
        facts.update(sampler_rank=s.rank, num_replicas=s.num_replicas, sampler_drop_last=s.drop_last,
                     seed=s.seed, epoch=s.epoch, total_size=s.total_size)
    return facts


class _Records:
    """One rank's records: parameters after each optimizer step, indices read per loader pass."""

    def __init__(self, perturb, shared: dict):
        self.perturb, self.depth, self.naming, self.shared = perturb, 0, True, shared
        self.seen: dict = {}  # modules whose forward ran, outermost first (an ordered set)
        self.names: dict[int, str] = {}
        self.steps: list[dict[str, torch.Tensor]] = []
        self.passes: list = []  # per pass: (dataset number, facts, record, len(dataset), sample hashes, Subset)
        self.datasets: list = []  # weak references: a dataset is not kept alive, and a new one gets a new number

    def snapshot(self, opt) -> dict[str, torch.Tensor]:
        if self.naming:
            for m in self.seen:
                strip = "module." if isinstance(m, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else ""
                for n, p in m.named_parameters():
                    self.names.setdefault(id(p), n[len(strip):] if strip and n.startswith(strip) else n)
            self.naming = False
            self.seen.clear()
        with _lock:
            seen = self.shared.setdefault(len(self.steps), {})
        out = {}
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                name = self.names.get(id(p), f"{type(opt).__name__}.param_groups[{g}][{i}]")
                with _lock:
                    distinct = seen.setdefault(name, [])
                out[name] = _value(p, distinct)
        return out

    def new_pass(self, source, it, dataset, facts, check=None) -> None:
        """A pass of ``source`` (a DataLoader or a DistributedSampler) over ``dataset`` by iterator
        ``it`` (or recorded in ``check``); a ``Subset`` (``random_split``'s parts) counts as the
        dataset it reads from."""
        dataset, within = _base(dataset)
        number = next((i for i, d in enumerate(self.datasets) if d() is dataset), len(self.datasets))
        try:
            self.datasets[number:number + 1] = [weakref.ref(dataset)]
        except TypeError:  # a class with __slots__ and no __weakref__: held
            self.datasets[number:number + 1] = [lambda: dataset]
        iterable = isinstance(dataset, tud.IterableDataset)
        digests = None
        if iterable:
            digests, inner = [], it._next_data

            def counted():
                batch = inner()
                digests.extend(_digests(batch, source.batch_size is None))
                return batch
            it._next_data = counted
        check = check if check is not None else it.__dict__.setdefault("_check", {"read": []})
        self.passes.append((number, facts, check,
                            None if iterable else len(dataset), digests, within))

    def result(self, fn_result) -> dict:
        passes = [(n, facts, [w[i] for i in c["read"]] if w else c["read"], c.get("done", False), size, digests, w)
                  for n, facts, c, size, digests, w in self.passes]
        return {"steps": self.steps, "passes": passes, "result": fn_result}


def _base(dataset) -> tuple:
    """``(dataset, None)``, or for a chain of ``Subset``: the dataset it reads and its indices there."""
    within = None
    while isinstance(dataset, tud.Subset):
        within = list(dataset.indices) if within is None else [dataset.indices[i] for i in within]
        dataset = dataset.dataset
    return dataset, within


def _digests(batch, one_sample: bool) -> list[str]:
    """One short hash per sample of a collated batch (rows of its tensors), or of the whole."""
    leaves = [t for t in (batch if isinstance(batch, (list, tuple)) else
                          batch.values() if isinstance(batch, dict) else [batch]) if isinstance(t, torch.Tensor)]
    if not leaves:
        return [hashlib.sha1(repr(batch).encode()).hexdigest()[:12]]
    if one_sample or leaves[0].dim() == 0:
        leaves = [t.unsqueeze(0) for t in leaves]
    return [hashlib.sha1(b"".join(t[i].detach().cpu().contiguous().numpy().tobytes() for t in leaves)).hexdigest()[:12]
            for i in range(len(leaves[0]))]


class Recorded:
    """``fn`` with the recording around it: picklable (cloudpickle takes ``fn`` by value when needed),
    run by ``launch`` in a new process or by ``simulate`` on a thread; returns the rank's records."""

    def __init__(self, fn, perturb=None):
        self.fn, self.perturb, self.partial, self.shared = fn, perturb, {}, {}  # simulated ranks' records, live

    def __call__(self, rank, world_size, *args, **kwargs):
        _install()
        _local.rec = rec = self.partial[rank] = _Records(self.perturb, self.shared)
        try:
            out = self.fn(rank, world_size, *args, **kwargs)
        finally:
            _local.rec = None
            _uninstall()
        return rec.result(out)


def run_recorded(fn, world_size, args, kwargs, simulated, timeout, perturb=None) -> list[dict]:
    """Each rank's records ``{"steps", "passes", "result"}`` of ``fn`` on simulated or real gloo ranks;
    ``perturb``: reseed torch's default generator after every step (seeds ``perturb + step``)."""
    from helpers.engine import launch, simulate

    wrapped = Recorded(fn, perturb)
    try:
        if simulated:
            return simulate(wrapped, world_size, *args, timeout=timeout, **kwargs)
        return launch(wrapped, world_size, *args, backend="gloo", timeout=timeout, **kwargs)
    except Exception as e:  # a rank failed: what simulated ranks recorded before it, for the comparison
        if len(wrapped.partial) == world_size:
            e.partial_steps = [wrapped.partial[r].steps for r in range(world_size)]
        raise
