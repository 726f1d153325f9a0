"""Every claim a notebook states is checked by the code right after it (issue "truth in teaching").

Convention: a markdown cell that states a fact about torch's behaviour or about a value the
notebook computes marks it with a bold label starting with ``Claim`` (one or more per cell):
``**Claim:**``, ``**Claims:**``, ``**Claim (CPU only):**``, ``**Claim (padding):**``, ``**Claim**``...
The cells that follow it, up to the next markdown cell, must contain at least one code cell
that asserts: ``assert ...``, ``assert_close(...)``, ``torch.equal`` inside an assert, or a
``check_*`` call of ``helpers.notebook`` with ``strict=True``. Statements that cannot be asserted here are worded
as explanation with their source (doc page, paper, torch file), not as a **Claim:**.

Nothing is executed here; tests/course/test_notebooks.py runs the notebooks, so the assertions found
here really execute (a notebook that fails an assertion fails that test).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
#: every bold label that starts with the word Claim or Claims, with or without a parenthesis and colon
CLAIM = re.compile(r"\*\*Claims?\b[^*\n]*\*\*:?")
ASSERTING_CALLS = {"assert_close", "assert_equal", "check_answer"}


def asserts(source: str) -> bool:
    """True when the code (IPython magics stripped) holds an ``assert`` statement or a call of an
    asserting function (``assert_close``, ``torch.testing.assert_close``, ``check_answer(..., strict=True)``)."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("assert_close", "assert_equal"):
                return True
            if name == "check_answer" and any(k.arg == "strict" for k in node.keywords):
                return True
    return False


def unchecked_claims(nb) -> list[tuple[int, str]]:
    """``[(cell index, first claim text)]`` of markdown cells whose claims no following code cell asserts."""
    bad = []
    cells = nb.cells
    for i, c in enumerate(cells):
        if c.cell_type != "markdown" or not CLAIM.search(c.source):
            continue
        checked = False
        for nxt in cells[i + 1:]:
            if nxt.cell_type == "markdown":
                break
            if nxt.cell_type == "code" and asserts(nxt.source):
                checked = True
                break
        if not checked:
            text = c.source[CLAIM.search(c.source).end():].strip().splitlines()[0][:100]
            bad.append((i, text))
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_claim_is_asserted_by_the_code_after_it(path):
    nb = nbformat.read(str(path), as_version=4)
    claims = sum(len(CLAIM.findall(c.source)) for c in nb.cells if c.cell_type == "markdown")
    assert claims > 0, f"{path.name}: states no **Claim:**; mark the facts its code proves"
    bad = unchecked_claims(nb)
    assert not bad, (f"{path.name}: claims with no asserting code cell before the next markdown cell "
                     f"(cell, claim): {bad}. Assert them in the next code cell or reword them as "
                     "explanation with a source.")


def test_the_check_can_fail():
    """The checker itself: an unasserted claim is found, an asserted one is not."""
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    nb = new_notebook(cells=[
        new_markdown_cell("**Claim:** 1 + 1 is 2."), new_code_cell("x = 1 + 1\nprint(x)"),
        new_markdown_cell("**Claim:** 2 + 2 is 4."), new_code_cell("%%time\nassert 2 + 2 == 4"),
        new_markdown_cell("**Claim:** close."), new_code_cell("torch.testing.assert_close(a, b)"),
        new_markdown_cell("**Claim:** a solution."), new_code_cell('check_answer("ex1", 1, 1)'),
    ])
    assert [i for i, _ in unchecked_claims(nb)] == [0, 6]


@pytest.mark.parametrize("label", ["**Claim:**", "**Claims:**", "**Claim (CPU only):**", "**Claim (with GPUs):**",
                                   "**Claim (`drop_last=True`):**", "**Claim**:", "**Claims** (two of them):"])
def test_every_bold_claim_form_is_checked(label):
    """Each form a notebook writes its claims in is found: unasserted it fails, asserted it passes."""
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    nb = new_notebook(cells=[new_markdown_cell(f"Some text. {label} 1 + 1 is 2."), new_code_cell("x = 1 + 1"),
                             new_markdown_cell(f"{label} 2 + 2 is 4."), new_code_cell("assert 2 + 2 == 4")])
    assert [i for i, _ in unchecked_claims(nb)] == [0]
    assert not CLAIM.search("**Claimed** and **Disclaimer:** are not claims")
