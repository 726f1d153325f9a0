"""docs/ARCHITECTURE.md is a map that stays true: its tables of the engine's names equal
``helpers.engine.__all__`` and ``helpers.engine.internal.__all__``; its module map lists exactly
the modules of each folder of ``helpers/`` and ``ci/`` (a drift fails, naming the module)."""

from __future__ import annotations

import re
from pathlib import Path

import helpers.engine
import helpers.engine.internal

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
#: the folders the module map covers, each a ``### `folder/``` heading with its table
MAPPED = ("helpers", "helpers/bench", "helpers/doctor", "helpers/engine", "helpers/engine/cluster", "ci")
_HEADING = re.compile(r"^#{2,3} ")
_ROW = re.compile(r"^\| `([^`]+)` \|")


def tables(text: str) -> dict[str, list[str]]:
    """``{heading: [first-column names of the table rows under it]}``: each table belongs to the
    heading above it; a name is the backticked first cell of a row (header and rule rows have none)."""
    found: dict[str, list[str]] = {}
    heading = ""
    for line in text.splitlines():
        if _HEADING.match(line):
            heading = line.lstrip("#").strip()
        elif (m := _ROW.match(line)):
            found.setdefault(heading, []).append(m.group(1))
    return found


def surface_tables(text: str) -> tuple[list[str], list[str]]:
    """The names of the two tables of "The learner's surface and the internal door": the first is
    ``helpers.engine.__all__``, the second ``helpers.engine.internal.__all__``."""
    section = text.split("## The learner's surface and the internal door", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.split(r"\n\s*\n", section) if b.lstrip().startswith("| name |")]
    assert len(blocks) == 2, f"expected two tables of names in the section, found {len(blocks)}"
    return [[m.group(1) for line in b.splitlines() if (m := _ROW.match(line))] for b in blocks]


def tree(folder: str) -> list[str]:
    """The modules of ``folder``: its ``.py`` files and its packages (``name/``)."""
    base = ROOT / folder
    return sorted([p.name for p in base.glob("*.py")]
                  + [f"{p.name}/" for p in base.iterdir() if (p / "__init__.py").is_file()])


def map_problems(text: str) -> list[str]:
    """What the module map of ``text`` gets wrong against the tree, one line each."""
    found, problems = tables(text), []
    for folder in MAPPED:
        listed = found.get(f"`{folder}/`")
        if listed is None:
            problems.append(f"no table under a heading `{folder}/`")
            continue
        problems += [f"{folder}/{n}: listed twice" for n in sorted({n for n in listed if listed.count(n) > 1})]
        actual = tree(folder)
        problems += [f"{folder}/{n}: in the tree, not in the map" for n in actual if n not in listed]
        problems += [f"{folder}/{n}: in the map, not in the tree" for n in listed if n not in actual]
    return problems


def test_the_surface_table_is_helpers_engine_all():
    surface = surface_tables(DOC.read_text())
    for listed, module in zip(surface, (helpers.engine, helpers.engine.internal)):
        doc, names = set(listed), set(module.__all__)
        assert sorted(listed) == sorted(names), (
            f"only in the doc: {sorted(doc - names)}; only in {module.__name__}.__all__: "
            f"{sorted(names - doc)}; or listed twice")


def test_the_module_map_is_the_tree():
    problems = map_problems(DOC.read_text())
    assert not problems, "docs/ARCHITECTURE.md's module map differs from the tree:\n" + "\n".join(problems)


def test_the_checks_fail_on_a_drifted_map():
    text = DOC.read_text()
    drifted = (text.replace("| `tiny.py` |", "| `tiny_old.py` |")
               .replace("| `RanksStopped` |", "| `RanksHalted` |"))
    assert map_problems(drifted) == ["helpers/tiny.py: in the tree, not in the map",
                                     "helpers/tiny_old.py: in the map, not in the tree"]
    surface, _ = surface_tables(drifted)
    assert "RanksStopped" not in surface and "RanksHalted" in surface
    assert map_problems(text.replace("### `ci/`", "### ci")) == ["no table under a heading `ci/`"]
