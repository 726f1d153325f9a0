"""The figure rule's mechanical part (issue 13), read from a code cell with ``ast``: a title, both
axis labels, a layout engine; no bars on a log or truncated axis; no legend left to "best".

A cell is split into figures at each ``plt.subplots`` / ``plt.figure`` / ``plt.subplot_mosaic``
call; calls are tied to their axes by the receiver's text (``ax_b.bar`` and ``ax_b.set_yscale``), a
loop variable standing for every axes its loop iterates over. What this cannot see (a legend in a
named corner over data, units in a label) is left to reading the executed figures. Used by the
``figures`` rule of ``ci/lessons.py``; tests/course/test_figures.py shows it fails on each one.
"""

from __future__ import annotations

import ast

FIGURE_MAKERS = {"subplots", "figure", "subplot_mosaic"}
LOG_SCALES = {"log", "symlog", "logit"}
# helpers that label the axes they draw on (tests/course/test_figures.py checks that they do)
LABELLING_HELPERS = {"plot_assignment"}
ANY = "*"  # a loop variable over something we cannot enumerate: stands for every axes


def _receiver(call: ast.Call) -> str | None:
    return ast.unparse(call.func.value) if isinstance(call.func, ast.Attribute) else None


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _kw(call: ast.Call, *names: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg in names), None)


def _const(node: ast.expr | None):
    return node.value if isinstance(node, ast.Constant) else None


def _loop_targets(tree: ast.AST) -> dict[str, set[str]]:
    """Loop variable -> the receivers it stands for (``for ax in (ax_a, ax_b)``), or {ANY}."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)):
            listed = isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List))
            members = {ast.unparse(e) for e in node.iter.elts} if listed else {ANY}
            for n in ast.walk(node.target):
                if isinstance(n, ast.Name):
                    out.setdefault(n.id, set()).update(members)
    return out


def _same_axes(a: str | None, b: str | None, loops: dict[str, set[str]]) -> bool:
    ea, eb = loops.get(a, {a}), loops.get(b, {b})
    return a is not None and b is not None and (ANY in ea or ANY in eb or bool(ea & eb))


def _low(node: ast.expr | None) -> ast.expr | None:
    """The first of a ``(low, high)`` pair, else the node itself."""
    return node.elts[0] if isinstance(node, (ast.Tuple, ast.List)) and node.elts else node


def _lower_bound(call: ast.Call) -> ast.expr | None:
    """The lower limit passed to ``set_ylim``/``set_xlim``, None if only the upper one is set."""
    kw = _kw(call, "bottom", "ymin", "left", "xmin")
    return kw if kw is not None or not call.args else _low(call.args[0])


def _starts_at_zero(node: ast.expr) -> bool:
    """Literal 0, or ``min(0, ...)`` (zero is inside the axis: bars of either sign start there)."""
    return _const(node) == 0 or isinstance(node, ast.Call) and _name(node) == "min" and any(
        _const(a) == 0 for a in node.args)


def _set_kw(call: ast.Call, key: str) -> ast.expr | None:
    """``ax.set(title=..., ylim=...)``: the value of one keyword."""
    return _kw(call, key) if _name(call) == "set" else None


def _is_maker(call: ast.Call) -> bool:
    return _name(call) in FIGURE_MAKERS and _receiver(call) == "plt"


def _unlabelled(fig: list[ast.Call]) -> list[str]:
    """What a figure made by ``fig[0]`` lacks: a layout engine, a title, axis labels."""
    names = {_name(c) for c in fig}
    keys = {k.arg for c in fig if _name(c) == "set" or _name(c) in LABELLING_HELPERS
            for k in c.keywords}  # ax.set(title=...) and the helpers' title=
    engine = _const(_kw(fig[0], "layout")) in ("constrained", "tight") or "tight_layout" in names
    engine |= _const(_kw(fig[0], "constrained_layout")) is True
    out = [] if engine else ["no layout=\"constrained\" or fig.tight_layout(): text may be clipped"]
    if not names & {"set_title", "suptitle", "title"} and "title" not in keys:
        out.append("no title (ax.set_title / fig.suptitle)")
    return out + [f"no {a} axis label (ax.set_{a}label, with units)" for a in "xy"
                  if not (names & {f"set_{a}label", f"{a}label", f"sup{a}label", *LABELLING_HELPERS}
                          or f"{a}label" in keys)]


def figure_problems(source: str) -> list[str]:
    """The figure-rule violations in one code cell's source, as readable strings ([] if none)."""
    lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()]
    tree = ast.parse("\n".join(lines))
    loops = _loop_targets(tree)
    figures: list[list[ast.Call]] = [[]]
    for c in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)),
                    key=lambda c: (c.lineno, c.col_offset)):
        figures.append([c]) if _is_maker(c) else figures[-1].append(c)
    problems = []
    for fig in figures:
        if fig and _is_maker(fig[0]):
            problems += [f"figure made on line {fig[0].lineno}: {p}" for p in _unlabelled(fig)]
        for bar in (c for c in fig if _name(c) in ("bar", "barh")):
            r, value_axis = _receiver(bar), "y" if _name(bar) == "bar" else "x"
            if _const(_kw(bar, "log")) is True:
                problems.append(f"line {bar.lineno}: {ast.unparse(bar.func)}(..., log=True): "
                                "bars on a log axis")
            for c in (c for c in fig if _same_axes(_receiver(c), r, loops)):
                n = _name(c)
                scale = (_const(c.args[0]) if n in ("set_yscale", "set_xscale") and c.args else
                         _const(_set_kw(c, "yscale")) or _const(_set_kw(c, "xscale")))
                if scale in LOG_SCALES or n in ("loglog", "semilogy", "semilogx"):
                    problems.append(f"line {c.lineno}: {ast.unparse(c)} on the axes of the bars on "
                                    f"line {bar.lineno}: bars on a log axis (use points, or a "
                                    "linear axis from 0)")
                low = (_lower_bound(c) if n == f"set_{value_axis}lim"
                       else _low(_set_kw(c, f"{value_axis}lim")))
                if low is not None and not _starts_at_zero(low):
                    problems.append(f"line {c.lineno}: {ast.unparse(c)}: the value axis of the "
                                    f"bars on line {bar.lineno} does not start at 0 (a truncated "
                                    "bar misleads; use points)")
        problems += [f"line {c.lineno}: {ast.unparse(c.func)}() without loc: matplotlib's 'best' "
                     "may put it over data; place it outside the axes or in a named free corner"
                     for c in fig if _name(c) == "legend" and _receiver(c) is not None
                     and _kw(c, "bbox_to_anchor") is None
                     and (_kw(c, "loc") is None or _const(_kw(c, "loc")) == "best")]
    return problems
