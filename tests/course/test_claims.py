"""Every claim a notebook states is checked by the code right after it (issue "truth in teaching").

Convention: a markdown cell that states a fact about torch's behaviour or about a value the
notebook computes marks it with a bold label starting with ``Claim`` (one or more per cell):
``**Claim:**``, ``**Claims:**``, ``**Claim (CPU only):**``, ``**Claim (padding):**``, ``**Claim**``...
The cells that follow it, up to the next markdown cell, must contain at least one code cell
that asserts: ``assert ...``, ``assert_close(...)``, ``torch.equal`` inside an assert, or a
``check_*`` call of ``helpers.notebook`` with ``strict=True``. Statements that cannot be asserted here are worded
as explanation with their source (doc page, paper, torch file), not as a **Claim:**.

A claim only a GPU can prove is marked ``**Claim (GPU):**``, one true only without GPUs
``**Claim (CPU):**`` (no other form); their check cells run the asserts under
``if gpu_claim(...):`` / ``if cpu_claim(...):`` (helpers/notebook.py), which print
``not proven here: ...`` elsewhere; no other claim's check branches on the machine's devices
(ci/gpu_claims.py parses them, ci/gpu_check.py lists the GPU ones it proves).

Nothing is executed here; tests/course/test_notebooks.py runs the notebooks, so the assertions found
here really execute (a notebook that fails an assertion fails that test).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from ci.gpu_claims import HELPER, MARKED, calls, check_cells, code_tree, device_branches
from helpers import lessons as manifest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = [NOTEBOOKS_DIR / f"{stem}.ipynb" for stem in manifest.stems(None)]
#: every bold label that starts with the word Claim or Claims, with or without a parenthesis and colon
CLAIM = re.compile(r"\*\*Claims?\b[^*\n]*\*\*:?")
ASSERTING_CALLS = {"assert_close", "assert_equal", "check_answer"}


def asserts(source: str) -> bool:
    """True when the code (IPython magics stripped) holds an ``assert`` statement or a call of an
    asserting function (``assert_close``, ``torch.testing.assert_close``, ``check_answer(..., strict=True)``)."""
    tree = code_tree(source)
    for node in ast.walk(tree) if tree is not None else ():
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
        if not any(asserts(nxt.source) for nxt in check_cells(cells, i)):
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


DEVICE_WORD = re.compile(r"\b(?:[CG]PUs?|CUDA)\b")


def loose_device_marks(source: str) -> list[str]:
    """Claim labels that name a device in another form than the fixed one:
    ``**Claim (CPU only):**``, ``**Claim (with GPUs):**``, ``**Claim:** (CPU only) ...``."""
    out = []
    for m in CLAIM.finditer(source):
        after = re.match(r"\s*\([^)\n]*\)", source[m.end():])
        if MARKED.fullmatch(m.group(0)):
            continue
        if DEVICE_WORD.search(m.group(0)) or (after and DEVICE_WORD.search(after.group(0))):
            out.append(m.group(0) + (after.group(0) if after else ""))
    return out


def device_claim_problems(nb) -> list[str]:
    """What breaks the GPU/CPU marking in a notebook: a device mark in a loose form, a marked
    claim whose check cells do not call its helper, an unmarked claim whose check branches on
    the devices, a helper called after a claim not marked for it."""
    bad = []
    for i, c in enumerate(nb.cells):
        if c.cell_type != "markdown" or not CLAIM.search(c.source):
            continue
        marks = set(MARKED.findall(c.source))
        bad += [f"cell {i}: {label!r}: write **Claim (GPU):** or **Claim (CPU):**"
                for label in loose_device_marks(c.source)]
        checks = check_cells(nb.cells, i)
        called = {name for n in checks for name in calls(n.source)}
        bad += [f"cell {i}: a **Claim ({k}):** whose check cells never call {HELPER[k]}(...)"
                for k in sorted(marks) if HELPER[k] not in called]
        bad += [f"cell {i}: {HELPER[k]}(...) after a claim not marked **Claim ({k}):**"
                for k in sorted(set(HELPER) - marks) if HELPER[k] in called]
        if not marks:
            branches = [b for n in checks for b in device_branches(n.source)]
            bad += [f"cell {i}: an unmarked claim's check branches on `if {b}`: mark the claim **Claim (GPU):** "
                    "/ **Claim (CPU):** and branch on gpu_claim(...) / cpu_claim(...)" for b in branches]
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_gpu_claims_are_marked_and_never_pass_as_proven_on_cpu(path):
    nb = nbformat.read(str(path), as_version=4)
    bad = device_claim_problems(nb)
    assert not bad, f"{path.name}: " + "; ".join(bad)
    counts = {k: sum(len(re.findall(rf"\*\*Claims? \({k}\):\*\*", c.source)) for c in nb.cells
                     if c.cell_type == "markdown") for k in HELPER}
    every = sum(len(CLAIM.findall(c.source)) for c in nb.cells if c.cell_type == "markdown")
    assert every - counts["GPU"] > 0, f"{path.name}: every claim needs a GPU: none is proven on CPU"


def test_the_device_check_can_fail():
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    nb = new_notebook(cells=[
        new_markdown_cell("**Claim:** fine."), new_code_cell("assert 1"),
        new_markdown_cell("**Claim:** unmarked."), new_code_cell("if torch.cuda.is_available():\n    assert 1"),
        new_markdown_cell("**Claim (GPU):** marked."), new_code_cell("if n_gpus >= 1:\n    assert 1"),
        new_markdown_cell("**Claim (CPU only):** loose."), new_code_cell("if cpu_claim('x'):\n    assert 1"),
        new_markdown_cell("**Claim (GPU):** ok."), new_code_cell("if gpu_claim('x', gpus=2):\n    assert 1"),
        new_markdown_cell("**Claim:** (with GPUs) loose too."), new_code_cell("assert 1"),
    ])
    bad = device_claim_problems(nb)
    assert [b.split(":")[0] for b in bad] == ["cell 2", "cell 4", "cell 6", "cell 6", "cell 10"], bad


def test_gpu_claim_prints_not_proven_here_without_a_gpu(capsys):
    import torch

    from helpers import notebook

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: ci/gpu_check.py runs the GPU claims")
    before = len(notebook.UNPROVEN)
    assert notebook.gpu_claim("real DP on GPUs") is False and notebook.cpu_claim("DP on CPU") is True
    out = capsys.readouterr().out
    assert out.startswith("not proven here: needs a GPU (found 0); a GPU run proves it.") and "real DP" in out, out
    assert notebook.UNPROVEN[before:] == [{"claim": "real DP on GPUs", "needs": "GPU",
                                           "why": "needs a GPU (found 0); a GPU run proves it"}]


def test_10c_quotes_08a_as_it_is():
    """Issue #52: 10c said 08a's summary needs only "swap the optimizer"; it names the checkpoint call."""
    said = re.search(r"whose summary names the call: `([^`]+)`",
                     (NOTEBOOKS_DIR / "10c_casebook_models_and_checkpoints.py").read_text())
    rows = [line for line in (NOTEBOOKS_DIR / "08a_zero_and_fsdp2.py").read_text().splitlines() if "| ZeRO-1 |" in line]
    assert said and any(said.group(1) in row for row in rows), (said, rows)
