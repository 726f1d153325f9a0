"""What :func:`helpers.replicas.assert_in_sync` says when the replicas differ: its message, built from
what every rank sent. Rank 0 is the reference; ranks are group ranks."""

from __future__ import annotations

import torch

SHOWN = 3  # diverging tensors named in a message, then "and N more"

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
MOVED = " (the same sum and sum of squares: values moved within the tensor, or changed below their rounding)"
UNNAMED = ("Replicas differ: the ranks' digests of the model differ, but the full comparison names nothing "
           "(names, dtypes, shapes, values, modes, module classes and plain attributes agree). Compare the "
           "ranks' models by hand, e.g. print(model) and vars(module) on each rank.")
_DIFFERS = (" differs", " differ")


def ranks(rs, verbs: tuple[str, str] = ("", "")) -> str:
    """'rank 1 differs', 'ranks 1, 2 differ', 'ranks 1-63 differ' for ``verbs=(' differs', ' differ')``;
    past 8 spans, '... (32 ranks)'."""
    rs, spans, i = sorted(rs), [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        spans.append(f"{rs[i]}-{rs[j]}" if j - i >= 2 else ", ".join(map(str, rs[i:j + 1])))
        i = j + 1
    one, spans = len(rs) == 1, spans if len(spans) <= 8 else [*spans[:8], f"... ({len(rs)} ranks)"]
    return ("rank " if one else "ranks ") + ", ".join(spans) + verbs[0 if one else 1]


def first(lines: list[str]) -> str:
    """The first :data:`SHOWN` lines, then "... and N more"."""
    more = [f"  ... and {len(lines) - SHOWN} more"] if len(lines) > SHOWN else []
    return "\n".join(lines[:SHOWN] + more)


def describe(kind: str, row: torch.Tensor, shape: tuple, detail: int) -> str:
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


def owner(module, name: str) -> str:
    """"in BatchNorm1d '1'" for buffer '1.running_mean'; "in Net (the model)" for a root buffer."""
    path = name.rpartition(".")[0]
    try:
        found = module.get_submodule(path)
    except AttributeError:
        return ""
    return f" in {type(found).__name__} " + (f"'{path}'" if path else "(the model)")


def tensor_lines(inner, entries: list, tables: torch.Tensor, same: torch.Tensor) -> tuple[list, set]:
    """``(kind, tensor, line)`` for each tensor that differs on some rank, and the ranks that differ.
    ``tables``: (world, tensors, 5) float64, each rank's :func:`helpers.replicas.fingerprint` and digest
    of each tensor; ``same``: (world, tensors, 5) bool, where they match rank 0's."""
    bad = ~same.all(dim=2)
    problems, world = [], tables.shape[0]
    for i in bad.any(dim=0).nonzero().flatten().tolist():
        kind, name, t, _, shape = entries[i]
        rs = [r for r in range(1, world) if bad[r, i]]
        shown = [0] + rs[:SHOWN]
        texts = [[describe(kind, tables[r, i], shape, d) for r in shown] for d in (0, 1, 2)]
        near = any(bool(same[r, i, 0]) and torch.isclose(tables[r, i, 1:3], tables[0, i, 1:3], rtol=1e-12,
                                                         atol=0).all() for r in rs)
        detail = 2 if near else next((d for d in (0, 1) if all(x != texts[d][0] for x in texts[d][1:])), 2)
        values = "; ".join(f"rank {r} {x}" for r, x in zip(shown, texts[detail]))
        where = owner(inner, name) if kind == "buffer" else ""
        problems.append((kind, t, f"  {kind} '{name}' {shape}{where}: {values}{MOVED if near else ''}"))
    return problems, {r for r in range(1, world) if bool(bad[r].any())}


def _attribute(attributes: dict, k: str) -> str:
    """``k=value`` (a repr, cut at 60 characters), or that ``k`` is not a plain attribute there."""
    v = attributes.get(k)
    return (f"{k} unset (or not a plain value)" if v is None else f"{k}={v}" if len(v) <= 60 else
            f"{k}={v[:50]}... ({len(v)} characters)")


def config_lines(all_modes: list) -> tuple[list[str], list[int]]:
    """Modules only some ranks hold, or of another class, or whose plain attributes or extra_repr()
    (:func:`helpers.replicas._config`) differ from rank 0's; the ranks that differ."""
    ref = {n: (c, dict(cfg)) for n, c, _, cfg in all_modes[0]}
    lines, differ = [], []
    for r, modes in enumerate(all_modes[1:], start=1):
        mine = {n: (c, dict(cfg)) for n, c, _, cfg in modes}
        found = [f"module '{n}' ({c}) only on rank {r}" for n, (c, _) in mine.items() if n not in ref]
        found += [f"module '{n}' ({c}) only on rank 0, not on rank {r}" for n, (c, _) in ref.items() if n not in mine]
        for n in [n for n in mine if n in ref]:
            (c0, a), (c, b) = ref[n], mine[n]
            what = f"module '{n}'" if n else "the model"
            if c0 != c:
                found.append(f"{what}: {c0} on rank 0, {c} on rank {r}")
                continue
            keys = sorted((a.keys() | b.keys()) - {"extra_repr()"})
            pairs = [(_attribute(a, k), _attribute(b, k)) for k in keys if a.get(k) != b.get(k)]
            x, y = str(a.get("extra_repr()", "")), str(b.get("extra_repr()", ""))
            if not pairs and x != y:  # the parts of extra_repr() that differ
                xs, ys = x.split(", "), y.split(", ")
                pairs = [(p, q) for p, q in zip(xs, ys) if p != q] if len(xs) == len(ys) else [(repr(x), repr(y))]
            if pairs:
                found.append(f"{what} ({c}): " + ", ".join(f"{p} on rank 0, {q} on rank {r}" for p, q in pairs))
        lines += [f"  {line}" for line in found]
        differ += [r] if found else []
    return lines, differ


def modes_lines(all_modes: list) -> tuple[list[str], list[int]]:
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


def structure_message(infos: list) -> str:
    """Which ranks called with other options than rank 0, or hold a different model (names, shapes,
    dtypes); ``infos``: each rank's (options, [(kind, name, shape, dtype)])."""
    ref_opts, ref = infos[0]
    ref_map = {(k, n): (s, d) for k, n, s, d in ref}
    options = [r for r, (opts, _) in enumerate(infos) if opts != ref_opts]
    if options:
        return (f"Replicas not compared: {ranks(options, (' calls', ' call'))} assert_in_sync({infos[options[0]][0]}), "
                f"rank 0 ({ref_opts}). Call it with the same options on every rank.")
    lines, differ = [], []
    for r, (_, struct) in enumerate(infos[1:], start=1):
        mine = {(k, n): (s, d) for k, n, s, d in struct}
        if mine == ref_map and list(mine) == list(ref_map):
            continue
        diffs = []
        for (k, n), (s, d) in mine.items():
            s0, d0 = ref_map.get((k, n), (s, d))
            diffs += ([f"'{n}' shape {s0} on rank 0, {s} on rank {r}"] if s != s0 else
                      [f"'{n}' dtype {d0} on rank 0, {d} on rank {r}"] if d != d0 else [])
        diffs += [f"'{n}' only on rank {r}" for (k, n) in mine if (k, n) not in ref_map]
        diffs += [f"'{n}' only on rank 0" for (k, n) in ref_map if (k, n) not in mine]
        diffs = diffs or ["the same names in another order"]
        more = f" and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else ""
        lines.append(f"  rank {r}: {'; '.join(diffs[:SHOWN])}{more}")
        differ.append(r)
    return (f"Replicas differ: {ranks(differ, (' holds', ' hold'))} a different model than rank 0 "
            f"({len(ref)} tensors on rank 0):\n{first(lines)}\n"
            "Build the same model on every rank (same code, same arguments) before checking it.")


def message(world: int, n_tensors: int, config: tuple, modes: tuple, tensors: tuple, ddp_lines: list) -> str:
    """The whole message, or "" when nothing differs. ``config``, ``modes``: (lines, ranks) of
    :func:`config_lines` and :func:`modes_lines`; ``tensors``: (problems, ranks) of :func:`tensor_lines`."""
    (config, config_ranks), (modes, mode_ranks), (problems, tensor_ranks) = config, modes, tensors
    if not (problems or ddp_lines or modes or config):
        return ""
    text = []
    if config:
        text.append(f"Replicas differ: {ranks(config_ranks, _DIFFERS)} from rank 0 in module configuration "
                    f"(modules, classes, plain attributes):\n{first(config)}\nBuild the model with the same "
                    "arguments on every rank (a rank-dependent branch or config). An attribute that may differ "
                    "(a device, a rank, a statistic a forward stores) goes unchecked when its name starts with _.")
    if modes:
        text.append(f"Replicas differ: {ranks(mode_ranks, _DIFFERS)} from rank 0 in train()/eval() mode:\n"
                    + first(modes))
    if problems:
        text.append(f"Replicas differ: {ranks(tensor_ranks, _DIFFERS)} from rank 0 ({len(problems)} of "
                    f"{n_tensors} tensors):\n" + first([line for _, _, line in problems]))
    if ddp_lines:
        text.append("The DDP model changed after DistributedDataParallel(...) wrapped it (wrap it again "
                    "after the change):\n" + first(ddp_lines))
    floats = {t.is_floating_point() for k, t, _ in problems if k == "buffer"}  # buffers that differ
    for note, show in ((MODES_NOTE, modes), (BUFFERS_NOTE, True in floats), (COUNTERS_NOTE, False in floats),
                       (CAUSES, problems or ddp_lines)):
        text += [note] if show else []
    if world > 2 and set(config_ranks) | set(mode_ranks) | tensor_ranks == set(range(1, world)):
        text.append("Every other rank differs from rank 0: rank 0 may be the one that differs.")
    return "\n".join(text)
