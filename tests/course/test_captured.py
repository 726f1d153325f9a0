"""helpers.captured: a lesson's long expected output (warnings, a crash dump) captured, shown as
one line, the full text folded under it (issue 29, part 4)."""

from __future__ import annotations

import sys

from helpers.captured import captured_output, folded_html


def test_captured_output_keeps_stdout_and_stderr_in_order(capsys):
    with captured_output() as out:
        print("[rank 0] first")
        sys.stderr.write("[rank 1] FutureWarning: <deprecated> & more\n")
        print("[rank 0] last")
    text = out.getvalue()
    assert text.startswith("[rank 0] first\n[rank 1] FutureWarning: <deprecated> & more\n"), text
    assert text.endswith("[rank 0] last\n"), text
    seen = capsys.readouterr()
    assert seen.out == "" and seen.err == "", "nothing reaches the cell's own output"


def test_folded_html_is_one_summary_line_and_the_escaped_text():
    html = folded_html("expected: 2 warnings <once per rank>", "line <1>\nline & 2\n")
    assert html.startswith("<details><summary>expected: 2 warnings &lt;once per rank&gt; (2 lines of output: "
                           "click to open)</summary>"), html
    assert "<pre>line &lt;1&gt;\nline &amp; 2\n</pre></details>" in html, html
    assert "<details>" not in html[len("<details>"):], "one fold, not nested"
