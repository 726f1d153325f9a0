"""One copy of the course, one install (issue 40, part 6): two real copies of the course where the
other copy is the one the Python imports (first on ``PYTHONPATH``, as ``pip install -e .`` of it
maps it, or stronger), and a real ``pip install -e`` of the repository and of its handout into a
throwaway venv. Each copy's runner, doctor and kernels run its own ``helpers`` and ``ci``, or stop
naming both folders; the handout's install leaves the repository's mapping alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest

from _support import REPO_ROOT
from ci import student_copies
from helpers import lessons as manifest

IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def write_notebook(path: Path) -> None:
    """A notebook with a ``parameters`` cell that prints where its ``helpers`` comes from."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("n = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("import helpers\nprint('HELPERS', helpers.REPO_ROOT)")]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def copy_course(dst: Path, notebooks: tuple[str, ...] = ("01_where",), name: str = "ddp-lab") -> Path:
    """A copy of this repository's code (``helpers``, ``ci``, ``pyproject.toml``) at ``dst``, with the
    project ``name`` and its own ``notebooks``."""
    for folder in ("helpers", "ci"):
        shutil.copytree(REPO_ROOT / folder, dst / folder, ignore=IGNORE)
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (dst / "pyproject.toml").write_text(text.replace('name = "ddp-lab"', f'name = "{name}"', 1), encoding="utf-8")
    for stem in notebooks:
        write_notebook(dst / "notebooks" / f"{stem}.ipynb")
    return dst.resolve()


@pytest.fixture
def copies(tmp_path):
    """``(a, b)``: two copies of the course; only ``a`` has the notebook ``02_only_in_a``."""
    return (copy_course(tmp_path / "a", ("01_where", "02_only_in_a")), copy_course(tmp_path / "b"))


def run(args: list[str], cwd: Path | str, first: Path) -> subprocess.CompletedProcess:
    """``python3 ARGS`` in ``cwd`` with the copy ``first`` on ``PYTHONPATH``, in place of any other."""
    env = {**os.environ, "PYTHONPATH": str(first)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow(15)
def test_runner_kernels_import_their_own_copy(copies, tmp_path):
    a, b = copies
    proc = run([str(b / "ci" / "run_notebooks.py"), "01_where", "--output-dir", str(tmp_path / "build")], "/",
               first=a)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = nbformat.read(str(tmp_path / "build" / "smoke" / "01_where.ipynb"), as_version=4)
    printed = "".join(o.get("text", "") for o in out.cells[-1].outputs)
    assert printed.strip() == f"HELPERS {b}", printed


def test_import_helpers_in_another_copy_names_both_and_the_runner_lists_its_own(copies):
    """A kernel in ``b/notebooks`` (its working folder) whose Python imports ``a``'s helpers stops at
    ``import helpers``; a copy written inside ``a`` (the handout's default ``student/``) may use ``a``'s."""
    a, b = copies
    proc = run(["-c", "import helpers"], b / "notebooks", first=a)
    assert proc.returncode != 0 and "CheckoutMismatch" in proc.stderr, proc.stderr
    assert f"copy of the course at {b}," in proc.stderr and f"another copy, {a}." in proc.stderr, proc.stderr
    inner = copy_course(a / "student", name=student_copies.HANDOUT_DIST)
    proc = run(["-c", "import helpers; print(helpers.REPO_ROOT)"], inner / "notebooks", first=a)
    assert proc.returncode == 0 and proc.stdout.strip() == str(a), proc.stderr
    proc = run([str(b / "ci" / "run_notebooks.py"), "--list"], "/", first=a)  # b's runner lists b's
    assert proc.returncode == 0, proc.stderr
    assert "01_where" in proc.stdout and "02_only_in_a" not in proc.stdout, proc.stdout


def test_doctor_names_both_copies(copies):
    """``b``'s doctor where ``a`` is what the Python imports: the python check fails naming both
    (JupyterLab's kernels in ``b/notebooks`` would run ``a``'s helpers); started in ``b/notebooks``,
    where ``-m`` finds ``a``'s doctor, it stops at once, naming both; never a traceback."""
    a, b = copies
    proc = run(["-m", "helpers.doctor", "--only", "python"], b, first=a)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fail = next((line for line in proc.stdout.splitlines() if line.startswith("FAIL  python")), "")
    assert f"in {b / 'notebooks'} would import helpers from {a}," in fail, proc.stdout
    proc = run(["-m", "helpers.doctor", "--only", "python"], b / "notebooks", first=a)
    assert proc.returncode != 0 and str(a) in proc.stderr and str(b) in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.slow(15)
def test_handout_install_leaves_the_repositorys_mapping(tmp_path):
    """``pip install -e`` of the repository, then of its handout, into one (throwaway) Python: ``helpers``
    and ``ci`` are still the repository's. The venv sees this Python's packages through a ``.pth`` (pip,
    setuptools: no network); pip never uninstalls outside the venv, so this Python's own install is left as it is."""
    pytest.importorskip("setuptools", minversion="64")  # editable installs of pyproject.toml projects
    repo = copy_course(tmp_path / "repo")
    handout = tmp_path / "handout"
    student_copies.write_student_copies(manifest.stems()[:1], handout)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # this Python's packages (pip, the locked setuptools), not the base interpreter's: a venv's own base may
    # hold an older setuptools, without bdist_wheel
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"])
    python = venv / "bin" / "python"
    for folder in (repo, handout):
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--disable-pip-version-check", "-e", str(folder)],
                       check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", "import ci, helpers; print(helpers.REPO_ROOT); print(ci.__file__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(repo), str(repo / "ci" / "__init__.py")], proc.stdout
