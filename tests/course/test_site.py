"""The course site (ci/site.py) built from two tiny executed notebooks, then clicked through in Chromium.

The notebooks are made here and executed once by papermill (a tiny kernel run each), as the main
job executes the lessons; the site is built from those outputs without executing anything again.
Lesson 01 has a figure, a cell tagged ``check``, a glossary link and a link to lesson 02; lesson 02
fails in its second code cell, so its page must say so. A tiny README and docs/ stand in for the
repository's (their links: README -> lesson, docs -> lesson and README, lesson -> glossary anchor).

The browser tests need Chromium (as tests/test_jupyterlab.py: ``DDP_LAB_CHROMIUM`` or Debian's
``chromium``) and Playwright: mandatory where ``CI`` is set, skipped elsewhere without them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from _support import require_browser
from ci import site

README = """# Tiny course

Start with [lesson 01](notebooks/01_one.ipynb); the words are in the [glossary](docs/GLOSSARY.md).
"""
GLOSSARY = """# Glossary

| term | meaning |
| --- | --- |
| <a id="rank"></a>**rank** | the number of one process |

## Related words

[Back to the start](../README.md), or [the teaching notes](TEACHING.md).
"""
TEACHING = """# Teaching notes

Hand out [lesson 02](../notebooks/02_two.ipynb) after [lesson 01](../notebooks/01_one.ipynb#one-figure).
"""
ONE = [
    ("markdown", "# 01 one\n\nEach process has a [rank](../docs/GLOSSARY.md#rank); next: [lesson 02](02_two.ipynb)."),
    ("parameters", "n = 3"),
    ("markdown", "## One figure"),
    ("code", "%matplotlib inline\nimport matplotlib.pyplot as plt\n\n"
             "plt.figure(figsize=(2, 2))\nplt.plot(range(n))\nplt.show()"),
    ("markdown", "**Claim:** two and two make four."),
    ("check", "assert 2 + 2 == 4\nprint('site-check-passed')"),
]
TWO = [
    ("markdown", "# 02 two\n\nBack to [lesson 01](01_one.ipynb)."),
    ("parameters", "n = 3"),
    ("code", "print('before the failure')"),
    ("code", "raise ValueError('lesson two fails on purpose')"),
    ("code", "print('never reached')"),
]


def _notebook(path: Path, cells: list[tuple[str, str]]) -> Path:
    """A notebook of ``(kind, source)`` cells: ``markdown``, ``code``, or code tagged ``kind``."""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(
        source, metadata={"tags": [kind]} if kind != "code" else {}) for kind, source in cells]
    nbformat.write(nb, str(path))
    return path


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> dict:
    """A tiny repository (README, docs, two lessons), its executed notebooks and the built site."""
    import papermill

    root = tmp_path_factory.mktemp("course")
    (root / "docs").mkdir()
    (root / "notebooks").mkdir()
    (root / "README.md").write_text(README)
    (root / "docs" / "GLOSSARY.md").write_text(GLOSSARY)
    (root / "docs" / "TEACHING.md").write_text(TEACHING)
    (root / "notebooks" / "lessons.toml").write_text(  # the course's order: the site's navigation follows it
        '[[lesson]]\nstem = "01_one"\ntitle = "one"\noutcome = "do one"\n\n'
        '[[lesson]]\nstem = "02_two"\ntitle = "two"\noutcome = "do two"\n')
    executed = root / "build" / "full"
    executed.mkdir(parents=True)
    for name, cells in (("01_one", ONE), ("02_two", TWO)):
        src = _notebook(root / "notebooks" / f"{name}.ipynb", cells)
        try:  # as the runner does: the profile's parameters injected, outputs stored
            papermill.execute_notebook(str(src), str(executed / src.name), parameters={"n": 4},
                                       cwd=str(root / "notebooks"), progress_bar=False, kernel_name="python3")
        except papermill.PapermillExecutionError:
            assert name == "02_two"
    # a notebook an older run left (a lesson since renamed) is not a lesson: not in the manifest
    shutil.copyfile(executed / "01_one.ipynb", executed / "01_old_name.ipynb")
    index = site.build_site(executed, root=root)
    return {"root": root, "executed": executed, "site": index.parent}


def test_site_pages_from_the_stored_outputs(course):
    out = course["site"]
    assert out == course["root"] / "build" / "site" and (out / "index.html").is_file()
    one = (out / "notebooks" / "01_one.html").read_text(encoding="utf-8")
    assert "site-check-passed" in one  # the check's stored output, not a new run
    assert "tag_check" in one and "Show code cell source" in one  # its code behind a toggle
    assert "This lesson failed" not in one
    two = (out / "notebooks" / "02_two.html").read_text(encoding="utf-8")
    assert "This lesson failed" in two and "lesson two fails on purpose" in two and "before the failure" in two
    # the download: the executed notebook with its outputs, without papermill's injected parameters
    download = nbformat.read(str(out / "_sources" / "notebooks" / "01_one.ipynb"), as_version=4)
    tags = [t for c in download.cells for t in c.metadata.get("tags", [])]
    assert "parameters" in tags and "injected-parameters" not in tags
    assert site.count_figures(download) == 1
    assert "_sources/notebooks/01_one.ipynb" in one  # the page's download button
    assert not (out / "notebooks" / "01_old_name.html").exists()
    nav = (out / "index.html").read_text(encoding="utf-8")
    assert nav.index("notebooks/01_one.html") < nav.index("notebooks/02_two.html") < nav.index("docs/GLOSSARY.html")


@pytest.mark.timeout(300)
def test_browser_follows_every_link_and_finds_each_figure(course):
    require_browser("the site's browser test")
    report = site.check_site(course["site"])
    assert report["problems"] == []
    assert report["pages"] >= 5, report  # the README, two lessons, two docs pages
    assert report["figures"] == {"01_one": (1, 1), "02_two": (0, 0)}, report["figures"]
    assert report["checks_collapsed"] == 1 and report["search_hits"] >= 1, report
    assert report["anchors"] >= 2 and report["files"] >= 2, report  # #rank, #one-figure; the .ipynb downloads


@pytest.mark.timeout(300)
def test_browser_check_reports_404s_missing_anchors_and_figures(course, tmp_path):
    """The check is not vacuous: a removed page, a renamed anchor and a lost figure are each reported."""
    require_browser("the site's browser test")
    broken = tmp_path / "site"
    shutil.copytree(course["site"], broken)
    (broken / "docs" / "TEACHING.html").unlink()
    glossary = broken / "docs" / "GLOSSARY.html"
    glossary.write_text(glossary.read_text(encoding="utf-8").replace('id="rank"', 'id="renamed"'), encoding="utf-8")
    for png in (broken / "_images").glob("*.png"):
        png.unlink()
    problems = "\n".join(site.check_site(broken)["problems"])
    assert "404: docs/TEACHING.html" in problems, problems
    assert "missing anchor: #rank on GLOSSARY.html (linked from notebooks/01_one.html)" in problems, problems
    assert "image not loaded" in problems and "01_one.html shows 0 loaded figure(s), its notebook has 1" in problems
