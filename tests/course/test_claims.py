"""The claim rules' checks (``claims``, ``device-claims`` of ``ci/lessons.py``) find what they must:
every bold label starting with ``Claim`` counts, an unasserted claim fails, a device claim is
marked ``(GPU)`` / ``(CPU)`` and asserted under ``gpu_claim`` / ``cpu_claim``. test_lessons.py
runs the rules on every lesson; the notebook runs execute the asserts.
"""

from __future__ import annotations

import re
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from ci import lessons

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
RULE = {r.id: r.check for r in lessons.RULES}


def flagged(rule: str, *cells) -> list:
    """The cells (indices; None: the notebook) rule ``rule`` reports in a notebook of ``cells``,
    markdown and code in turn."""
    make = (new_markdown_cell, new_code_cell)
    nb = new_notebook(cells=[make[i % 2](c) for i, c in enumerate(cells)])
    return [i for i, _ in RULE[rule](lessons.Lesson(Path("x.ipynb"), nb))]


def test_the_check_can_fail():
    """An unasserted claim is found, an asserted one is not; a notebook without claims is."""
    assert flagged("claims", "**Claim:** 1 + 1 is 2.", "x = 1 + 1\nprint(x)",
                   "**Claim:** 2 + 2 is 4.", "%%time\nassert 2 + 2 == 4",
                   "**Claim:** close.", "torch.testing.assert_close(a, b)",
                   "**Claim:** a solution.", 'check_answer("ex1", 1, 1)') == [0, 6]
    assert flagged("claims", "No claim here.") == [None]


def test_every_bold_claim_form_is_checked():
    """Each form a notebook writes its claims in is found: unasserted it fails, asserted not."""
    for label in ["**Claim:**", "**Claims:**", "**Claim (CPU only):**", "**Claim (with GPUs):**",
                  "**Claim (`drop_last=True`):**", "**Claim**:", "**Claims** (two of them):"]:
        assert flagged("claims", f"Some text. {label} 1 + 1 is 2.", "x = 1 + 1",
                       f"{label} 2 + 2 is 4.", "assert 2 + 2 == 4") == [0], label
    assert not lessons.CLAIM.search("**Claimed** and **Disclaimer:** are not claims")


def test_the_device_check_can_fail():
    cells = ["**Claim:** fine.", "assert 1",
             "**Claim:** unmarked.", "if torch.cuda.is_available():\n    assert 1",
             "**Claim (GPU):** marked.", "if n_gpus >= 1:\n    assert 1",
             "**Claim (CPU only):** loose.", "if cpu_claim('x'):\n    assert 1",
             "**Claim (GPU):** ok.", "if gpu_claim('x', gpus=2):\n    assert 1",
             "**Claim:** (with GPUs) loose too.", "assert 1"]
    assert flagged("device-claims", *cells) == [2, 4, 6, 6, 10]
    assert flagged("device-claims", *cells[4:6], *cells[8:10]) == [0, None], "no claim proven on CPU"


def test_10c_quotes_08a_as_it_is():
    """Issue #52: 10c said 08a's summary needs only "swap the optimizer"; it names the checkpoint call."""
    said = re.search(r"whose summary names the call: `([^`]+)`",
                     (NOTEBOOKS_DIR / "10c_casebook_models_and_checkpoints.py").read_text())
    rows = [ln for ln in (NOTEBOOKS_DIR / "08a_zero_and_fsdp2.py").read_text().splitlines()
            if "| ZeRO-1 |" in ln]
    assert said and any(said.group(1) in row for row in rows), (said, rows)
