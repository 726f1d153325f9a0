"""Two checks of the learner's own, unchanged worker ``fn(rank, world_size, *args)``:

- :func:`against_one_process`: do ``world_size`` ranks train what one process trains on the same
  global batch? (Invariant 1: a scaled loss, per-rank statistics or init, a loss mixing local and
  global terms each make the runs part.)
- :func:`data_coverage`: does each epoch read each item once, across all ranks? (Invariant 2: a
  sampler with the wrong rank or a per-rank seed, drop_last twice, a resume mid-epoch, sharding
  decided before the process group exists.)

Both run ``fn`` on simulated ranks (:func:`helpers.engine.simulate`, the default) or real gloo
processes (``simulated=False``) and record inside each rank with torch's global hooks
(:mod:`helpers.recorder`). The third invariant, one model on every rank, is
:func:`helpers.replicas.assert_in_sync`.
"""

from __future__ import annotations

import inspect
import os
import types
from collections import Counter
from dataclasses import dataclass, field

import torch

from helpers.recorder import run_recorded as _run

__all__ = ["against_one_process", "data_coverage", "verdict", "DivergedFromOneProcess", "CoverageError",
           "RandomnessDiffers", "RTOL", "ATOL"]

#: Default tolerance of :func:`against_one_process`: ``|a - b| <= ATOL + RTOL * |b|`` elementwise
#: (the rule of ``torch.isclose``). How it was measured: :func:`against_one_process`.
RTOL = 1e-4
ATOL = 1e-6
CONVENTION = ("Convention: one global batch. Each of the N ranks trains on global batch / N items, "
              "the one-process run on the whole global batch, in the same order.")
_SHOWN = 8  # items, ranks, names listed in a message before "and N more"
_HELPERS = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Short:
    """Mixin: in IPython, the traceback without the frames of ``helpers/`` (IPython's
    ``_render_traceback_`` hook, as the engine's errors): the learner's cell, then the message."""

    def _render_traceback_(self) -> list[str]:
        try:
            from IPython import get_ipython

            tb, kept = self.__traceback__, []
            while tb is not None:
                if not tb.tb_frame.f_code.co_filename.startswith(_HELPERS):
                    kept.append(tb)
                tb = tb.tb_next
            for t in reversed(kept):
                tb = types.TracebackType(tb, t.tb_frame, t.tb_lasti, t.tb_lineno)
            shown = get_ipython().InteractiveTB  # IPython's formatter, its tb_offset skips run_code
            return shown.structured_traceback(type(self), self, tb, tb_offset=1)
        except Exception:  # noqa: BLE001 - IPython would print our failure instead of the error
            return [f"{type(self).__name__}: {self}"]


#: bad arguments (raised before any rank runs), a worker that took no step or read no pass: named in
#: IPython as the builtin errors they are (``__qualname__`` stays, for pickle)
_BadInput, _NothingToCheck = (type(base.__name__, (_Short, base), {"__qualname__": name})
                              for base, name in ((ValueError, "_BadInput"), (RuntimeError, "_NothingToCheck")))


class DivergedFromOneProcess(_Short, AssertionError):
    """The ``world_size``-rank run left the one-process run: names the first step, the parameter by
    module path, the ranks, both values and the tolerance."""


class RandomnessDiffers(_Short, AssertionError):
    """The one-process run does not repeat itself: a step draws from the default random generators
    (dropout, random augmentation, an unseeded init), so the two runs cannot be compared."""


class CoverageError(_Short, AssertionError):
    """A pass of the ranks' loaders did not read each item exactly once across the ranks."""


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
        return (f"<{self.world_size} ranks = one process: {_steps(self.steps)}, {self.parameters} parameters "
                f"compared, largest difference {self.largest:.3g} (tolerance rtol={self.rtol:g}, atol={self.atol:g})>")


def _steps(n: int) -> str:
    return f"{n} optimizer step{'s' * (n != 1)}"


def _called(check: str, fn, world_size: int, least: int, args, options) -> None:
    """Raise :class:`_BadInput` for a ``world_size`` under ``least``, or when ``fn(rank,
    world_size, *args, **options)`` cannot bind, naming a keyword the check took as its own."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < least:
        raise _BadInput(f"{check}: world_size must be an int >= {least}, got {world_size!r}.")
    try:
        inspect.signature(fn).bind(0, world_size, *args, **options)
    except ValueError:  # no signature to read (a builtin): let the ranks find out
        return
    except TypeError as e:
        own = [k for k, p in inspect.signature(globals()[check]).parameters.items()
               if p.kind == p.KEYWORD_ONLY and f"'{k}'" in str(e)]
        clash = f" {own[0]}= is {check}'s own keyword: pass fn's {own[0]} positionally." if own else ""
        raise _BadInput(f"{check} calls fn(rank, world_size, *args, **kwargs), which fn cannot "
                        f"take: {e}.{clash}") from None


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

    Tolerance (``|a - b| <= atol + rtol * |b|`` elementwise): the ranks sum gradients in another
    order than one process does (per-rank means, then the all-reduce), which moves float32 results by
    a few ulps per step. Measured (torch 2.14.1, CPU) on lesson 09's MLP,
    :func:`helpers.at_scale.global_batch_steps`, 10 SGD steps at lr 0.1, global batch 256: the largest
    difference over all weights and steps was 1.5e-8 at 8 simulated ranks, 2.2e-8 at 64 and 256, and
    1.5e-8 at 4 gloo ranks, on weights of about 0.03 (``python3 -m helpers.bench checks`` prints it
    beside the cost). The mistakes of ``tests/course/test_checks.py`` moved the largest difference
    to 1e-2 to 5e-2 after one step. ``rtol=1e-4, atol=1e-6`` (4e-6 at such a weight) sits 100x above
    the one and far below the other. Differences grow with steps: for a long run, compare the first
    ``steps`` or loosen ``rtol``.

    Args:
        fn: the worker, as for :func:`helpers.engine.launch` / :func:`helpers.engine.simulate`.
        world_size: ranks of the run compared with one process.
        *args, **options: passed to ``fn`` after ``rank, world_size``; the keywords below are the
            check's own: pass a worker argument of such a name positionally.
        simulated: ``True``: simulated ranks (threads); ``False``: real gloo processes.
        steps: compare only the first ``steps`` optimizer steps (``None``: all of them).
        rtol, atol: the tolerance above.
        timeout: seconds each run may take (``None``: no limit).

    Returns:
        OneProcessReport: steps compared, parameters, the largest difference.

    Raises:
        ValueError: bad arguments, or ``fn`` cannot take them; before anything runs.
        DivergedFromOneProcess: the first step where a parameter differs beyond the tolerance on
            some rank (or where the step counts or parameter names differ), with both values.
        RuntimeError: ``fn`` took no ``torch.optim`` optimizer step at one rank.
        RandomnessDiffers: the runs differ, and so do two one-process runs: a step draws random
            numbers (dropout, augmentation, an unseeded init) that cannot match across world sizes.
        WorkerError, LaunchTimeout, LaunchError: as :func:`helpers.engine.launch` / ``simulate``.
    """
    _called("against_one_process", fn, world_size, 2, args, options)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise _BadInput(f"steps must be None or an int >= 1, got {steps!r}.")
    if not (rtol >= 0 and atol >= 0):
        raise _BadInput(f"rtol and atol must be >= 0, got rtol={rtol!r}, atol={atol!r}.")
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
                                     + "\nThen a rank failed (the error above), where one process did not.") from e
    ref = _run(fn, 1, args, options, simulated, timeout)[0]["steps"]
    records = [r["steps"] for r in runs]
    k, name, bad, largest = _first_difference(records, ref, steps, rtol, atol)
    counts = sorted({len(r) - 1 for r in records})
    count_differs = steps is None and (counts != [len(ref) - 1]) or (
        steps is not None and min(len(ref) - 1, steps) > min(counts + [steps]))
    if not ref:
        raise _NothingToCheck("fn took no optimizer step at one rank: nothing to compare. The check sees the steps "
                              "of torch.optim optimizers, not an update written by hand (p -= lr * p.grad).")
    if k is None and not count_differs:
        n = len(ref) - 1 if steps is None else min(len(ref) - 1, steps)
        return OneProcessReport(world_size, n, len(ref[0]), largest, rtol, atol, [r["result"] for r in runs])
    again = _run(fn, 1, args, options, simulated, timeout, perturb=7919)[0]["steps"]
    k2, name2, _, _ = _first_difference([again], ref, steps, rtol, atol)
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
            f"{world_size} ranks took {_fmt(counts)} optimizer step{'s' * (counts != [1])}, "
            f"one process took {_steps(len(ref) - 1)}. "
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
    lines.append("The initial parameters differ: seed the init the same on every rank (torch.manual_seed before "
                 "building the model) or broadcast rank 0's (DDP does it when it wraps)." if k == 0 else
                 "Usual causes: a loss scaled by world_size or summed (reduction='sum'); statistics of each rank's "
                 "share (BatchNorm without SyncBatchNorm, a per-rank mean or norm); a loss mixing a rank's own terms "
                 "with all-reduced ones; gradients changed (clipped, scaled) before DDP averages them.")
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
        head = (f"<coverage at {self.world_size} ranks, {len(self.passes)} pass(es): each item read once per pass"
                + (", but for the notes below>" if self.notes else ">"))
        return "\n".join([head, *rows, *more, *self.notes])


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
            lines.append(f"Several ranks built DistributedSampler with the same rank ({_fmt(sorted(ranks))}): "
                         "pass rank=rank.")
        seeds = {g["seed"] for g in facts}
        if len(seeds) > 1:
            lines.append(f"DistributedSampler's seed differs by rank ({_fmt(sorted(seeds))}): each rank shuffles "
                         f"its own permutation; give every rank the same seed.")
        epochs = {g["epoch"] for g in facts}
        if len(epochs) > 1:
            lines.append(f"DistributedSampler's epoch differs by rank ({_fmt(sorted(epochs))}): "
                         "call set_epoch(epoch) on every rank.")
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
        fn, world_size, *args, **options: as for :func:`helpers.engine.simulate` / ``launch``; the
            keywords below are the check's own: pass a worker argument of such a name positionally.
        simulated: ``True``: simulated ranks; ``False``: real gloo processes.
        strict: also raise for what ``DistributedSampler``'s padding (items read twice) or its
            ``drop_last=True`` (fewer than ``world_size`` items left out) explains; by default those are
            notes in the report. Pass it for an evaluation loop: there the padding skews the metric.
        timeout: seconds the run may take.

    Returns:
        CoverageReport: items read per rank, per loader and pass.

    Raises:
        ValueError: bad arguments, or ``fn`` cannot take them; before anything runs.
        RuntimeError: no rank read a ``DataLoader`` pass.
        CoverageError: the first pass that reads an item never, or more than once, or ranks that read the
            same items; says what DistributedSampler's padding or drop_last explains.
    """
    _called("data_coverage", fn, world_size, 1, args, options)
    runs = _run(fn, world_size, args, options, simulated, timeout)
    if not any(run["passes"] for run in runs):
        raise _NothingToCheck("fn read no DataLoader pass at any rank: nothing to check. The check sees the passes "
                              "of torch.utils.data.DataLoader (each iter(loader)), not a dataset indexed by hand.")
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
                across = Counter(tuple(sorted(set(r)))[:2] for r in shared.values() if len(set(r)) > 1)
                within = sorted({r[0] for r in shared.values() if len(r) > len(set(r))})
                raise CoverageError("\n".join(
                    [f"{where} (an IterableDataset): {len(shared)} of {len(owners)} distinct samples were yielded "
                     f"more than once."]
                    + ([f"The same samples on several ranks, e.g. ranks {_fmt(across.most_common(1)[0][0])}: the "
                        f"dataset does not shard itself by rank (or decided its shard before the group existed)."]
                       if across else [])
                    + ([f"The same samples twice within rank(s) {_fmt(within)}: each DataLoader worker runs the whole "
                        f"__iter__; shard by worker too (torch.utils.data.get_worker_info())."] if within else [])))
            counts = sorted({len(v[3]) for v in per.values()})
            if len(counts) > 1:
                report.notes.append(f"{where}: the ranks yield different numbers of samples ({_fmt(counts)}): the rank "
                                    f"with fewer batches ends first and the others wait in an extra all-reduce.")
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
                msg.append("Ranks reading the same items: " + _fmt(f"ranks {a} and {b} ({n} item(s))"
                                                                    for (a, b), n in shared.most_common()) + ".")
            raise CoverageError("\n".join(msg + lines + ([] if lines else [
                "Usual causes: a sampler without DistributedSampler or with the wrong rank/num_replicas, "
                "sharding decided before the process group exists, a resume that restarts the epoch."])))
        report.notes += [f"{where}: {line}" for line in lines]
        report.passes.append((loader, epoch, read, size))
    return report


def verdict(check, *args, **kwargs) -> str:
    """``check(*args, **kwargs)`` as one line of a table of cases: ``"passes"``, or ``"Type: message"`` of the
    ``AssertionError`` it raised (:class:`DivergedFromOneProcess`, :class:`CoverageError`, ``assert_in_sync``'s)."""
    try:
        check(*args, **kwargs)
    except AssertionError as e:
        return f"{type(e).__name__}: {e}"
    return "passes"
