"""Two general checks of the learner's own, unchanged worker ``fn(rank, world_size, *args)``:

- :func:`against_one_process`: do ``world_size`` ranks train what one process trains on the same
  global batch? (Invariant 1: a scaled loss, per-rank statistics, a per-rank init, a loss mixing
  local and global terms each make the runs part.)
- :func:`data_coverage`: does each epoch read each item once, across all ranks? (Invariant 2: a
  sampler with the wrong rank or a per-rank seed, drop_last twice, a resume mid-epoch, sharding
  decided before the process group exists.)

Both run ``fn`` on simulated ranks (:func:`helpers.engine.simulate`, the default) or on real gloo
processes (:func:`helpers.engine.launch`, ``simulated=False``) and record from inside each rank with
torch's global hooks, so the learner changes nothing: the optimizer step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``), the global module
forward pre-hook (to name parameters by module path) and the ``DataLoader`` iterator's
``_next_index`` (the indices a pass reads). The third invariant, every rank holds the same model, is
:func:`helpers.replicas.assert_in_sync`.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils.data as tud
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["against_one_process", "data_coverage", "DivergedFromOneProcess", "CoverageError",
           "RandomnessDiffers", "RTOL", "ATOL"]

#: Default tolerance of :func:`against_one_process`: ``|a - b| <= ATOL + RTOL * |b|`` elementwise
#: (``torch.isclose``). Measured: see :func:`against_one_process`.
RTOL = 1e-4
ATOL = 1e-6
CONVENTION = ("Convention: one global batch. Each of the N ranks trains on global batch / N items, "
              "the one-process run on the whole global batch, in the same order.")
_SHOWN = 8  # items, ranks, names listed in a message before "and N more"


class DivergedFromOneProcess(AssertionError):
    """The ``world_size``-rank run left the one-process run: names the first step, the parameter by
    module path, the ranks, both values and the tolerance."""


class RandomnessDiffers(AssertionError):
    """The one-process run does not repeat itself: a step draws from the default random generators
    (dropout, random augmentation, an unseeded init), so the two runs cannot be compared."""


class CoverageError(AssertionError):
    """A pass of the ranks' loaders did not read each item exactly once across the ranks."""


# ---- recording inside the ranks: global hooks, per-thread records --------------------------------

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
        self._check_done = True
        raise
    if _rec() is not None:  # a multi-worker iterator prefetches from its __init__: the list starts here
        self.__dict__.setdefault("_check_read", []).extend(index if isinstance(index, (list, tuple)) else [index])
    return index


_ORIGINAL_NEXT_INDEX = _BaseDataLoaderIter._next_index
_ORIGINAL_ITER = tud.DataLoader.__iter__


def _loader_iter(self):
    it = _ORIGINAL_ITER(self)
    rec = _rec()
    if rec is not None:
        rec.new_pass(self, it, self.dataset, _sampler_facts(self.sampler, self.drop_last))
    return it


class _SamplerPass:
    """A DistributedSampler iterated outside a DataLoader (``list(sampler)``, indexing in-memory
    tensors): one pass, recorded as it is consumed."""

    def __init__(self, it):
        self._it, self._check_read, self._check_done = it, [], False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            i = next(self._it)
        except StopIteration:
            self._check_done = True
            raise
        self._check_read.append(i)
        return i


def _sampler_iter(self):
    it = _ORIGINAL_SAMPLER_ITER(self)
    rec = _rec()
    if rec is None or sys._getframe(1).f_code.co_filename.startswith(_TORCH_DATA):  # a DataLoader's own
        return it
    it = _SamplerPass(it)
    rec.new_pass(self, it, self.dataset, _sampler_facts(self, False))
    return it


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
        self.passes: list = []  # per pass: (loader number, facts, indices read, len(dataset), sample hashes)
        self.datasets: list = []

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

    def new_pass(self, source, it, dataset, facts) -> None:
        """A pass of ``source`` (a DataLoader or a DistributedSampler) over ``dataset`` by iterator ``it``;
        a ``Subset`` (``random_split``'s parts) counts as the dataset it reads from."""
        dataset, within = _base(dataset)
        number = next((i for i, d in enumerate(self.datasets) if d is dataset), len(self.datasets))
        self.datasets[number:number + 1] = [dataset]  # held, so that no id is reused
        iterable = isinstance(dataset, tud.IterableDataset)
        digests = None
        if iterable:
            digests, inner = [], it._next_data

            def counted():
                batch = inner()
                digests.extend(_digests(batch, source.batch_size is None))
                return batch
            it._next_data = counted
        it.__dict__.setdefault("_check_read", [])
        self.passes.append((number, facts, it, None if iterable else len(dataset), digests, within))

    def result(self, fn_result) -> dict:
        passes = [(n, facts, [w[i] for i in it._check_read] if w else it._check_read,
                   getattr(it, "_check_done", False), size, digests, w)
                  for n, facts, it, size, digests, w in self.passes]
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


class _Recorded:
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


def _run(fn, world_size, args, kwargs, simulated, timeout, perturb=None) -> list[dict]:
    from helpers.engine import launch, simulate

    wrapped = _Recorded(fn, perturb)
    try:
        if simulated:
            return simulate(wrapped, world_size, *args, timeout=timeout, **kwargs)
        return launch(wrapped, world_size, *args, backend="gloo", timeout=timeout, **kwargs)
    except Exception as e:  # a rank failed: what simulated ranks recorded before it, for the comparison
        if len(wrapped.partial) == world_size:
            e.partial_steps = [wrapped.partial[r].steps for r in range(world_size)]
        raise


# ---- against_one_process ---------------------------------------------------------------------------

@dataclass
class OneProcessReport:
    """What :func:`against_one_process` compared: ``steps`` optimizer steps of ``world_size`` ranks
    against one process, ``parameters`` tensors each, the ``largest`` absolute difference seen."""
    world_size: int
    steps: int
    parameters: int
    largest: float
    rtol: float
    atol: float
    results: list = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        return (f"<{self.world_size} ranks = one process: {self.steps} optimizer steps, {self.parameters} parameters "
                f"compared, largest difference {self.largest:.3g} (tolerance rtol={self.rtol:g}, atol={self.atol:g})>")


def _fmt(values) -> str:
    values = list(values)
    return ", ".join(map(str, values[:_SHOWN])) + (f" and {len(values) - _SHOWN} more" if len(values) > _SHOWN else "")


def _first_difference(runs: list[list[dict]], ref: list[dict], steps, rtol, atol):
    """``(step, name, {rank: (index, value, reference)}, largest)`` of the first difference, or
    ``(None, None, {}, largest)``; a missing step or parameter counts as a difference at that step.
    Ranks that stored one shared value (:func:`_value`) are compared once."""
    largest = 0.0
    n = min(len(ref), *(len(r) for r in runs))
    n = n if steps is None else min(n, steps + 1)
    for k in range(n):
        names = set().union(*(run[k] for run in runs)) - set(ref[k])
        for name, b in list(ref[k].items()) + [(extra, None) for extra in sorted(names)]:
            values = [run[k].get(name) for run in runs]
            bad = {r: (None, "absent" if a is None else tuple(a.shape), "absent" if b is None else tuple(b.shape))
                   for r, a in enumerate(values) if a is None or b is None or a.shape != b.shape}
            if bad:
                return k, name, bad, largest
            verdicts: dict = {}  # id of a distinct value (ranks share equal ones) -> None or the difference
            for r, a in enumerate(values):
                if id(a) not in verdicts:
                    diff = (a.double() - b.double()).abs().reshape(-1)
                    largest = max(largest, float(diff.max())) if diff.numel() else largest
                    out = diff > atol + rtol * b.double().abs().reshape(-1)
                    i = int(out.nonzero()[0]) if bool(out.any()) else None  # the first element outside
                    verdicts[id(a)] = None if i is None else (
                        tuple(int(j) for j in torch.unravel_index(torch.tensor(i), b.shape)),
                        a.reshape(-1)[i].item(), b.reshape(-1)[i].item())
                if verdicts[id(a)] is not None:
                    bad[r] = verdicts[id(a)]
            if bad:
                return k, name, bad, largest
    return None, None, {}, largest


def _step_name(k: int) -> str:
    return "before the first optimizer step" if k == 0 else f"after optimizer step {k}"


def against_one_process(fn, world_size: int, *args, simulated: bool = True, steps: int | None = None,
                        rtol: float = RTOL, atol: float = ATOL, timeout: float | None = 300.0,
                        **options) -> OneProcessReport:
    """Run ``fn(rank, world_size, *args, **options)`` at ``world_size`` ranks and at one rank, record every
    parameter before the first and after every optimizer step inside each rank, and compare.

    The convention ``fn`` must follow: **one global batch**. At ``world_size`` ranks each rank trains
    on global batch / ``world_size`` items (its share, e.g. ``x[rank::world_size]`` or a
    ``DistributedSampler``); at one rank the one process trains on the whole global batch, in the same
    order of steps. Under that convention DDP, FSDP2 and ZeRO leave every rank with the one-process
    parameters, up to reduction order. Nothing in ``fn`` changes: torch's global optimizer step hooks
    record the parameters (by module path: ``module.`` of DDP stripped; FSDP2's DTensors gathered
    with ``full_tensor()``; a ``ZeroRedundancyOptimizer`` step recorded once, after its inner step).

    Tolerance (``torch.isclose``: ``|a - b| <= atol + rtol * |b|``): the ranks sum gradients in
    another order than one process does (per-rank means, then the all-reduce's tree or ring), which
    moves float32 results by a few ulps per step. Measured on lesson 09's MLP, 64 simulated ranks,
    10 SGD steps at lr 0.1 (``python3 -m helpers.bench checks`` prints it): the largest difference
    is about 1e-7 (relative 1e-6), so ``rtol=1e-4, atol=1e-6`` leaves 100x room, while the
    mistakes it catches move parameters by 1e-3 or more in the first steps.

    Args:
        fn: the worker, as for :func:`helpers.engine.launch` / :func:`helpers.engine.simulate`.
        world_size: ranks of the run compared with one process.
        *args, **options: passed to ``fn`` after ``rank, world_size``.
        simulated: ``True``: simulated ranks (threads); ``False``: real gloo processes.
        steps: compare only the first ``steps`` optimizer steps (``None``: all of them).
        rtol, atol: the tolerance above.
        timeout: seconds each run may take (``None``: no limit).

    Returns:
        OneProcessReport: steps compared, parameters, the largest difference.

    Raises:
        DivergedFromOneProcess: the first step where a parameter differs beyond the tolerance on
            some rank (or where the step counts or parameter names differ), with both values.
        RandomnessDiffers: the runs differ, and so do two one-process runs: a step draws random
            numbers (dropout, augmentation, an unseeded init) that cannot match across world sizes.
        WorkerError, LaunchTimeout, LaunchError: as :func:`helpers.engine.launch` / ``simulate``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 to compare with one process, got {world_size!r}.")
    try:
        runs = _run(fn, world_size, args, options, simulated, timeout)
    except Exception as e:
        if not hasattr(e, "partial_steps"):
            raise
        ref = _run(fn, 1, args, options, simulated, timeout)[0]["steps"]
        k, name, bad, _ = _first_difference(e.partial_steps, ref, steps, rtol, atol)
        if k is None:
            raise
        raise DivergedFromOneProcess(_diverged(world_size, k, name, bad, rtol, atol)
                                     + f"\nThen a rank failed (the error above), where one process did not.") from e
    ref = _run(fn, 1, args, options, simulated, timeout)[0]["steps"]
    records = [r["steps"] for r in runs]
    k, name, bad, largest = _first_difference(records, ref, steps, rtol, atol)
    counts = sorted({len(r) - 1 for r in records})
    count_differs = steps is None and (counts != [len(ref) - 1]) or (
        steps is not None and min(len(ref) - 1, steps) > min(counts + [steps]))
    if k is None and not count_differs:
        if not ref:
            raise DivergedFromOneProcess(f"fn took no optimizer step at one rank: nothing to compare. {CONVENTION}")
        n = len(ref) - 1 if steps is None else min(len(ref) - 1, steps)
        return OneProcessReport(world_size, n, len(ref[0]), largest, rtol, atol, runs)
    again = _run(fn, 1, args, options, simulated, timeout, perturb=7919)[0]["steps"]
    k2, name2, bad2, _ = _first_difference([again], ref, steps, rtol, atol)
    if k2 is not None or len(again) != len(ref):
        where = f"{_step_name(k2)}, parameter `{name2}`" if k2 is not None else "in the number of steps"
        raise RandomnessDiffers(
            f"The one-process run does not repeat itself once the default random generator is reseeded between "
            f"steps: it differs {where}. Something in a step draws random numbers (dropout, random augmentation, "
            f"random batches from torch's default generator, an unseeded init), and {world_size} ranks cannot draw "
            f"what one process draws. For the check: seed the init (torch.manual_seed in fn), take batches from a "
            f"torch.Generator of your own, and turn dropout and augmentation off (p=0 or model.eval()).")
    if k is None:
        raise DivergedFromOneProcess(
            f"{world_size} ranks took {_fmt(counts)} optimizer steps, one process took {len(ref) - 1}. "
            f"Per-rank step counts must equal the one-process count. {CONVENTION}")
    raise DivergedFromOneProcess(_diverged(world_size, k, name, bad, rtol, atol))


def _diverged(world_size, k, name, bad, rtol, atol) -> str:
    lines = [f"{world_size} ranks left the one-process run {_step_name(k)}: parameter `{name}` differs on "
             f"rank{'s' if len(bad) > 1 else ''} {_fmt(bad)} (of {world_size})."]
    shown: dict = {}  # the same value on several ranks: one line
    for rank, v in bad.items():
        shown.setdefault(v, []).append(rank)
    for (idx, a, b), ranks in list(shown.items())[:3]:
        who = f"rank{'s' if len(ranks) > 1 else ''} {_fmt(ranks)}"
        lines.append(f"  {who}: {name}{list(idx) if idx else ''} = {a:.7g}, one process: {b:.7g}" if idx is not None
                     else f"  {who}: {name} is {a}, one process: {b}")
    lines += [f"Tolerance: |a - b| <= {atol:g} + {rtol:g} * |b| (reduction order).", CONVENTION]
    if k == 0:
        lines.append("The initial parameters differ: seed the init the same on every rank (torch.manual_seed "
                     "before building the model) or broadcast rank 0's (DDP does it when it wraps).")
    return "\n".join(lines)


# ---- data_coverage ----------------------------------------------------------------------------------

@dataclass
class CoverageReport:
    """What :func:`data_coverage` saw: per loader and pass, items read per rank; notes on what
    DistributedSampler's padding or drop_last explained; for an IterableDataset, samples per rank."""
    world_size: int
    passes: list  # (dataset, pass, {rank: items read}, dataset length or None)
    notes: list = field(default_factory=list)
    results: list = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        rows = [f"dataset {ld} pass {e}: " + (f"{n} items, " if n is not None else "")
                + "read per rank " + _fmt(f"{r}:{c}" for r, c in per.items()) for ld, e, per, n in self.passes[:_SHOWN]]
        more = [f"... {len(self.passes) - _SHOWN} more passes"] if len(self.passes) > _SHOWN else []
        return "\n".join([f"<coverage at {self.world_size} ranks: no item read twice in a pass, none missed by a pass that ended>", *rows, *more,
                          *self.notes])


def _explain(facts: list[dict], size: int, world_size: int, missing, twice) -> tuple[list[str], bool]:
    """Lines saying what DistributedSampler's padding or drop_last explains; True when they explain
    all of ``missing`` and ``twice``."""
    dist_facts = [f for f in facts if "num_replicas" in f]
    lines, explained = [], set()
    if dist_facts and len(dist_facts) == len(facts):
        f = dist_facts[0]
        n = f["num_replicas"]
        if n != world_size:
            lines.append(f"DistributedSampler(num_replicas={n}) at {world_size} ranks: pass num_replicas=world_size.")
        ranks = [g["sampler_rank"] for g in facts]
        if len(set(ranks)) < len(ranks):
            lines.append(f"Several ranks built DistributedSampler with the same rank ({_fmt(sorted(ranks))}): pass rank=rank.")
        seeds = {g["seed"] for g in facts}
        if len(seeds) > 1:
            lines.append(f"DistributedSampler's seed differs by rank ({_fmt(sorted(seeds))}): each rank shuffles "
                         f"its own permutation; give every rank the same seed.")
        epochs = {g["epoch"] for g in facts}
        if len(epochs) > 1:
            lines.append(f"DistributedSampler's epoch differs by rank ({_fmt(sorted(epochs))}): call set_epoch(epoch) on every rank.")
        pad = f["total_size"] - size
        if not f["sampler_drop_last"] and pad > 0 and not lines and not missing and len(twice) == pad:
            lines.append(f"DistributedSampler pads {size} items to {f['total_size']} ({n} ranks x "
                         f"{f['total_size'] // n}): the {pad} item(s) read twice are its padding "
                         f"(drop_last=True drops {size % n} instead).")
            explained = True
        if f["sampler_drop_last"] and not lines and not twice and len(missing) == size % n:
            lines.append(f"DistributedSampler(drop_last=True) drops the {size % n} item(s) that do not fill a "
                         f"round of {n} ranks.")
            explained = True
    if any(g["drop_last"] for g in facts) and missing and not explained:
        lines.append("DataLoader(drop_last=True) drops each rank's last partial batch, and DistributedSampler("
                     "drop_last=True) up to world_size - 1 items more: keep at most one of them.")
    return lines, explained


def data_coverage(fn, world_size: int, *args, simulated: bool = True, strict: bool = False,
                  timeout: float | None = 300.0, **options) -> CoverageReport:
    """Run ``fn(rank, world_size, *args, **options)`` and check that each pass of the ranks' loaders
    reads each item of the dataset exactly once across all ranks.

    Inside each rank, every ``DataLoader`` pass (one ``iter(loader)``) records the indices its sampler
    gives (``_BaseDataLoaderIter._next_index``: with worker processes, the indices handed to them,
    prefetched ones included); passes are matched across ranks by dataset (numbered in the order each rank
    first reads it) and pass number. For an ``IterableDataset`` it records a hash of each sample yielded
    (rows of the batch's tensors) and checks that no two ranks yield the same sample.

    Args:
        fn, world_size, *args, **options: as for :func:`helpers.engine.simulate` / ``launch``.
        simulated: ``True``: simulated ranks; ``False``: real gloo processes.
        strict: also raise for what ``DistributedSampler``'s padding (items read twice) or its
            ``drop_last=True`` (fewer than ``world_size`` items left out) explains; by default those are
            notes in the report.
        timeout: seconds the run may take.

    Returns:
        CoverageReport: items read per rank, per loader and pass.

    Raises:
        CoverageError: the first pass that reads an item never, or more than once, or ranks that read the
            same items; says what DistributedSampler's padding or drop_last explains.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    runs = _run(fn, world_size, args, options, simulated, timeout)
    grouped: dict = {}  # (dataset, pass) -> {rank: (facts, indices, size, digests, done, restarted, within)}
    for rank, run in enumerate(runs):
        per_dataset: dict = {}
        for number, facts, indices, done, size, digests, within in run["passes"]:
            mine = per_dataset.setdefault(number, [])
            last = mine[-1] if mine else None
            if last and not last[4] and "epoch" in facts and last[0].get("epoch") == facts["epoch"]:
                # a pass stopped, then the same sampler epoch again: a resume restarting the epoch
                mine[-1] = (last[0], last[1] + indices, size, digests, done, True, within)
            else:
                mine.append((facts, list(indices), size, digests, done, False, within))
        for number, mine in per_dataset.items():
            for e, rec in enumerate(mine):
                grouped.setdefault((number, e), {})[rank] = rec
    report = CoverageReport(world_size, [], results=[r["result"] for r in runs])
    for (loader, epoch), per in sorted(grouped.items()):
        where = f"Dataset {loader} (in the order each rank first reads it), pass {epoch}"
        size = next(iter(per.values()))[2]
        if len(per) < world_size:
            raise CoverageError(f"{where}: only rank(s) {_fmt(sorted(per))} of {world_size} ran it.")
        if size is None:  # IterableDataset: samples by hash
            owners: dict = {}
            for rank, (_, _, _, digests, _, _, _) in per.items():
                for d in digests:
                    owners.setdefault(d, []).append(rank)
            shared = {d: r for d, r in owners.items() if len(r) > 1}
            if shared:
                pairs = Counter(tuple(sorted(set(r)))[:2] for r in shared.values())
                raise CoverageError(
                    f"{where} (an IterableDataset): {len(shared)} of {len(owners)} distinct samples were yielded more "
                    f"than once, e.g. by ranks {_fmt(pairs.most_common(1)[0][0])}. An IterableDataset must "
                    f"shard itself by rank (and by DataLoader worker, torch.utils.data.get_worker_info()).")
            report.passes.append((loader, epoch, {r: len(v[3]) for r, v in per.items()}, None))
            continue
        counts = Counter(i for v in per.values() for i in v[1])
        stopped = sorted(r for r, v in per.items() if not v[4])  # passes left before their end: no gaps checked
        parts = {None if v[6] is None else tuple(sorted(set(v[6]))) for v in per.values()}
        universe = set(range(size)) if None in parts else set().union(*parts)
        missing = [] if stopped else sorted(universe - set(counts))
        twice = sorted(i for i, c in counts.items() if c > 1)
        readers = {}
        for rank, v in per.items():
            for i in set(v[1]):
                readers.setdefault(i, []).append(rank)
        lines, explained = _explain([v[0] for v in per.values()], size, world_size, missing, twice)
        if len(parts) > 1:
            lines.insert(0, "The ranks read different Subsets of the dataset (random_split with a per-rank seed?): "
                            "split with the same seed on every rank, then shard with a DistributedSampler.")
            explained = False
        restarted = sorted(r for r, v in per.items() if v[5])
        if restarted:
            lines.insert(0, f"Rank(s) {_fmt(restarted)} stopped this pass and began it again with the same sampler "
                            f"epoch: a resume mid-epoch restarts the epoch. Skip the batches already trained on "
                            f"(save the step within the epoch) or resume at an epoch boundary.")
            explained = False
        if stopped:
            lines.append(f"Rank(s) {_fmt(stopped)} left the pass before its end: items never read are not checked.")
        read = {r: len(v[1]) for r, v in sorted(per.items())}
        if (missing or twice) and (strict or not explained):
            shared = Counter(tuple(sorted(readers[i]))[:2] for i in twice if len(readers[i]) > 1)
            msg = [f"{where}: {sum(read.values())} reads of {size} items at {world_size} ranks; each item must be "
                   f"read once per pass."]
            if missing:
                msg.append(f"Never read: {len(missing)} item(s): {_fmt(missing)}.")
            if twice:
                msg.append(f"Read more than once: {len(twice)} item(s): "
                           + _fmt(f"{i} ({counts[i]}x)" for i in twice) + ".")
            if shared:
                msg.append("Ranks reading the same items: " + _fmt(f"ranks {a} and {b} ({n} items)"
                                                                    for (a, b), n in shared.most_common()) + ".")
            raise CoverageError("\n".join(msg + lines + ([] if lines else [
                "Usual causes: a sampler without DistributedSampler or with the wrong rank/num_replicas, "
                "sharding decided before the process group exists, a resume that restarts the epoch."])))
        report.notes += [f"{where}: {line}" for line in lines]
        report.passes.append((loader, epoch, read, size))
    return report
