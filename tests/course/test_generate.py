"""The lesson manifest and ``python3 -m ci.generate``: one list of lessons, every generated text
up to date, and adding a lesson is its two files, one record and one command.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

from ci import agenda, generate, marked, params_table, path_table, planning
from ci.outputs import record_times
from helpers import lessons as manifest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


def test_the_manifest_lists_every_notebook_once():
    """notebooks/lessons.toml and notebooks/*.ipynb (and their .py twins) name the same notebooks."""
    listed = manifest.stems(None)
    on_disk = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert sorted(listed) == on_disk, (f"only in the manifest: {sorted(set(listed) - set(on_disk))}; "
                                       f"only on disk: {sorted(set(on_disk) - set(listed))}")
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.py")) == on_disk, "a notebook without its twin, or the reverse"
    assert [p.stem for p in planning.discover_notebooks()] == listed, "the runner runs the manifest, in its order"


def test_every_generated_text_is_up_to_date(capsys):
    rc = generate.main(["--check"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err


@pytest.mark.parametrize("text, message", [
    ('[[lesson]]\nstem = "01_a"\ntitle = "a"\n', "needs a text for outcome"),
    ('[[lesson]]\nstem = "01_a"\ntitle = "a"\noutcome = "do a"\nneeds = ["00"]\n', "needs ['00']"),
    ('[[lesson]]\nstem = "a"\ntitle = "a"\noutcome = "do a"\n', "a stem is two digits"),
    ('[[lesson]]\nstem = "01_a"\ntitle = "a"\noutcome = "do a"\ncolour = 1\n', "unknown keys ['colour']"),
    ('[[lesson]]\nstem = "01_a"\ntitle = "a"\noutcome = "do a"\n[lesson.huge]\nn = 1\n', "unknown keys ['huge']"),
    ("stem = ", "cannot read the lesson manifest"),
])
def test_a_bad_record_is_named(tmp_path, text, message):
    path = tmp_path / "lessons.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(manifest.ManifestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        manifest.load(path)


def write_lesson(folder: Path, stem: str, prose: str = "Some prose.") -> None:
    """A lesson written as docs/TESTING.md says: its percent-format twin ``<stem>.py`` (opening,
    parameters, next cell, the generated blocks still empty), then the documented jupytext command
    pairs it and writes ``<stem>.ipynb``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.py").write_text(
        f"# %% [markdown]\n# # {stem}\n#\n# {path_table.OPEN_START}\n# {path_table.OPEN_END}\n#\n# {prose}\n\n"
        '# %% tags=["parameters"]\nsteps = 3  # optimizer steps\n\n'
        f"# %% [markdown]\n# {path_table.NEXT_START}\n# {path_table.NEXT_END}\n", encoding="utf-8")
    subprocess.run([sys.executable, "-m", "jupytext", "--set-formats", "ipynb,py:percent", "--set-kernel", "python3",
                    str(folder / f"{stem}.py")], check=True, capture_output=True, timeout=120)


def block_of(path: Path, start: str, end: str, cell: int) -> str:
    source = jupytext.read(str(path)).cells[cell].source
    return marked.between(source, start, end).strip("\n")


def copy_of_the_course(tmp_path: Path) -> Path:
    """The files ``ci.generate`` reads and writes, copied to ``tmp_path / "course"``."""
    root = tmp_path / "course"
    root.mkdir()
    for name in ("README.md", "docs", "notebooks"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, root / name)
    (root / "tests" / "engine").mkdir(parents=True)
    shutil.copyfile(ROOT / "tests" / "engine" / "tutorial_edits.py", root / "tests" / "engine" / "tutorial_edits.py")
    return root


@pytest.mark.slow(15)
def test_adding_a_lesson_is_two_files_one_record_and_one_command(tmp_path, capsys):
    """A throwaway lesson in a copy of the course: after its files and its record, ``--check``
    fails; one run of ``ci.generate`` puts it in the README, the previous lesson's next link,
    its own opening, the parameter table and the agendas; then the runner plans it."""
    root = copy_of_the_course(tmp_path)
    assert generate.main(["--check", "--root", str(root)]) == 0
    last = [lesson for lesson in manifest.load() if lesson.kind == "lesson"][-1]
    (root / "notebooks" / "99_throwaway.py").write_text("# %% [markdown]\n# # 99\n", encoding="utf-8")
    with (root / "notebooks" / "lessons.toml").open("a", encoding="utf-8") as f:
        f.write('\n[[lesson]]\nstem = "99_throwaway"\ntitle = "t"\noutcome = "o"\n')
    assert generate.main(["--check", "--root", str(root)]) == 2
    assert "jupytext --set-formats ipynb,py:percent --set-kernel python3" in capsys.readouterr().err
    shutil.copyfile(ROOT / "notebooks" / "lessons.toml", root / "notebooks" / "lessons.toml")
    write_lesson(root / "notebooks", "99_throwaway")
    with (root / "notebooks" / "lessons.toml").open("a", encoding="utf-8") as f:
        f.write(f'\n[[lesson]]\nstem = "99_throwaway"\ntitle = "a throwaway lesson"\noutcome = "throw it away"\n'
                f'needs = ["{last.label}"]\n[lesson.full]\nsteps = 30\n')
    capsys.readouterr()
    assert generate.main(["--check", "--root", str(root)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert generate.main(["--root", str(root)]) == 0
    assert generate.main(["--check", "--root", str(root)]) == 0

    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "| [99 a throwaway lesson](notebooks/99_throwaway.ipynb) | throw it away | " + last.label in readme
    opening = block_of(root / "notebooks" / "99_throwaway.py", path_table.OPEN_START, path_table.OPEN_END, 0)
    assert opening == f"**You will be able to** throw it away. **You need** [{last.name}]({last.stem}.ipynb)."
    for suffix in (".ipynb", ".py"):
        nxt = block_of(root / "notebooks" / f"{last.stem}{suffix}", path_table.NEXT_START, path_table.NEXT_END, -1)
        assert nxt == "**Next:** [99 a throwaway lesson](99_throwaway.ipynb): throw it away."
    runner = (root / "docs" / "RUNNER.md").read_text(encoding="utf-8")
    assert "| [99](../notebooks/99_throwaway.ipynb) | `steps` | int | `3` | **`30`** | `3` |" in runner
    assert "99_throwaway" in marked.between((root / "docs" / "TEACHING.md").read_text(encoding="utf-8"),
                                            agenda.START, agenda.END)
    plan = planning.plan_run(["99"], "full", tmp_path / "build", notebooks_dir=root / "notebooks")
    assert plan.jobs[0].params == {"steps": 30}
    assert [p.stem for p in planning.discover_notebooks(root / "notebooks")][-1] == "99_throwaway"


def test_recorded_times_merge_and_reach_one_line_not_the_lessons(tmp_path, capsys):
    """``--record`` merges a runner's times into a profile's; the README's one run-time line names
    a lesson only when it takes longer than about a minute; no record or prose edit touches a lesson."""
    root = copy_of_the_course(tmp_path)
    first, second = manifest.stems("lesson")[:2]
    folder = tmp_path / "build" / "smoke"
    record_times([{"notebook": first, "status": "ok", "seconds": 56.7},
                  {"notebook": second, "status": "FAILED", "seconds": 3.0}],
                 folder, when="2026-12-01", host="box, 2 cores")
    before = json.loads((root / "docs" / "run_times.json").read_text())["profiles"]
    assert generate.main(["--record", str(folder / "times.json"), "--profile", "smoke", "--root", str(root)]) == 0
    times = json.loads((root / "docs" / "run_times.json").read_text())["profiles"]
    assert times["smoke"] == {**before["smoke"], first: {"seconds": 56.7, "date": "2026-12-01",
                                                         "machine": "box, 2 cores"}}, "merged"
    assert times["full"] == before["full"], "recording one profile keeps the other"
    line = path_table.run_time_line(times)
    assert line in (root / "README.md").read_text() and "box, 2 cores" in line
    assert f"{first.split('_')[0]} takes" not in line, line
    lesson = root / "notebooks" / f"{first}.ipynb"
    before = lesson.read_text()
    record_times([{"notebook": first, "status": "ok", "seconds": 141.0}], tmp_path / "b2", when="2026-12-02",
                 host="box, 2 cores")
    assert generate.main(["--record", str(tmp_path / "b2" / "times.json"), "--profile", "smoke",
                          "--root", str(root)]) == 0
    assert lesson.read_text() == before, "a lesson shows no measured time"
    assert f"{first.split('_')[0]} takes 3 min in `smoke`" in (root / "README.md").read_text()
    edited = before.replace("**The question:**", "**The question:** " + "more " * 100)
    lesson.write_text(edited, encoding="utf-8")
    assert edited != before and generate.main(["--root", str(root)]) == 0
    assert lesson.read_text() == edited, "a prose edit leaves the lesson's opening as it is"
    assert generate.main(["--record-replace", str(folder / "times.json"), "--profile", "smoke",
                          "--root", str(root)]) == 0
    assert list(json.loads((root / "docs" / "run_times.json").read_text())["profiles"]["smoke"]) == [first]
    capsys.readouterr()


def test_a_hand_edit_or_a_lost_marker_is_caught(tmp_path, capsys):
    root = copy_of_the_course(tmp_path)
    stem = manifest.stems("lesson")[0]
    twin = root / "notebooks" / f"{stem}.py"
    text = twin.read_text(encoding="utf-8")
    twin.write_text(text.replace("**You will be able to**", "**You can**", 1), encoding="utf-8")
    assert generate.main(["--check", "--root", str(root)]) == 1
    assert f"{stem}.py: out of date (the opening and next link)" in capsys.readouterr().err
    twin.write_text(text.replace(f"# {path_table.NEXT_END}\n", ""), encoding="utf-8")
    assert generate.main(["--check", "--root", str(root)]) == 2
    assert "next:end" in capsys.readouterr().err
    runner = root / "docs" / "RUNNER.md"
    runner.write_text(runner.read_text().replace(params_table.START, ""), encoding="utf-8")
    twin.write_text(text, encoding="utf-8")
    assert generate.main(["--check", "--root", str(root)]) == 2


def test_the_workshop_path_reaches_mnist_and_a_silent_bug_with_a_buffer_and_real_parts():
    """docs/TEACHING.md's 3 hours: from processes (00a) through the gradient (01) to DDP on MNIST
    against one process (04), ending with a bug a check finds (06d), a break and a buffer left."""
    from ci import workshop

    path = manifest.workshop()
    assert path[0].lesson == "00a" and "01" in [p.lesson for p in path] and path[-1].lesson == "06d"
    assert {"5", "6"} <= set(next(p for p in path if p.lesson == "04").sections), "04's DDP and its comparison"
    times = path_table.load_times()
    rows = workshop.rows(path, manifest.load(), times, NOTEBOOKS, agenda.MIN_PER_EXERCISE)
    table, buffer = workshop.block(rows)
    assert buffer >= workshop.MIN_BUFFER, f"only {buffer} min of buffer in 3 hours:\n{table}"
    assert "*break*" in table
    assert all(r["run_min"] is not None for r in rows), "record the smoke run: python3 -m ci.generate --record"
    for r, part in zip(rows, path):  # the room's plan: minutes for every part taught, talk included
        assert list(r["part_min"]) == ["setup", *part.sections, *(f"ex{n}" for n in part.exercises)], r["part_min"]
        assert all(m >= workshop.TALK_MIN for m in r["part_min"].values())
        assert r["slot_min"] >= sum(r["part_min"].values())
        assert f"§{part.sections[-1]} {max(1, round(r['part_min'][part.sections[-1]]))}" in table, table
    bad = manifest.WorkshopPart(path[0].lesson, ("1", "99"), (1,))  # a section the lesson lacks
    with pytest.raises(ValueError, match=r"\['99'\]"):
        workshop.rows([bad], manifest.load(), {}, NOTEBOOKS, 8)


def test_section_times_come_from_the_executed_cells(tmp_path):
    """A part's seconds are the sum of papermill's durations of its cells; set-up cells and
    exercises are parts of their own."""
    from ci import workshop

    nb = nbformat.v4.new_notebook()
    sources = [("markdown", "# t"), ("code", "x = 1"), ("markdown", "## 1. First"), ("code", "a"), ("code", "b"),
               ("markdown", "## 2b. Second"), ("code", "c"), ("markdown", "## What we saw"),
               ("markdown", "### Exercise 1: e"), ("code", "answer_1 = None")]
    for i, (kind, src) in enumerate(sources):
        cell = nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        cell.metadata["papermill"] = {"duration": float(i)}
        nb.cells.append(cell)
    path = tmp_path / "run.ipynb"
    nbformat.write(nb, str(path))
    assert workshop.parts_of_cells(nb) == ["setup", "setup", "1", "1", "1", "2b", "2b", "summary", "ex1", "ex1"]
    assert workshop.part_seconds(path) == {"setup": 1.0, "1": 9.0, "2b": 11.0, "summary": 7.0, "ex1": 17.0}


def test_the_casebook_index_lists_every_case():
    from ci import casebook

    text = (ROOT / "docs" / "CASEBOOK.md").read_text(encoding="utf-8")
    in_lessons = 0
    for stem in manifest.stems(None):
        found = casebook.cases(NOTEBOOKS / f"{stem}.ipynb")
        assert found or stem not in manifest.stems("casebook"), stem
        in_lessons += len(found) * (stem not in manifest.stems("casebook"))
        for anchor, _ in found:
            assert f"(../notebooks/{stem}.ipynb#{anchor})" in text
    assert in_lessons >= 10, "the lessons' cases are indexed too (issue 52): a symptom line after an anchor"


def test_checks_table_comes_from_the_pages_records(tmp_path, monkeypatch):
    """docs/CHECKS.md: record_checks writes a page's record, ci.checks_table renders them, names a
    page to run when its record is missing, and --check sees a stale file; both indexes link it."""
    from ci import checks_table
    from helpers import notebook

    monkeypatch.setattr(manifest, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(checks_table, "RECORDS", tmp_path / "build" / "checks")
    monkeypatch.setattr(checks_table, "DOC", tmp_path / "CHECKS.md")
    monkeypatch.setattr(checks_table, "PAGES", ("06d_silent_bugs", "09_x"))
    with pytest.raises(ValueError, match="unknown check"):
        notebook.record_checks("09_x", {"case": {"assert_synced": "caught"}})
    notebook.record_checks("06d_silent_bugs", {"a": {"data_coverage": "caught: item 9 never read"},
                                               "b": {"assert_in_sync": "not caught: the replicas agree"}})
    with pytest.raises(SystemExit, match="no record of 09_x .* run python3 ci/run_notebooks.py 09"):
        checks_table.main([])
    notebook.record_checks("09_x", {"c": {"against_one_process": "caught: step 1"}})
    assert checks_table.main([]) == 0
    text = (tmp_path / "CHECKS.md").read_text(encoding="utf-8")
    assert "2 of 3 cases caught by at least one check." in text, text
    assert "| [06d](../notebooks/06d_silent_bugs.ipynb) | a |  | caught: item 9 never read |  |" in text, text
    assert checks_table.main(["--check"]) == 0
    notebook.record_checks("09_x", {"c": {"against_one_process": "not caught"}})
    with pytest.raises(SystemExit, match="differs from the pages' records"):
        checks_table.main(["--check"])
    for doc in ("CASEBOOK.md", "OWN_CODE.md"):
        assert "(CHECKS.md)" in (ROOT / "docs" / doc).read_text(encoding="utf-8"), doc
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")  # CI fails on a stale table, from the smoke run's records
    assert run.index("--profile smoke") < run.index("ci.checks_table --check") < run.index("--profile full"), run
    committed = (ROOT / "docs" / "CHECKS.md").read_text(encoding="utf-8")
    assert all(f"(../notebooks/{p}.ipynb)" in committed for p in ("06d_silent_bugs",)), committed
