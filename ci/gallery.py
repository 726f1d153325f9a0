#!/usr/bin/env python3
"""Render executed notebooks to HTML and write an ``index.html`` gallery listing them.

The runner (``ci/run_notebooks.py``) calls :func:`write_gallery` with its rows after the
notebooks ran (by default for the ``full`` profile; ``--gallery`` / ``--no-gallery``)::

    build/<profile>/
        index.html                      one row per notebook: link, status, seconds, error
        01_gradients_dp_vs_ddp.ipynb    executed by papermill (outputs included)
        01_gradients_dp_vs_ddp.html     the same, rendered by nbconvert's HTMLExporter

A notebook that FAILED or hit a TIMEOUT is rendered too (papermill saved it up to the failing
cell, with the traceback), with a red banner naming the error at the top of its page. A row
without an executed notebook (``skipped`` after ``--fail-fast``, or the file is missing) is
listed without a link. A notebook that cannot be rendered is listed with the rendering error;
the gallery itself never raises for one bad notebook.

Standalone, on notebooks a previous run left in a folder (statuses are not known then)::

    python3 ci/gallery.py build/full
"""

from __future__ import annotations

import argparse
import datetime
import html
import os
import sys
from pathlib import Path
from typing import Any, Iterable

import nbformat
from nbconvert import HTMLExporter

__all__ = ["write_gallery", "render_notebook"]

INDEX_NAME = "index.html"

_STATUS_CLASS = {"ok": "ok", "FAILED": "failed", "TIMEOUT": "failed", "skipped": "skipped",
                 "?": "skipped"}
#: Statuses whose page gets no red banner ("?": status unknown, standalone use).
_NO_BANNER = ("ok", "skipped", "?")

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 70em; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid #ddd; padding: 0.45em 0.7em; text-align: left;
         vertical-align: top; }
th { background: #f4f4f4; }
td.seconds { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.status { font-weight: bold; white-space: nowrap; }
.ok { color: #1a7f37; }
.failed { color: #cf222e; }
.skipped { color: #777; }
.error { font-family: ui-monospace, monospace; font-size: 0.85em; white-space: pre-wrap;
         color: #cf222e; }
.summary { color: #555; }
"""


def _rel_link(target: Path, base: Path) -> str:
    return Path(os.path.relpath(target, base)).as_posix()


def _banner(status: str, error: str | None) -> str:
    text = html.escape(error or "see the failing cell below")
    return (
        '<div id="ddp-lab-status-banner" style="background:#ffebe9;border:2px solid #cf222e;'
        "color:#82071e;padding:0.8em 1em;margin:0.5em;font-family:system-ui,sans-serif;"
        'white-space:pre-wrap"><strong>' + html.escape(status) + "</strong>: " + text
        + "<br>The traceback is in the output of the failing cell (papermill marks it in red)."
        "</div>"
    )


def render_notebook(ipynb: str | os.PathLike, html_path: str | os.PathLike,
                    banner_status: str | None = None, banner_error: str | None = None) -> Path:
    """Render ``ipynb`` to ``html_path`` with nbconvert's ``HTMLExporter`` (images embedded).

    With ``banner_status`` (e.g. ``"FAILED"``), a red banner with it and ``banner_error`` is
    inserted at the top of the page. Returns the HTML path.
    """
    nb = nbformat.read(str(ipynb), as_version=4)
    body, _ = HTMLExporter().from_notebook_node(
        nb, resources={"metadata": {"name": Path(ipynb).stem}}
    )
    if banner_status:
        i = body.find("<body")
        j = body.find(">", i) if i >= 0 else -1
        banner = _banner(banner_status, banner_error)
        body = body[: j + 1] + banner + body[j + 1:] if j >= 0 else banner + body
    out = Path(html_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(out)
    return out


def _fmt_seconds(value: Any) -> str:
    try:
        return f"{float(value):.1f}"
    except (TypeError, ValueError):
        return "-"


def write_gallery(
    rows: Iterable[dict],
    output_dir: str | os.PathLike,
    *,
    title: str | None = None,
    profile: str | None = None,
) -> Path:
    """Render every executed notebook of ``rows`` to HTML and write ``output_dir/index.html``.

    ``rows`` are the runner's rows (:func:`ci.run_notebooks.run_notebooks`): ``notebook``,
    ``status``, ``seconds``, ``output`` (path of the executed ``.ipynb`` or None) and
    ``error``. Each HTML page goes next to its executed notebook (same stem, ``.html``); pages
    of notebooks that did not pass carry a banner with the status and the error. Returns the
    path of ``index.html``.
    """
    out_dir = Path(output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    lines: list[str] = []
    n_ok = 0
    total = 0.0
    for row in rows:
        name = str(row.get("notebook", "?"))
        status = str(row.get("status", "?"))
        error = row.get("error")
        seconds = row.get("seconds")
        try:
            total += float(seconds or 0)
        except (TypeError, ValueError):
            pass
        n_ok += status == "ok"
        link = None
        note = ""
        ipynb = Path(row["output"]) if row.get("output") else None
        if ipynb is not None and ipynb.is_file():
            html_path = ipynb.with_suffix(".html")
            try:
                render_notebook(ipynb, html_path,
                                banner_status=None if status in _NO_BANNER else status,
                                banner_error=error)
                link = _rel_link(html_path, out_dir)
            except Exception as e:  # noqa: BLE001 - one bad notebook must not sink the gallery
                note = f"could not render {ipynb.name}: {type(e).__name__}: {e}"
        elif status != "skipped":
            note = "no executed notebook was written"
        cls = _STATUS_CLASS.get(status, "failed")
        name_cell = (f'<a href="{html.escape(link, quote=True)}">{html.escape(name)}</a>'
                     if link else html.escape(name))
        if ipynb is not None and ipynb.is_file():
            name_cell += (f' <small>(<a href="{html.escape(_rel_link(ipynb, out_dir), quote=True)}">'
                          f"ipynb</a>)</small>")
        details = "\n".join(t for t in (error or "", note) if t)
        lines.append(
            f'<tr class="{cls}" data-notebook="{html.escape(name, quote=True)}" '
            f'data-status="{html.escape(status, quote=True)}">'
            f"<td>{name_cell}</td>"
            f'<td class="status {cls}">{html.escape(status)}</td>'
            f'<td class="seconds">{_fmt_seconds(seconds)}</td>'
            f'<td class="error">{html.escape(details)}</td></tr>'
        )
    heading = title or (f"ddp-lab notebooks, profile {profile}" if profile else "ddp-lab notebooks")
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    summary = f"{n_ok} of {len(rows)} notebook(s) ok; {total:.1f} s in all; generated {when}"
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(heading)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{html.escape(heading)}</h1>\n<p class=\"summary\">{summary}</p>\n"
        "<table>\n<thead><tr><th>notebook</th><th>status</th><th>seconds</th>"
        "<th>error</th></tr></thead>\n<tbody>\n" + "\n".join(lines) + "\n</tbody>\n</table>\n"
        "</body>\n</html>\n"
    )
    index = out_dir / INDEX_NAME
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(index)
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the executed notebooks in FOLDER to "
                                     "HTML and write FOLDER/index.html (statuses unknown).")
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    notebooks = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))  # not partial files
    if not notebooks:
        print(f"error: no executed notebooks (*.ipynb) in {folder}", file=sys.stderr)
        return 2
    rows = [{"notebook": p.stem, "status": "?", "seconds": None, "output": str(p), "error": None}
            for p in notebooks]
    print(f"gallery: {write_gallery(rows, folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
