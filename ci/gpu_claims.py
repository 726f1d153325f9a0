"""The claims that need a GPU (or its absence), parsed from the notebooks: one list for the claim
test (tests/course/test_claims.py), the GPU check (ci/gpu_check.py) and its unit test.

A claim that only a GPU can prove starts ``**Claim (GPU):**``; one true only without GPUs starts
``**Claim (CPU):**``. The check cells after it (the code cells up to the next markdown cell) run
their asserts under ``if gpu_claim(...):`` / ``if cpu_claim(...):`` (``helpers.notebook``), which
print ``not proven here: ...`` where they cannot run. Nothing here imports torch or runs code.

    python3 -m ci.gpu_claims          # the marked claims, one a line
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat

from ci.planning import discover_notebooks

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
#: the two device marks, in the label's parenthesis: ``**Claim (GPU):**``, ``**Claim (CPU):**``
MARKED = re.compile(r"\*\*Claims? \((GPU|CPU)\):\*\*")
#: the helper each mark's check cell must call
HELPER = {"GPU": "gpu_claim", "CPU": "cpu_claim"}
#: an ``if`` whose test mentions one of these branches on the machine's devices
DEVICE_TEST = re.compile(r"cuda|gpu|device_count", re.IGNORECASE)
NOT_PROVEN = "not proven here:"  # helpers.notebook.NOT_PROVEN (not imported: it would import the helpers)


def check_cells(cells, i: int) -> list:
    """The code cells after markdown cell ``i``, up to the next markdown cell."""
    out = []
    for c in cells[i + 1:]:
        if c.cell_type == "markdown":
            break
        if c.cell_type == "code":
            out.append(c)
    return out


def code_tree(source: str):
    """The code's syntax tree with IPython's ``%`` and ``!`` lines left out; None where it does not parse."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def calls(source: str) -> dict[str, list[str]]:
    """``{function name: [its first argument when a string literal, ...]}`` for the functions the
    code calls (``f(...)`` and ``x.f(...)``)."""
    tree = code_tree(source)
    out: dict[str, list[str]] = {}
    for n in ast.walk(tree) if tree is not None else ():
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            first = n.args[0] if n.args else None
            out.setdefault(name, []).extend(
                [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else [])
    return out


def device_branches(source: str) -> list[str]:
    """The tests of the ``if`` statements that branch on the machine's devices
    (``torch.cuda.is_available()``, ``n_gpus``, ``device_count()``...), as source text."""
    tree = code_tree(source)
    if tree is None:
        return []
    return [ast.unparse(n.test) for n in ast.walk(tree)
            if isinstance(n, ast.If) and DEVICE_TEST.search(ast.unparse(n.test))]


def first_words(text: str, limit: int = 100) -> str:
    """The claim's first sentence (up to ``limit`` characters), on one line."""
    text = re.split(r"\*\*Claims?\b", " ".join(text.split()))[0].strip()
    end = re.search(r"[.:;](\s|$)", text)
    text = text[:end.start() + 1] if end else text
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def marked_claims(notebooks_dir: Path = NOTEBOOKS_DIR, needs: str | None = None) -> list[dict]:
    """Every ``**Claim (GPU):**`` and ``**Claim (CPU):**`` of ``notebooks_dir``'s notebooks, in lesson
    and cell order: ``{"lesson": stem, "cell": markdown cell index, "needs": "GPU" or "CPU",
    "claim": its first words, "helper_calls": [the claim strings its check cells pass to
    ``gpu_claim`` (GPU) or ``cpu_claim`` (CPU)]}``; ``needs`` keeps one kind."""
    out = []
    for path in discover_notebooks(notebooks_dir):  # the manifest's, in its order
        cells = nbformat.read(str(path), as_version=4).cells
        for i, c in enumerate(cells):
            if c.cell_type != "markdown":
                continue
            for m in MARKED.finditer(c.source):
                kind = m.group(1)
                if needs and kind != needs:
                    continue
                args = [a for n in check_cells(cells, i) for a in calls(n.source).get(HELPER[kind], [])]
                out.append({"lesson": path.stem, "cell": i, "needs": kind,
                            "claim": first_words(c.source[m.end():]), "helper_calls": args})
    return out


def unproven_outputs(executed: Path) -> list[str]:
    """The ``not proven here: ...`` lines printed by the cells of an executed notebook."""
    lines = []
    for c in nbformat.read(str(executed), as_version=4).cells:
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            text = o.get("text", "") if o.get("output_type") == "stream" else ""
            lines += [ln for ln in text.splitlines() if ln.startswith(NOT_PROVEN)]
    return lines


def gpu_claim_status(executed_dir: Path | None, notebooks_dir: Path = NOTEBOOKS_DIR) -> list[dict]:
    """Each ``**Claim (GPU):**`` of :func:`marked_claims` with ``status``: ``proven on GPU`` when
    its lesson's executed notebook ``executed_dir/<stem>.ipynb`` exists and printed no ``not
    proven here:`` line for it, ``not proven: <that line>`` when it did, ``not run`` when the
    notebook is missing (every claim when ``executed_dir`` is None)."""
    rows = []
    for claim in marked_claims(notebooks_dir, needs="GPU"):
        nb = Path(executed_dir) / f"{claim['lesson']}.ipynb" if executed_dir else None
        if nb is None or not nb.exists():
            status = "not run"
        else:
            mine = [ln for ln in unproven_outputs(nb) if any(a in ln for a in claim["helper_calls"])]
            status = f"not proven: {mine[0]}" if mine else "proven on GPU"
        rows.append({**claim, "status": status})
    return rows


if __name__ == "__main__":
    for row in marked_claims():
        print(f"{row['needs']}  {row['lesson']:36s} cell {row['cell']:3d}  {row['claim']}")
