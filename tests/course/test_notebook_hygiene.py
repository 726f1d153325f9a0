"""Static checks on the committed notebooks (nothing is executed)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from ci import run_notebooks as rn
from helpers import lessons as manifest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = [NOTEBOOKS_DIR / f"{stem}.ipynb" for stem in manifest.stems(None)]  # the manifest's
IDS = [p.stem for p in NOTEBOOKS]

ABSOLUTE_PATH = re.compile(r"/home/|/root/|/work/|/Users/|\b[A-Za-z]:\\")


def read(path: Path):
    return nbformat.read(str(path), as_version=nbformat.NO_CONVERT)


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}: nothing to check"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_valid_nbformat_4(path):
    nb = read(path)
    assert nb.nbformat == 4, f"{path.name}: nbformat {nb.nbformat}, expected 4"
    nbformat.validate(nb)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_outputs_cleared(path):
    nb = read(path)
    dirty = [
        i for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: code cells {dirty} have outputs or an execution count; clear them "
        "(jupyter nbconvert --clear-output --inplace)"
    )
    executed = [i for i, c in enumerate(nb.cells) if "papermill" in c.get("metadata", {})]
    assert "papermill" not in nb.metadata and not executed, (
        f"{path.name}: carries papermill metadata (an executed copy from build/ was committed?)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_exactly_one_parameters_cell(path):
    nb = read(path)
    marked = [i for i, c in enumerate(nb.cells) if "parameters" in tags(c)]
    assert len(marked) == 1, f"{path.name}: cells tagged 'parameters': {marked}, expected exactly one"
    assert nb.cells[marked[0]].cell_type == "code", f"{path.name}: the parameters cell is not code"
    injected = [i for i, c in enumerate(nb.cells) if "injected-parameters" in tags(c)]
    assert not injected, f"{path.name}: papermill's injected-parameters cell(s) {injected} committed"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_kernelspec_python3(path):
    spec = read(path).metadata.get("kernelspec", {})
    assert spec.get("name") == "python3", f"{path.name}: kernelspec {spec!r}, expected name python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_absolute_paths(path):
    nb = read(path)
    found = [
        (i, line.strip())
        for i, c in enumerate(nb.cells)
        for line in c.source.splitlines()
        if ABSOLUTE_PATH.search(line)
    ]
    assert not found, f"{path.name}: absolute paths in (cell, line): {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_first_cell_is_markdown(path):
    nb = read(path)
    assert nb.cells and nb.cells[0].cell_type == "markdown", (
        f"{path.name}: the first cell must be markdown (title and what the notebook teaches)"
    )


@pytest.mark.parametrize("profile", rn.PROFILES)
def test_profiles_match_notebook_parameters(profile):
    """The manifest's profile tables name only declared parameters, with the defaults' types (no run)."""
    if not NOTEBOOKS:
        pytest.fail(f"no notebooks found in {NOTEBOOKS_DIR}")
    try:
        rn.plan_run(None, profile)
    except rn.ConfigError as e:
        pytest.fail(f"profile {profile!r}: {e}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_sees_every_parameter(path):
    """papermill silently skips a parameters line it cannot parse (e.g. ``x = 1  # 0 = all``):
    such a parameter cannot be overridden by a profile. Every assignment must be visible."""
    import ast

    import papermill

    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assigned = [t.id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)]
    seen = set(papermill.inspect_notebook(str(path)))
    missing = [name for name in assigned if name not in seen]
    assert not missing, (f"{path.name}: papermill cannot parse the parameters {missing}; "
                         "avoid '=' or '>=' inside their comments")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_jupytext_twin_in_sync(path):
    """Each notebook is paired with a jupytext percent-format twin ``NN_*.py`` holding the same
    cells (source, type, tags); ``jupytext --sync notebooks/*.ipynb`` brings them back together."""
    import jupytext

    twin = path.with_suffix(".py")
    assert twin.exists(), (f"{path.name} has no jupytext twin {twin.name}; create it with "
                           f"`jupytext --set-formats ipynb,py:percent notebooks/{path.name}`")
    nb = read(path)
    assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent", (
        f"{path.name}: not paired (metadata jupytext.formats); run "
        f"`jupytext --set-formats ipynb,py:percent notebooks/{path.name}`")
    text = jupytext.read(str(twin))

    def cells(book):
        return [(c.cell_type, c.source, sorted(tags(c))) for c in book.cells]

    a, b = cells(nb), cells(text)
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    assert diff is None, (
        f"{path.name} and {twin.name} differ (first at cell {diff}): one was edited without the other. "
        f"Run `jupytext --sync notebooks/{path.name}` (the newer file wins), then clear outputs.")


def test_every_twin_has_a_notebook():
    """Every .py in notebooks/ is a twin of a notebook of the manifest (tests/course/test_generate.py
    checks that the manifest lists every notebook)."""
    orphans = [p.name for p in NOTEBOOKS_DIR.glob("*.py") if p.with_suffix(".ipynb") not in NOTEBOOKS]
    assert not orphans, f"jupytext twins without a notebook of the manifest: {orphans}; run `jupytext --sync` on them"


def test_committed_language_info_is_ipykernels_without_its_version():
    """What JupyterLab copies from the kernel into a notebook it opens, less the machine's Python
    version (helpers.jupyter_hooks.pre_save drops it on every save)."""
    from ipykernel.ipkernel import IPythonKernel

    from helpers.jupyter_hooks import LANGUAGE_INFO

    assert {k: v for k, v in IPythonKernel.language_info.items() if k != "version"} == LANGUAGE_INFO


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_a_save_from_jupyterlab_writes_the_committed_bytes(path):
    """Opening a lesson in JupyterLab and saving it leaves ``git status`` clean: the committed
    metadata is what a save writes (language_info as the kernel reports it, less ``version``)
    and the file is in nbformat's own form, which the Jupyter server writes."""
    from helpers.jupyter_hooks import LANGUAGE_INFO, committed_form

    raw = path.read_text(encoding="utf-8")
    nb = read(path)
    assert nb.metadata.get("language_info") == LANGUAGE_INFO, (
        f"{path.name}: metadata.language_info is {nb.metadata.get('language_info')!r}; JupyterLab would "
        f"rewrite it on opening: commit helpers.jupyter_hooks.LANGUAGE_INFO")
    assert committed_form(nb.metadata) == nb.metadata
    written = nbformat.writes(nb, version=nbformat.NO_CONVERT)
    assert raw == written + ("" if written.endswith("\n") else "\n"), (
        f"{path.name}: not in nbformat's form (a Jupyter save would rewrite it): run jupytext --sync on its twin")
