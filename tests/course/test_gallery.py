"""The runner's HTML gallery (ci/gallery.py, ``--gallery``) on tiny throwaway notebooks."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ci import gallery
from ci import run_notebooks as rn

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "ci" / "run_notebooks.py"

PARAMS = "n = 2\n"
OK_CELLS = ['print(f"gallery-ok n={n}")']
FAIL_CELLS = ["y = 1", 'assert n == 3, "n is not 3 (gallery test)"', 'print("never reached")']


def make_notebook(path: Path, cells: list[str]) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells.append(nbformat.v4.new_markdown_cell(f"# {path.stem}"))
    cell = nbformat.v4.new_code_cell(PARAMS)
    cell.metadata["tags"] = ["parameters"]
    nb.cells.append(cell)
    nb.cells.extend(nbformat.v4.new_code_cell(src) for src in cells)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    # from a foreign cwd, as CI's main job runs the script
    return subprocess.run([sys.executable, str(RUNNER), *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def index_rows(index: Path) -> dict[str, dict]:
    """notebook -> {status, seconds, href, error} parsed from index.html."""
    text = index.read_text(encoding="utf-8")
    rows = {}
    for m in re.finditer(r'<tr class="[^"]*" data-notebook="([^"]+)" data-status="([^"]+)">(.*?)</tr>',
                         text, re.S):
        name, status, body = m.group(1), m.group(2), m.group(3)
        href = re.search(r'<a href="([^"]+\.html)">', body)
        seconds = re.search(r'<td class="seconds">([^<]*)</td>', body).group(1)
        error = html.unescape(re.search(r'<td class="error">(.*?)</td>', body, re.S).group(1))
        shown_status = re.search(r'<td class="status [^"]*">([^<]*)</td>', body).group(1)
        rows[name] = {"status": status, "shown_status": shown_status, "seconds": seconds,
                      "href": href.group(1) if href else None, "error": error}
    return rows


@pytest.mark.slow(20)
@pytest.mark.timeout(300)
def test_gallery_lists_ok_and_failed_notebooks(tmp_path: Path, no_leftover_processes):
    nbdir = tmp_path / "notebooks"
    make_notebook(nbdir / "01_tiny_ok.ipynb", OK_CELLS)
    make_notebook(nbdir / "02_tiny_fail.ipynb", FAIL_CELLS)
    out = tmp_path / "build"
    proc = run_cli(["--notebooks-dir", str(nbdir), "--output-dir", str(out), "--gallery"])
    assert proc.returncode == rn.EXIT_FAILED, proc.stdout + proc.stderr

    folder = out / "smoke"
    index = folder / "index.html"
    assert index.is_file(), f"no index.html in {folder}:\n{proc.stdout}\n{proc.stderr}"
    assert f"gallery: {index}" in proc.stdout
    rows = index_rows(index)
    assert set(rows) == {"01_tiny_ok", "02_tiny_fail"}, rows

    ok = rows["01_tiny_ok"]
    assert ok["status"] == ok["shown_status"] == "ok"
    assert float(ok["seconds"]) > 0
    assert ok["href"] == "01_tiny_ok.html"
    page = (folder / ok["href"]).read_text(encoding="utf-8")
    assert "gallery-ok n=2" in page  # the executed output is in the rendered page
    assert "ddp-lab-status-banner" not in page

    bad = rows["02_tiny_fail"]
    assert bad["status"] == bad["shown_status"] == "FAILED"
    assert float(bad["seconds"]) > 0
    assert "cell 3" in bad["error"] and "n is not 3 (gallery test)" in bad["error"], bad["error"]
    assert bad["href"] == "02_tiny_fail.html"
    page = (folder / bad["href"]).read_text(encoding="utf-8")
    assert "ddp-lab-status-banner" in page and "FAILED" in page
    assert "AssertionError" in page  # the failing cell's traceback is rendered
    assert "never reached" in page  # the cell after it is shown (not executed)

    # the runner's table still agrees with the index
    assert re.search(r"^\s*01_tiny_ok\s+ok\s+" + re.escape(ok["seconds"]) + r"\s*$", proc.stdout, re.M)


@pytest.mark.slow(10)
@pytest.mark.timeout(300)
def test_gallery_off_by_default_for_smoke_and_on_for_full(tmp_path: Path):
    nbdir = tmp_path / "notebooks"
    make_notebook(nbdir / "01_tiny_ok.ipynb", OK_CELLS)
    out = tmp_path / "build"
    base = ["--notebooks-dir", str(nbdir), "--output-dir", str(out)]
    # in this process (the CLI from a foreign cwd is the test above): each CLI start would
    # import papermill, nbformat and pandas again, about 5 CPU-seconds
    assert rn.main(base) == rn.EXIT_OK  # smoke: no gallery unless asked
    assert (out / "smoke" / "01_tiny_ok.ipynb").is_file()
    assert not (out / "smoke" / "index.html").exists()
    assert not (out / "smoke" / "01_tiny_ok.html").exists()

    assert rn.main([*base, "--profile", "full"]) == rn.EXIT_OK  # the main job's command: gallery on
    rows = index_rows(out / "full" / "index.html")
    assert rows["01_tiny_ok"]["status"] == "ok" and rows["01_tiny_ok"]["href"] == "01_tiny_ok.html"
    assert (out / "full" / "01_tiny_ok.html").is_file()

    assert rn.main([*base, "--profile", "full", "--no-gallery", "--output-dir", str(tmp_path / "b2")]) == rn.EXIT_OK
    assert not (tmp_path / "b2" / "full" / "index.html").exists()


def test_write_gallery_rows_without_notebooks(tmp_path: Path):
    """Skipped rows, a missing output and an unreadable notebook are listed, not fatal."""
    broken = tmp_path / "03_broken.ipynb"
    broken.write_text("{ not json")
    rows = [
        {"notebook": "01_gone", "status": "FAILED", "seconds": 1.25, "output": str(tmp_path / "nope.ipynb"),
         "error": "01_gone: the kernel died <&>"},
        {"notebook": "02_skip", "status": "skipped", "seconds": 0.0, "output": None, "error": None},
        {"notebook": "03_broken", "status": "ok", "seconds": 2.0, "output": str(broken), "error": None},
    ]
    index = gallery.write_gallery(rows, tmp_path, profile="smoke")
    parsed = index_rows(index)
    assert [parsed[n]["status"] for n in ("01_gone", "02_skip", "03_broken")] == ["FAILED", "skipped", "ok"]
    assert parsed["01_gone"]["seconds"] == "1.2" or parsed["01_gone"]["seconds"] == "1.3"
    assert parsed["01_gone"]["href"] is None
    assert "the kernel died <&>" in parsed["01_gone"]["error"]  # escaped in HTML, intact when read
    assert "no executed notebook was written" in parsed["01_gone"]["error"]
    assert parsed["02_skip"]["href"] is None and parsed["02_skip"]["error"] == ""
    assert parsed["03_broken"]["href"] is None and "could not render" in parsed["03_broken"]["error"]
    assert "0 of 3" not in index.read_text() and "1 of 3 notebook(s) ok" in index.read_text()
