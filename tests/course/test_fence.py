"""The fence between the two rooms of ``helpers/``: the course (lessons, their helpers) and the engine.

1. Notebook twins and course modules import from the engine only its surface (the ``__all__`` of
   ``helpers.engine``, ``helpers.mp``, 07a's ``helpers.engine.cluster``); ``helpers/bench``,
   ``helpers/doctor``, ``ci/`` and ``helpers/ipc_kernel.py`` also the internal door
   (``helpers.engine.internal``); only ``ci/`` imports ``ci``. A violation names file, line, module.
2. No engine module imports a course module, nor names one in a string (the engine's ``run_job``
   and friends take torchrun's entry module as ``module=``).
3. Code in README and docs/ (but the engine's ARCHITECTURE.md) imports the surface only.

Read with ``ast`` (imports inside functions count); nothing is imported but ``helpers.engine`` and
``helpers.engine.internal``, which import no torch.
"""

from __future__ import annotations

import ast
import re
from importlib.util import resolve_name
from pathlib import Path

import pytest

import helpers.engine
import helpers.engine.internal

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "helpers.engine"


def _all_of(path: Path) -> set[str]:
    """``__all__`` of a module, read from its source (importing the cluster package would import torch)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


#: public module -> the names one may import from it (``None``: the module itself only)
PUBLIC = {
    ENGINE: set(helpers.engine.__all__),
    f"{ENGINE}.cluster": _all_of(ROOT / "helpers/engine/cluster/__init__.py"),
    "helpers.mp": _all_of(ROOT / "helpers/engine/mp.py"),
}
#: what only the benchmarks, the doctor, the runner and the tests need
INTERNAL = {f"{ENGINE}.internal": set(helpers.engine.internal.__all__)}


def may_use_internal(rel: str) -> bool:
    """``helpers/bench``, ``helpers/doctor`` and ``ci/`` may import the internal door; so may
    ``helpers/ipc_kernel.py`` (its kernels' socket files go where the engine's do). Lessons and the
    course helpers they call may not."""
    return rel.startswith(("helpers/bench/", "helpers/doctor/", "ci/")) or rel == "helpers/ipc_kernel.py"


def _module_name(path: Path) -> str:
    rel = (path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path(path.name)).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """``(line, module, names)`` of every import in ``path``: ``names`` is ``None`` for ``import m``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):  # relative too: from .common import x
            module = resolve_name("." * node.level + (node.module or ""), package)
            yield node.lineno, module, [a.name for a in node.names]


def fence_violations(path: Path, rel: str | None = None) -> list[str]:
    """Each import in ``path`` that reaches into the engine past its public surface, as
    ``file:line: text`` (``from helpers import engine`` / ``mp`` count as the modules they name);
    outside ``ci/``, each import of ``ci`` (the handout ships without the CI runner)."""
    rel = rel or str(path.relative_to(ROOT))
    found = []
    for line, module, names in sorted(_imports(path), key=lambda i: i[0]):
        if module.split(".")[0] == "ci" and not rel.startswith("ci/"):
            found.append(f"{rel}:{line}: imports {module}: the handout has no ci/")
        targets = [(module, names)]
        if module == "helpers" and names:  # from helpers import engine, mp, data
            targets = [(f"helpers.{n}", None) for n in names if n in ("engine", "mp")]
        for mod, imported in targets:
            if not (mod == ENGINE or mod.startswith(ENGINE + ".") or mod == "helpers.mp"):
                continue
            allowed = {**PUBLIC, **(INTERNAL if may_use_internal(rel) else {})}
            if mod not in allowed:
                found.append(f"{rel}:{line}: imports {mod}, inside the engine: use the surface "
                             f"(from helpers.engine import ...; names in helpers.engine.__all__)")
                continue
            bad = sorted(set(imported or ()) - allowed[mod])
            if bad:
                found.append(f"{rel}:{line}: imports {', '.join(bad)} from {mod}, not in its __all__")
    return found


def _course_files() -> list[Path]:
    h = ROOT / "helpers"
    files = [*sorted((ROOT / "notebooks").glob("*.py")), *sorted(h.glob("*.py")),
             *sorted((h / "bench").rglob("*.py")), *sorted((h / "doctor").rglob("*.py")),
             *sorted((ROOT / "ci").rglob("*.py"))]
    return [p for p in files if p != h / "mp.py"]  # helpers/mp.py is the alias of helpers.engine.mp


def test_course_imports_only_the_engines_surface_and_no_ci():
    files = _course_files()
    assert len(files) > 30 and any(p.parent.name == "notebooks" for p in files), files
    found = [v for p in files for v in fence_violations(p)]
    assert not found, "imports past the engine's public surface or of ci/:\n" + "\n".join(found)


PLANTED = ("import os\nfrom helpers.engine import launch, worker_device\n"
           "def f():\n    from helpers.engine.processes import descendants\n"
           "from helpers.engine import fork_server\nimport helpers.engine.warm_ranks\n"
           "from helpers.engine.cluster import run_job, agents\nimport helpers.mp as mp\n"
           "from ci.planning import plan_run\nfrom helpers.engine.internal import end_processes\n"
           "from helpers.engine.internal import nope\nfrom helpers.engine import end_processes\n")
#: what the fence says of each line of PLANTED (a line not here passes), in a course module and
#: in a module that may use the internal door (and, in ci/, import ci)
COURSE = {4: "imports helpers.engine.processes, inside the engine", 9: "imports ci.planning",
          5: "imports fork_server from helpers.engine, not in its __all__",
          6: "imports helpers.engine.warm_ranks, inside", 7: "agents from helpers.engine.cluster",
          10: "imports helpers.engine.internal, inside the engine", 11: "helpers.engine.internal,",
          12: "end_processes from helpers.engine, not in its __all__"}
DOOR = {**COURSE, 10: None, 11: "imports nope from helpers.engine.internal, not in its __all__"}


@pytest.mark.parametrize("rel, said", [
    *[(rel, COURSE) for rel in ("notebooks/00a_processes.py", "helpers/mnist_train.py")],
    *[(rel, DOOR) for rel in ("helpers/bench/threads.py", "helpers/doctor/run.py")],
    ("ci/cleanup.py", {**DOOR, 9: None})])
def test_the_fence_names_file_line_and_module_of_a_planted_bad_import(tmp_path, rel, said):
    """Only bench, the doctor and ci/ may use the internal door; only ci/ may import ci."""
    (tmp_path / "planted.py").write_text(PLANTED)
    found = fence_violations(tmp_path / "planted.py", rel)
    assert [v.split(": ", 1)[0] for v in found] == [f"{rel}:{n}" for n in sorted(said) if said[n]]
    assert all(said[int(v.split(":")[1])] in v for v in found), found


def test_the_surface_and_the_door_do_not_overlap():
    """A name is either the learner's (``helpers.engine``) or internal, never both; each resolves."""
    surface, door = set(helpers.engine.__all__), set(helpers.engine.internal.__all__)
    assert not surface & door, surface & door
    for module, names in ((helpers.engine, surface), (helpers.engine.internal, door)):
        missing = [n for n in sorted(names) if getattr(module, n, None) is None]
        assert not missing, f"{module.__name__} lists names it cannot give: {missing}"


def _course_modules() -> set[str]:
    h = ROOT / "helpers"
    course = {p.stem for p in h.glob("*.py")} | {p.name for p in h.glob("*/__init__.py")}
    return course - {"__init__", "engine", "mp"}  # the package, the engine, the alias of its mp


def engine_violations(path: Path, course: set[str]) -> list[str]:
    """Each import of a course module ``helpers.<name>`` in engine module ``path``, and each string
    constant naming one (a module run by a name in a string is an import too), as ``file:line:
    text``. Docstrings are prose (one may say who calls a module) and are not read."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = [f"{rel}:{line}: imports helpers.{h}" for line, module, names in _imports(path)
             for h in (names or () if module == "helpers" else module.split(".")[1:2]
                       if module.startswith("helpers.") else ()) if h in course]
    pattern = re.compile(r"\bhelpers[./](" + "|".join(sorted(map(re.escape, course))) + r")\b")
    tree = ast.parse(path.read_text(), filename=str(path))
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, documented)
                  and ast.get_docstring(node, clean=False) is not None}
    return found + [f"{rel}:{node.lineno}: names helpers.{m.group(1)}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings for m in pattern.finditer(node.value)]


def test_no_engine_module_imports_or_names_a_course_module():
    """The import graph of helpers/ has two rooms: engine modules import the standard library,
    packages, ``helpers`` itself (``REPO_ROOT``) and other engine modules, never a course module;
    torchrun runs the course's MNIST entry because the course passes its name in (``module=``)."""
    engine_files = sorted((ROOT / "helpers" / "engine").rglob("*.py"))
    course = _course_modules()
    assert len(engine_files) > 10 and "mnist_torchrun" in course, (engine_files, course)
    found = [v for path in engine_files for v in engine_violations(path, course)]
    assert not found, ("engine modules importing or naming course modules (pass them in from the "
                       "course instead):\n" + "\n".join(found))


def test_a_planted_course_import_or_entry_by_name_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Run by helpers.mnist_torchrun."""\nimport importlib\n'
                       'ENTRY = "helpers.mnist_torchrun"\nimportlib.import_module(ENTRY)\n'
                       "from helpers import REPO_ROOT, tiny\nimport helpers.sampler\n")
    assert engine_violations(planted, _course_modules()) == [
        "planted.py:5: imports helpers.tiny", "planted.py:6: imports helpers.sampler",
        "planted.py:3: names helpers.mnist_torchrun"]


#: an import of the engine written in Markdown (a code block or inline code)
_DOC_IMPORT = re.compile(r"(?:from (helpers\.engine[\w.]*) import ([\w, ]+)|import (helpers\.engine\.[\w.]+))")
#: a dotted name in backticks in the docs: ``helpers.engine.free_port``, ``helpers.mp.spawn``, ...
_DOC_NAME = re.compile(r"`(helpers(?:\.[A-Za-z_]\w*)+)")


def doc_name_problems(text: str) -> list[str]:
    """The ``helpers.*`` names written in backticks in ``text`` that do not exist: the longest prefix
    that is a module, then each attribute after it (the docs name helpers' own names only)."""
    import functools
    import importlib

    problems = []
    for name in sorted(set(_DOC_NAME.findall(text))):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                functools.reduce(getattr, parts[cut:], obj)
            except AttributeError:
                problems.append(name)
            break
    return problems


def test_docs_import_only_the_surface_and_name_helpers_that_exist():
    """Code in README.md and docs/*.md (but the engine's own ARCHITECTURE.md) imports the surface
    only; an inline ``helpers.x.y`` there names a module or attribute that exists (a moved module
    left `helpers.procs.free_port` in the teaching notes once)."""
    assert doc_name_problems("use `helpers.procs.free_port` or `helpers.engine.nope`") == [
        "helpers.engine.nope", "helpers.procs.free_port"]
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text, rel = path.read_text(), path.relative_to(ROOT)
        found += [f"{rel}: names {name}, which does not exist" for name in doc_name_problems(text)]
        for n, line in enumerate(text.splitlines() if path.name != "ARCHITECTURE.md" else (), 1):
            for m in _DOC_IMPORT.finditer(line):
                module, names = m.group(1) or m.group(3), set(re.findall(r"\w+", m.group(2) or ""))
                if module not in PUBLIC or names - PUBLIC[module]:
                    found.append(f"{rel}:{n}: {m.group(0)}: past the engine's surface")
    assert not found, "\n".join(found)
