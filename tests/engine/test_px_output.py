"""How a ``%%px`` cell's output reads in a real kernel: each rank's output in rank order (rank 0
first) whatever order it arrived in, also when the cell hangs and times out; the notice that
fresh warm ranks are starting on stdout, not stderr (a red box in JupyterLab).

A cell's output is rebuilt here as a notebook front end shows it: ipyparallel streams each rank's
output as a display it updates (``update_display_data``), so the final text is the last update.
"""

import uuid

import pytest

from _support import Kernel, wait_until_gone

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# rank 1 prints at once; rank 0 prints a second after rank 1 passed the barrier, so rank 1's
# line arrives first
RANK_1_FIRST = ("import sys, time\n"
                "if rank == 1:\n"
                "    print('line of rank', rank); sys.stdout.flush()\n"
                "dist.barrier()\n"
                "if rank == 0:\n"
                "    time.sleep(1.0); print('line of rank', rank); sys.stdout.flush()\n")


@pytest.fixture(scope="module")
def kernel():
    mark = uuid.uuid4().hex
    k = Kernel(mark)
    reply, text = k.cell("from helpers.engine import start_ranks\nranks = start_ranks(2, timeout=60)")
    assert reply["status"] == "ok", text
    yield k
    k.close()
    assert not wait_until_gone(mark)


def run(k, code):
    """Run a cell; return ``(reply content, outputs)`` with ``outputs`` as a front end holds them at
    the end: a list of ``[kind, text]`` (kind: ``"stdout"``, ``"stderr"``, ``"display"``), each
    display's text its last update, and the kinds in order of first arrival as ``first``."""
    outputs, by_id, first = [], {}, []

    def hook(msg):
        kind, c = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            if outputs and outputs[-1][0] == c["name"]:
                outputs[-1][1] += c["text"]  # a front end joins consecutive text of one stream
            else:
                outputs.append([c["name"], c["text"]])
        elif kind == "display_data":
            outputs.append(["display", c["data"].get("text/plain", "")])
            first.append(outputs[-1][1])
            by_id.setdefault(c.get("transient", {}).get("display_id"), []).append(outputs[-1])
        elif kind == "update_display_data":
            for out in by_id.get(c["transient"]["display_id"], []):
                out[1] = c["data"].get("text/plain", "")

    reply = k.kc.execute_interactive(code, timeout=300, output_hook=hook, allow_stdin=False)
    return reply["content"], outputs, first


def rank_lines(outputs):
    """The ``[stdout:r]`` labels in the order the cell shows them."""
    return [text.split("]")[0] + "]" for kind, text in outputs if kind == "display" and text.startswith("[stdout:")]


def test_px_output_in_rank_order(kernel):
    """Rank 1 prints a second before rank 0; the cell shows rank 0's output first."""
    reply, outputs, first = run(kernel, "%%px\n" + RANK_1_FIRST)
    assert reply["status"] == "ok", outputs
    assert [t.split("]")[0] for t in first] == ["[stdout:1", "[stdout:0"], f"rank 1 must arrive first: {first}"
    assert rank_lines(outputs) == ["[stdout:0]", "[stdout:1]"], outputs
    shown = "".join(text for _, text in outputs)
    assert "[stdout:0] line of rank 0" in shown and "[stdout:1] line of rank 1" in shown, shown
    assert shown.index("line of rank 0") < shown.index("line of rank 1"), shown


def test_px_hang_shows_output_so_far_in_rank_order(kernel):
    """A cell that prints (rank 1 first) and then hangs: RanksTimeout, and the output so far, in
    rank order."""
    reply, outputs, _ = run(kernel, "%%px --timeout 8\n" + RANK_1_FIRST + "time.sleep(120)\n")
    assert reply["status"] == "error" and reply["ename"] == "RanksTimeout", outputs
    assert rank_lines(outputs) == ["[stdout:0]", "[stdout:1]"], outputs


def test_fresh_ranks_notice_on_stdout(kernel):
    """After a fault the next cell starts fresh ranks and says so on stdout, not stderr."""
    reply, outputs, _ = run(kernel, "%%px\nimport os\nif rank == 1:\n    os._exit(0)\n")
    assert reply["status"] == "error" and reply["ename"] == "WorkerError", outputs
    reply, outputs, _ = run(kernel, "%%px\nprint('fresh', rank)")
    assert reply["status"] == "ok", outputs
    notice = [(kind, text) for kind, text in outputs if "starting fresh warm ranks" in text]
    assert [kind for kind, _ in notice] == ["stdout"], outputs
    assert not [text for kind, text in outputs if kind == "stderr"], outputs
    assert rank_lines(outputs) == ["[stdout:0]", "[stdout:1]"], outputs


def test_not_streamed_timeout_shows_output_so_far_in_rank_order(capsys):
    """``execute(stream=False)`` (no kernel, ``IPP_NONINTERACTIVE``) of a cell that prints and then
    hangs: RanksTimeout (ipyparallel's ``display_outputs`` refuses a result not ready: it raised its
    TimeoutError instead), and each rank's output so far, rank 0 first."""
    from helpers.engine import RanksTimeout, start_ranks

    ranks = start_ranks(2, timeout=60, activate=False)
    started = list(ranks.procs.processes())  # controller, engines, watchdog (this module's kernel is not ours)
    try:
        with pytest.raises(RanksTimeout):
            ranks.execute(RANK_1_FIRST + "time.sleep(120)\n", timeout=8, stream=False)
    finally:
        ranks.stop()
    assert started and not [p for p in started if p.is_running() and p.status() != "zombie"], started
    out = capsys.readouterr().out
    assert "[stdout:0] \nline of rank 0" in out and "[stdout:1] \nline of rank 1" in out, out
    assert out.index("[stdout:0]") < out.index("[stdout:1]"), out
