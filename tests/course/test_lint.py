"""Lint as a habit: ruff (configured in pyproject.toml) on the code and the notebooks' .py twins,
and the dependencies declared once for pip (pyproject.toml) and once for the README (requirements.txt)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ci.matrix import VERSIONS

ROOT = Path(__file__).resolve().parents[2]
LINTED = ["helpers", "ci", "tests", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.py"))]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_ruff_is_clean_and_lints_the_notebook_twins():
    """ruff passes; the twins are linted at all: they exist, and ruff does not exclude them."""
    proc = _ruff(*LINTED)
    assert proc.returncode == 0, (
        f"`ruff check {' '.join(LINTED)}` found problems (many are fixed by `ruff check --fix ...`):\n"
        + proc.stdout + proc.stderr)
    twins = [p for p in LINTED if p.startswith("notebooks/")]
    proc = _ruff("--show-files", *twins)
    listed = {Path(line.strip()).name for line in proc.stdout.splitlines() if line.strip()}
    assert twins and {Path(t).name for t in twins} <= listed, proc.stdout + proc.stderr


def test_pyproject_dependencies_mirror_requirements_txt():
    """`pip install -e .` alone gives the same install as `pip install -r requirements.lock`."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = sorted(str(Requirement(r)) for r in project["dependencies"])
    assert declared == sorted(map(str, _requirements("requirements.txt"))), declared


def _requirements(name: str) -> list:
    from packaging.requirements import Requirement

    return [Requirement(line.split("#", 1)[0]) for line in (ROOT / name).read_text().splitlines() if line[:1].isalnum()]


@pytest.mark.parametrize("python", VERSIONS)
def test_lock_pins_each_requirement_at_a_version_it_allows(python):
    """requirements.lock (``python3 -m ci.lock``) pins every package requirements.txt names, once, at a
    version its specifier admits, on this Python of the matrix, on Linux and on macOS."""
    from packaging.utils import canonicalize_name as canon

    assert "-e ." in (ROOT / "requirements.lock").read_text().splitlines(), "the lock must install the repository"
    pins, problems = _requirements("requirements.lock"), []
    for platform, machine in (("linux", "x86_64"), ("darwin", "arm64")):
        env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": platform,
               "platform_system": platform.title(), "platform_machine": machine}
        for req in _requirements("requirements.txt"):
            if req.marker is None or req.marker.evaluate(env):
                found = [str(p.specifier) for p in pins if canon(p.name) == canon(req.name)
                         and (p.marker is None or p.marker.evaluate(env))]
                if len(found) != 1 or not req.specifier.contains(found[0][2:], prereleases=True):
                    problems.append(f"{req} on {platform}: the lock has {found or 'no pin'}")
    assert not problems, "requirements.lock disagrees with requirements.txt: python3 -m ci.lock\n" + "\n".join(problems)


def test_nbformat_imports_without_building_iri_parsers():
    """requirements.txt keeps jsonschema below 4.25 (its comment says why): importing nbformat, as
    JupyterLab, papermill, the runner and every test worker do, leaves rfc3987_syntax unimported."""
    code = "import sys, nbformat; print('rfc3987_syntax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", ("importing nbformat built rfc3987-syntax's IRI parsers (about 2 CPU-s): "
                                    "jsonschema>=4.25 is installed; python3 -m pip install -r requirements.lock")


def test_requires_python_is_the_tested_range():
    """pyproject.toml admits exactly the Pythons that ci/matrix.py tests (docs/MATRIX.md): no untested newer one."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    minors = [int(v.split(".")[1]) for v in VERSIONS]
    assert minors == list(range(minors[0], minors[-1] + 1)), f"the matrix skips a version: {VERSIONS}"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert declared == f">=3.{minors[0]},<3.{minors[-1] + 1}", (
        f"requires-python is {declared!r} but ci/matrix.py tests {VERSIONS}: change one of them")


MAX_LINES = 500


def test_no_module_in_helpers_or_ci_passes_500_lines():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
               for folder in ("helpers", "ci") for p in sorted((ROOT / folder).rglob("*.py"))}
    over = [f"{p} ({n})" for p, n in lengths.items() if n > MAX_LINES]
    assert not over, f"past {MAX_LINES} lines, split along its seams: " + ", ".join(over)


#: the last commit before the habit (issue 32): subjects after it are at most 72 characters
HABIT_START = "ab4f5da"
MAX_SUBJECT = 72


def test_commit_subjects_after_the_habit_began_fit_72_characters():
    """Commit subjects from HABIT_START (exclusive) to HEAD: at most 72 characters, the why in the body."""
    try:
        known = subprocess.run(["git", "cat-file", "-e", f"{HABIT_START}^{{commit}}"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"no git here to read the history ({e})")
    if known.returncode != 0:
        pytest.skip(f"commit {HABIT_START} is not in this clone's history (a shallow clone, or no .git): "
                    "nothing to check the subjects from")
    log = subprocess.run(["git", "log", "--format=%h %s", f"{HABIT_START}..HEAD"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    long = [line for line in log.splitlines() if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert not long, (f"commit subjects over {MAX_SUBJECT} characters (reword them, the why goes in the body):\n"
                      + "\n".join(long))


def test_xdist_keeps_a_group_in_one_worker(tmp_path):
    """`--dist loadgroup` keeps the fault matrix (one report) and module-scoped fixtures in one worker each;
    pytest 9.2 with pytest-xdist 3.8 silently spread groups (pytest-dev/pytest-xdist#1386): requirements.txt
    holds pytest below 9.2, and this catches the next such release (python3 -m ci.drift runs it)."""
    (tmp_path / "test_g.py").write_text("import os, pathlib, pytest\npytestmark = pytest.mark.xdist_group('g')\n"
                                        "@pytest.mark.parametrize('i', range(6))\ndef test_a(i):\n"
                                        "    pathlib.Path(os.environ['PYTEST_XDIST_WORKER']).touch()\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p",
                           "no:cacheprovider", "test_g.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    workers = sorted(p.name for p in tmp_path.glob("gw*"))
    assert proc.returncode == 0 and len(workers) == 1, (workers, proc.stdout[-2000:])
