"""The figure rule's check (``ci/figures.py``, the ``figures`` rule of ``ci/lessons.py``): it fails on
each kind of violation and raises no false alarm on the patterns the notebooks use; it sees the
lessons' figures at all; the helpers it trusts to label their axes do."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from ci.figures import figure_problems
from helpers import lessons as manifest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"


def test_there_are_figures_to_check():
    """The check must see the notebooks' figures at all (a parser that skipped every cell would pass)."""
    made = sum(c.source.count("plt.subplots(") + c.source.count("plt.subplot_mosaic(")
               for stem in manifest.stems(None)
               for c in nbformat.read(NOTEBOOKS_DIR / f"{stem}.ipynb", as_version=4).cells
               if c.cell_type == "code")
    # 26 when every lesson was first checked (ci.site's check counts the same figures on the site)
    assert made >= 26, f"only {made} figures found"


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


@pytest.mark.parametrize("name", [*VIOLATIONS, *ALLOWED])
def test_the_check_fails_on_a_violation_and_allows_a_good_figure(name):
    source, expected = VIOLATIONS.get(name) or (ALLOWED[name], None)
    problems = figure_problems(source)
    assert any(expected in p for p in problems) if expected else problems == [], (name, problems)


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
