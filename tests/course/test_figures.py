"""The mechanical part of the figure rule (issue 13), checked statically on every notebook's code.

The rule: every figure has a title and axis labels; no bars on a log axis or on a truncated
axis (use points, or bars from zero on a linear axis); no legend left where matplotlib's
``loc="best"`` happens to put it; no figure that may clip its text (``layout="constrained"``
or ``tight_layout``). What a static check cannot see (a legend in a named corner that still
covers data, a label that fits but is cut by a neighbour, units written in a label) is left to
reading the executed full-profile figures.

The check reads each code cell with ``ast``: a cell is split into figures at each
``plt.subplots`` / ``plt.figure`` / ``plt.subplot_mosaic`` call, and calls are tied to the axes
they are made on by their receiver's text (``ax_b.bar`` and ``ax_b.set_yscale``), a loop
variable standing for every axes its loop iterates over. The negative examples at the bottom
prove that it fails on each kind of violation, the positive ones that it does not raise a
false alarm on the patterns the notebooks use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import lessons as manifest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
TWINS = [NOTEBOOKS_DIR / f"{stem}.py" for stem in manifest.stems(None)]  # every notebook of the manifest

FIGURE_MAKERS = {"subplots", "figure", "subplot_mosaic"}
LOG_SCALES = {"log", "symlog", "logit"}
# helpers that label the axes they draw on (tests below check that they do)
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
        if not isinstance(node, (ast.For, ast.comprehension)):
            continue
        names = [n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)]
        it = node.iter
        if isinstance(node.target, ast.Name) and isinstance(it, (ast.Tuple, ast.List)):
            members = {ast.unparse(e) for e in it.elts}
        else:
            members = {ANY}
        for n in names:
            out.setdefault(n, set()).update(members)
    return out


def _same_axes(a: str | None, b: str | None, loops: dict[str, set[str]]) -> bool:
    if a is None or b is None:
        return False
    ea, eb = loops.get(a, {a}), loops.get(b, {b})
    return ANY in ea or ANY in eb or bool(ea & eb)


def _lower_bound(call: ast.Call) -> ast.expr | None:
    """The lower limit passed to ``set_ylim``/``set_xlim``, None if only the upper one is set."""
    kw = _kw(call, "bottom", "ymin", "left", "xmin")
    if kw is not None:
        return kw
    if call.args:
        first = call.args[0]
        return first.elts[0] if isinstance(first, (ast.Tuple, ast.List)) and first.elts else first
    return None


def _starts_at_zero(node: ast.expr) -> bool:
    """Literal 0, or ``min(0, ...)`` (zero is inside the axis: bars of either sign start there)."""
    if isinstance(node, ast.Constant) and node.value == 0:
        return True
    return (isinstance(node, ast.Call) and _name(node) == "min"
            and any(isinstance(a, ast.Constant) and a.value == 0 for a in node.args))


def _set_kw(call: ast.Call, key: str) -> ast.expr | None:
    """``ax.set(title=..., ylim=...)``: the value of one keyword."""
    return _kw(call, key) if _name(call) == "set" else None


def figure_problems(source: str) -> list[str]:
    """The figure-rule violations in one code cell's source, as readable strings ([] if none)."""
    lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()]
    tree = ast.parse("\n".join(lines))
    loops = _loop_targets(tree)
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda c: (c.lineno, c.col_offset))
    figures: list[list[ast.Call]] = [[]]
    for c in calls:
        if _name(c) in FIGURE_MAKERS and _receiver(c) == "plt":
            figures.append([c])
        else:
            figures[-1].append(c)
    problems = []
    for fig in figures:
        made_here = bool(fig) and _name(fig[0]) in FIGURE_MAKERS and _receiver(fig[0]) == "plt"
        where = f"figure made on line {fig[0].lineno}" if made_here else "calls before any figure"
        names = [_name(c) for c in fig]
        bars = [c for c in fig if _name(c) in ("bar", "barh")]
        if made_here:
            maker = fig[0]
            layout = _const(_kw(maker, "layout"))
            if not (layout in ("constrained", "tight") or _const(_kw(maker, "constrained_layout")) is True
                    or "tight_layout" in names):
                problems.append(f"{where}: no layout=\"constrained\" or fig.tight_layout(): text may be clipped")
            helper = any(n in LABELLING_HELPERS for n in names)
            titled = any(n in ("set_title", "suptitle", "title") for n in names) or any(
                _set_kw(c, "title") is not None or (_name(c) in LABELLING_HELPERS and _kw(c, "title") is not None)
                for c in fig)
            if not titled:
                problems.append(f"{where}: no title (ax.set_title / fig.suptitle)")
            for axis in "xy":
                labelled = helper or any(
                    n in (f"set_{axis}label", f"{axis}label", f"sup{axis}label") for n in names) or any(
                    _set_kw(c, f"{axis}label") is not None for c in fig)
                if not labelled:
                    problems.append(f"{where}: no {axis} axis label (ax.set_{axis}label, with units)")
        for bar in bars:
            r, value_axis = _receiver(bar), "y" if _name(bar) == "bar" else "x"
            if _const(_kw(bar, "log")) is True:
                problems.append(f"line {bar.lineno}: {ast.unparse(bar.func)}(..., log=True): bars on a log axis")
            for c in fig:
                n = _name(c)
                scale = (_const(c.args[0]) if n in ("set_yscale", "set_xscale") and c.args else
                         _const(_set_kw(c, "yscale")) or _const(_set_kw(c, "xscale")))
                log_axis = scale in LOG_SCALES or n in ("loglog", "semilogy", "semilogx")
                if log_axis and _same_axes(_receiver(c), r, loops):
                    problems.append(f"line {c.lineno}: {ast.unparse(c)} on the axes of the bars on line {bar.lineno}: "
                                    "bars on a log axis (use points, or a linear axis from 0)")
                low = None
                if n == f"set_{value_axis}lim":
                    low = _lower_bound(c)
                elif _set_kw(c, f"{value_axis}lim") is not None:
                    lim = _set_kw(c, f"{value_axis}lim")
                    low = lim.elts[0] if isinstance(lim, (ast.Tuple, ast.List)) and lim.elts else lim
                if low is not None and _same_axes(_receiver(c), r, loops) and not _starts_at_zero(low):
                    problems.append(f"line {c.lineno}: {ast.unparse(c)}: the value axis of the bars on line "
                                    f"{bar.lineno} does not start at 0 (a truncated bar misleads; use points)")
        for c in fig:
            if _name(c) == "legend" and _receiver(c) is not None:
                loc = _kw(c, "loc")
                if (loc is None or _const(loc) == "best") and _kw(c, "bbox_to_anchor") is None:
                    problems.append(f"line {c.lineno}: {ast.unparse(c.func)}() without loc: matplotlib's 'best' may "
                                    "put it over data; place it outside the axes or in a named free corner")
    return problems


def code_cells(twin: Path) -> list[tuple[int, str]]:
    import jupytext

    nb = jupytext.read(str(twin))
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


@pytest.mark.parametrize("twin", TWINS, ids=[p.stem for p in TWINS])
def test_figures_follow_the_rule(twin):
    found = [f"cell {i}: {p}" for i, src in code_cells(twin) if "plt." in src or ".bar" in src
             for p in figure_problems(src)]
    assert not found, f"{twin.name}: figures break the rule (issue 13):\n" + "\n".join(found)


def test_there_are_figures_to_check():
    """The check must see the notebooks' figures at all (a parser that skipped every cell would pass)."""
    made = sum(src.count("plt.subplots(") + src.count("plt.subplot_mosaic(")
               for twin in TWINS for _, src in code_cells(twin))
    # 26 when every lesson was first checked (ci.site's check counts the same figures on the site)
    assert made >= 26, f"only {made} figures found in {len(TWINS)} notebooks"


GOOD = "fig, ax = plt.subplots(layout='constrained')\n"
LABELS = "ax.set_title('t')\nax.set_xlabel('x (s)')\nax.set_ylabel('y (ms)')\n"
VIOLATIONS = {
    "bars on log y": (GOOD + "ax.bar([0, 1], [1, 2])\nax.set_yscale('log')\n" + LABELS, "log axis"),
    "bars on symlog via set()": (GOOD + "ax.bar([0, 1], [1, 2])\nax.set(yscale='symlog')\n" + LABELS, "log axis"),
    "barh with log=True": (GOOD + "ax.barh([0, 1], [1, 2], log=True)\n" + LABELS, "log axis"),
    "log set in a loop over the bar axes": (
        "fig, (ax_a, ax_b) = plt.subplots(1, 2, layout='constrained')\nax_a.bar([0], [1])\n"
        "for ax in (ax_a, ax_b):\n    ax.set_yscale('log')\n" + LABELS, "log axis"),
    "bars on a 0.90-1.00 axis": (GOOD + "ax.bar([0, 1], [0.95, 0.97])\nax.set_ylim(0.9, 1.0)\n" + LABELS,
                                 "does not start at 0"),
    "barh truncated by keyword": (GOOD + "ax.barh([0, 1], [2900, 3100])\nax.set_xlim(left=2800)\n" + LABELS,
                                  "does not start at 0"),
    "bars truncated by a computed bound": (
        GOOD + "ax.bar([0, 1], v)\nax.set_ylim(min(v) - 1, max(v))\n" + LABELS, "does not start at 0"),
    "no title": (GOOD + "ax.plot([1, 2])\nax.set_xlabel('x (s)')\nax.set_ylabel('y (ms)')\n", "no title"),
    "no y label": (GOOD + "ax.plot([1, 2])\nax.set_title('t')\nax.set_xlabel('x (s)')\n", "no y axis label"),
    "legend where 'best' puts it": (GOOD + "ax.plot([1, 2], label='a')\nax.legend()\n" + LABELS, "without loc"),
    "legend loc='best'": (GOOD + "ax.plot([1, 2], label='a')\nax.legend(loc='best')\n" + LABELS, "without loc"),
    "no layout engine": ("fig, ax = plt.subplots()\nax.plot([1, 2])\n" + LABELS, "clipped"),
}


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_the_check_fails_on_a_violation(name):
    source, expected = VIOLATIONS[name]
    problems = figure_problems(source)
    assert any(expected in p for p in problems), f"{name!r} not caught: {problems}"


ALLOWED = {
    "bars from 0 with a log axis on another axes of the same cell": (
        "fig, (ax_b, ax_gap) = plt.subplots(1, 2, layout='constrained')\n"
        "ax_b.bar([0, 1], [1, 2])\nax_b.set_ylim(0, 3)\nax_gap.plot([1, 2])\nax_gap.set_yscale('log')\n"
        "ax_b.set_title('t')\nax_b.set_xlabel('x')\nax_b.set_ylabel('bytes')\n"),
    "two figures in one cell, the second on a log axis": (
        GOOD + "ax.bar([0, 1], [1, 2])\n" + LABELS + GOOD + "ax.plot([1, 2])\nax.set_yscale('log')\n" + LABELS),
    "points on a truncated axis": (GOOD + "ax.plot([0, 1], [0.95, 0.97], 'o')\nax.set_ylim(0.9, 1.0)\n" + LABELS),
    "bars of either sign from min(0, ...)": (GOOD + "ax.bar([0, 1], v)\nax.set_ylim(min(0, min(v)), 5)\n" + LABELS),
    "legend outside, labels through set() and tight_layout": (
        "fig, ax = plt.subplots()\nax.plot([1], label='a')\nax.set(title='t', xlabel='x (s)', ylabel='y (ms)')\n"
        "ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1))\nfig.tight_layout()\n"),
}


@pytest.mark.parametrize("name", list(ALLOWED))
def test_the_check_allows_a_good_figure(name):
    assert figure_problems(ALLOWED[name]) == []


def test_labelling_helpers_do_label():
    """The helpers trusted to label their axes really set both labels (and the title when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers.sampler import plot_assignment, sampler_assignment

    fig, ax = plt.subplots()
    try:
        plot_assignment(sampler_assignment(5, 2), 5, ax=ax, title="t")
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title() == "t"
    finally:
        plt.close(fig)
