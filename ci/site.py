#!/usr/bin/env python3
"""The course site: Sphinx + myst-nb + sphinx-book-theme over the main job's executed notebooks.

Built from what ``python3 ci/run_notebooks.py --profile full`` wrote; nothing is executed again::

    python3 -m ci.site build/full              # -> build/site/index.html
    python3 -m ci.site --check build/site      # headless Chromium follows every internal link

The staged source (``build/site_src/``) is laid out as the repository is, so the links the
notebooks and docs use resolve unchanged. ``README.md`` is the front page (``index.md``), with
the navigation appended: the lessons in the manifest's order, then every ``docs/*.md`` page.
Each executed notebook is rendered from its stored outputs; cells tagged ``check`` or
``solution`` get myst-nb's ``hide-input`` (code behind a toggle, output shown), and a notebook
that failed or was cut short gets a red "this lesson failed" box under its title. The download
button gives the executed notebook less papermill's ``injected-parameters`` cell, so running it
runs the lesson's own defaults.

Settings: ``ci/site_conf.py``. Exit codes: 0 built / every link and figure found; 1 the build
failed or the check found problems (each printed on its own line); 2 bad invocation.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import shutil
import sys
import threading
import urllib.parse
from pathlib import Path

import nbformat

from helpers import lessons as manifest

ROOT = Path(__file__).resolve().parent.parent
CONF = Path(__file__).resolve().parent / "site_conf.py"
#: docs pages listed first in the navigation, for learners and instructors; the rest follow
LEARNER_DOCS = ("GLOSSARY", "CASEBOOK", "TEACHING", "CLUSTER", "GPU")
#: cell tags collapsed on the site: their code sits behind a toggle, their output stays shown
COLLAPSED_TAGS = ("check", "solution")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")
CHROMIUM_ENV = "DDP_LAB_CHROMIUM"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update"]

__all__ = ["build_site", "check_site", "lesson_failed", "count_figures", "main"]


class SiteError(RuntimeError):
    """The site could not be built (nothing to build, Sphinx failed)."""


def lesson_failed(nb) -> bool:
    """True when papermill flagged an exception or left a code cell not completed (a timeout)."""
    if nb.metadata.get("papermill", {}).get("exception"):
        return True
    statuses = [c.metadata.get("papermill", {}).get("status") for c in nb.cells if c.cell_type == "code"]
    return any(s not in (None, "completed") for s in statuses)


def count_figures(nb) -> int:
    """Image outputs (png, jpeg, gif, svg) in an executed notebook."""
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if o.get("output_type") in ("display_data", "execute_result")
               and any(t in o.get("data", {}) for t in IMAGE_TYPES))


_BANNER = """```{error}
**This lesson failed** in the run that built this site: its outputs stop at the failing cell,
which holds the traceback ("An Exception was encountered" links to it).
```"""


def _stage_notebook(src: Path, dest: Path) -> None:
    nb = nbformat.read(str(src), as_version=4)
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if any(t in tags for t in COLLAPSED_TAGS) and "hide-input" not in tags:
            cell.metadata["tags"] = [*tags, "hide-input"]
    if lesson_failed(nb):
        at = 1 if nb.cells and nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("#") else 0
        nb.cells.insert(at, nbformat.v4.new_markdown_cell(_BANNER))
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = _to_index(cell.source)
    nbformat.write(nb, str(dest))


_README_LINK = re.compile(r"\]\(((?:\.\./)*)README\.md(?=[#)])")


def _to_index(markdown: str) -> str:
    """Links to the README point at the front page, ``index.md`` on the site."""
    return _README_LINK.sub(lambda m: f"]({m.group(1)}index.md", markdown)


def _toctree(caption: str, entries: list[str]) -> str:
    return "\n```{toctree}\n:hidden:\n:caption: " + caption + "\n\n" + "\n".join(entries) + "\n```\n"


def stage(executed: Path, src: Path, root: Path = ROOT) -> list[str]:
    """Lay out the Sphinx source in ``src`` (emptied first); returns the lesson stems in order.

    The lessons are the executed notebooks of ``executed`` that the manifest lists, in its order.
    """
    order = manifest.stems(None, root / "notebooks" / manifest.MANIFEST.name)  # the course's order
    found = {p.stem: p for p in executed.glob("*.ipynb") if not p.name.startswith(".")}
    for stale in sorted(set(found) - set(order)):  # from an older run of a lesson since renamed or removed
        print(f"site: {stale}.ipynb left out: not in notebooks/lessons.toml (a notebook from an older run?)")
    lessons = [found[stem] for stem in order if stem in found]
    if not lessons:
        raise SiteError(f"no executed notebooks (*.ipynb) in {executed}: run "
                        "`python3 ci/run_notebooks.py --profile full` first")
    if src.exists():
        shutil.rmtree(src)
    (src / "notebooks").mkdir(parents=True)
    (src / "docs").mkdir()
    shutil.copyfile(CONF, src / "conf.py")
    for nb in lessons:
        _stage_notebook(nb, src / "notebooks" / nb.name)
    docs = sorted(p.stem for p in (root / "docs").glob("*.md"))
    for name in docs:
        text = (root / "docs" / f"{name}.md").read_text(encoding="utf-8")
        (src / "docs" / f"{name}.md").write_text(_to_index(text), encoding="utf-8")
    first = [d for d in LEARNER_DOCS if d in docs]
    readme = (root / "README.md").read_text(encoding="utf-8")
    readme += _toctree("Lessons", [f"notebooks/{p.stem}" for p in lessons])
    readme += _toctree("Glossary and teaching notes", [f"docs/{d}" for d in first])
    readme += _toctree("How the course is built", [f"docs/{d}" for d in docs if d not in first])
    (src / "index.md").write_text(readme, encoding="utf-8")
    return [p.stem for p in lessons]


def build_site(executed: str | os.PathLike, out: str | os.PathLike | None = None, root: Path = ROOT,
               quiet: bool = True) -> Path:
    """Build the site from the executed notebooks in ``executed``; returns ``out/index.html``.

    ``out`` defaults to ``site`` beside ``executed`` (``build/full`` -> ``build/site``); the staged
    source goes to ``site_src`` beside ``out``. Raises :class:`SiteError` when there is nothing to
    build or Sphinx fails.
    """
    from sphinx.cmd.build import build_main

    executed = Path(executed).resolve()
    out = Path(out).resolve() if out else executed.parent / "site"
    src = out.parent / f"{out.name}_src"
    lessons = stage(executed, src, root)
    if out.exists():
        shutil.rmtree(out)
    warnings = out.parent / f"{out.name}_warnings.txt"
    code = build_main(["-b", "html", "-E", "-w", str(warnings), *(["-q"] if quiet else []), str(src), str(out)])
    if code != 0:
        raise SiteError(f"sphinx-build exited {code}; its warnings: {warnings}")
    for stem in lessons:  # the download: outputs kept, the lesson's own parameters (no injected cell)
        nb = nbformat.read(str(executed / f"{stem}.ipynb"), as_version=4)
        nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
        nbformat.write(nb, str(out / "_sources" / "notebooks" / f"{stem}.ipynb"))
    return out / "index.html"


def find_chromium() -> str | None:
    """``$DDP_LAB_CHROMIUM``, else Debian's ``/usr/bin/chromium`` or one on PATH (the JupyterLab test uses it too)."""
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        return override if os.access(override, os.X_OK) else None
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request
        pass


_PAGE_FACTS = """() => ({
  ids: [...document.querySelectorAll('[id]')].map(e => e.id)
        .concat([...document.querySelectorAll('a[name]')].map(e => e.name)),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  images: [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
                                          output: !!i.closest('.cell_output')})),
  checks: [...document.querySelectorAll('.cell.tag_check')].map(c => {
    const d = c.querySelector('details'); const code = c.querySelector('.cell_input');
    return {collapsed: !!d && !d.open && !!code && d.contains(code) && !code.checkVisibility()};
  }),
})"""


def check_site(site: str | os.PathLike, search_for: str = "glossary", timeout_ms: int = 30000) -> dict:
    """Open ``site`` in headless Chromium over a local HTTP server and follow every internal link.

    Returns ``{"pages", "files", "links", "anchors", "figures": {page: (loaded, expected)},
    "checks_collapsed", "search_hits", "problems": [...]}``; ``problems`` lists each 404, missing
    anchor, image that did not load, lesson page with fewer loaded figures than its notebook has
    image outputs, check cell not collapsed, and a search that found nothing. Raises
    :class:`SiteError` when Chromium or Playwright is missing.
    """
    from playwright.sync_api import sync_playwright

    site = Path(site).resolve()
    if not (site / "index.html").is_file():
        raise SiteError(f"no index.html in {site}: build the site first (python3 -m ci.site build/full)")
    chromium = find_chromium()
    if chromium is None:
        raise SiteError(f"Chromium not found: `apt-get install -y chromium` (Debian), or set {CHROMIUM_ENV}")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    report = {"pages": 0, "files": 0, "links": 0, "anchors": 0, "figures": {}, "checks_collapsed": 0,
              "search_hits": 0, "problems": []}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.set_default_timeout(timeout_ms)
                # the site must stand alone: anything outside it (CDNs, pytorch.org) is refused at once
                page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
                facts = _crawl(page, base, report)
                _check_figures(site, base, facts, report)
                _check_search(page, base, search_for, report)
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
    return report


def _crawl(page, base: str, report: dict) -> dict:
    """Visit every page reachable from index.html, then check every ``#fragment`` linked to;
    returns ``{page url: facts}`` (ids, images)."""
    facts: dict[str, dict] = {}
    queue, seen = [(base + "index.html", "(start)")], {base + "index.html"}
    wanted = []  # (page, fragment, linked from)
    while queue:
        url, origin = queue.pop(0)
        path = urllib.parse.urlsplit(url).path
        if not (path.endswith(".html") or path.endswith("/")):
            status = page.request.get(url).status
            report["files"] += 1
            if status != 200:
                report["problems"].append(f"{status}: {url[len(base):]} (linked from {origin})")
            continue
        response = page.goto(url, wait_until="load")
        if response is None or response.status != 200:
            report["problems"].append(f"{response.status if response else 'no response'}: {url[len(base):]} "
                                      f"(linked from {origin})")
            continue
        report["pages"] += 1
        facts[url] = _page_facts(page)
        for img in facts[url]["images"]:
            if not img["ok"]:
                report["problems"].append(f"image not loaded: {img['src']} on {url[len(base):]}")
        for check in facts[url]["checks"]:
            if check["collapsed"]:
                report["checks_collapsed"] += 1
            else:
                report["problems"].append(f"a cell tagged check is not collapsed on {url[len(base):]}")
        for link in facts[url]["links"]:
            if not link.startswith(base):
                continue  # outside the site (or javascript:, mailto:)
            report["links"] += 1
            target, _, fragment = link.partition("#")
            target = target.split("?", 1)[0]
            if fragment:
                wanted.append((target, urllib.parse.unquote(fragment), url[len(base):]))
            if target not in seen:
                seen.add(target)
                queue.append((target, url[len(base):]))
    for target, fragment, origin in wanted:
        report["anchors"] += 1
        if target in facts and fragment not in facts[target]["ids"]:
            report["problems"].append(f"missing anchor: #{fragment} on {target.rsplit('/', 1)[-1]} "
                                      f"(linked from {origin})")
    return facts


def _page_facts(page, tries: int = 5) -> dict:
    """``_PAGE_FACTS`` on the page; retried once the page settles if it navigated meanwhile."""
    from playwright.sync_api import Error

    for _ in range(tries - 1):
        try:
            return page.evaluate(_PAGE_FACTS)
        except Error:  # "Execution context was destroyed": the page navigated away meanwhile
            page.wait_for_load_state("load")
            page.wait_for_timeout(200)
    return page.evaluate(_PAGE_FACTS)


def _check_figures(site: Path, base: str, facts: dict, report: dict) -> None:
    """Each lesson page shows, loaded, at least as many output images as its notebook holds."""
    for nb_path in sorted((site / "_sources" / "notebooks").glob("*.ipynb")):
        expected = count_figures(nbformat.read(str(nb_path), as_version=4))
        url = f"{base}notebooks/{nb_path.stem}.html"
        loaded = sum(1 for i in facts.get(url, {}).get("images", []) if i["ok"] and i["output"])
        report["figures"][nb_path.stem] = (loaded, expected)
        if url not in facts:
            report["problems"].append(f"lesson page not reachable from the index: notebooks/{nb_path.stem}.html")
        elif loaded < expected:
            report["problems"].append(f"notebooks/{nb_path.stem}.html shows {loaded} loaded figure(s), "
                                      f"its notebook has {expected}")


def _check_search(page, base: str, word: str, report: dict) -> None:
    page.goto(f"{base}search.html?q={urllib.parse.quote(word)}", wait_until="load")
    try:
        page.wait_for_selector("#search-results ul.search li", timeout=20000)
    except Exception:  # noqa: BLE001 - Playwright's TimeoutError: reported as a problem
        pass
    report["search_hits"] = page.locator("#search-results ul.search li").count()
    if not report["search_hits"]:
        report["problems"].append(f"search for {word!r} found nothing (search.html)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.site", description=(
        "Build the course site from executed notebooks (FOLDER: build/full -> build/site), or with "
        "--check open a built site (FOLDER: build/site) in headless Chromium and follow every internal link."))
    parser.add_argument("folder")
    parser.add_argument("-o", "--output", default=None, help="site folder (default: site beside FOLDER)")
    parser.add_argument("--check", action="store_true", help="check a built site instead of building one")
    args = parser.parse_args(argv)
    try:
        if not args.check:
            index = build_site(args.folder, args.output)
            print(f"site: {index}")
            return 0
        report = check_site(args.folder)
    except SiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    figures = report["figures"]
    print(f"site check: {report['pages']} pages, {report['files']} other files, {report['links']} internal links, "
          f"{report['anchors']} anchors, {sum(f[0] for f in figures.values())} of "
          f"{sum(f[1] for f in figures.values())} figures loaded on {len(figures)} lesson pages, "
          f"{report['checks_collapsed']} check cells collapsed, search {report['search_hits']} hit(s)")
    for problem in report["problems"]:
        print(f"  {problem}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
