"""Long expected output of a lesson cell (warnings, a crash's fault-handler stack) as one line,
with the full text one click away.

A launch relays its workers' stdout and stderr to the kernel's ``sys.stdout`` / ``sys.stderr``
with a ``[rank r]`` prefix; an expected warning or crash dump would fill the cell (stderr shows
as pink boxes in JupyterLab). Lessons capture it, assert on it, and show it folded::

    from helpers.captured import captured_output, show_folded

    with captured_output() as out:
        result = launch(worker, world_size)
    assert "FutureWarning" in out.getvalue()
    show_folded("the launch warned once per rank: `broadcast_buffers` is deprecated", out.getvalue())
"""

from __future__ import annotations

import contextlib
import html
import io
from collections.abc import Iterator

__all__ = ["captured_output", "folded_html", "show_folded"]


@contextlib.contextmanager
def captured_output() -> Iterator[io.StringIO]:
    """Collect everything written to ``sys.stdout`` and ``sys.stderr`` inside the block (the
    relayed output of a launch's workers included) in one ``io.StringIO``, in order."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield buffer


def folded_html(summary: str, text: str) -> str:
    """``<details>`` HTML: ``summary`` (and the line count) as the one visible line, ``text``
    (escaped, preformatted) inside."""
    lines = len(text.splitlines())
    return (f"<details><summary>{html.escape(summary)} ({lines} lines of output: click to open)</summary>"
            f"<pre>{html.escape(text)}</pre></details>")


def show_folded(summary: str, text: str) -> None:
    """Display ``summary`` as one line with ``text`` folded under it (HTML ``<details>``); where
    no HTML is shown (plain-text viewers) the line and the line count alone."""
    from IPython.display import display

    plain = f"{summary} ({len(text.splitlines())} lines of output, folded)"
    display({"text/html": folded_html(summary, text), "text/plain": plain}, raw=True)
