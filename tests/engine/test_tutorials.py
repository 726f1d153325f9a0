"""Code from tutorials runs on CPU from a notebook in ``notebooks/`` with the edits docs/OWN_CODE.md's
"Code from tutorials" table lists, and nothing more.

The sources are programs written here in the shapes of the published code, as a learner would
paste them (``tests/fixtures/written/``: the DDP tutorial's Basic Use Case and its ``elastic_ddp.py``,
dist_tuto's template and All-Reduce example, the ddp-tutorial-series' ``datautils.py`` and
``multigpu.py``, three programs in the seeds' shapes; its README.md names each published source).
``tests/engine/tutorial_edits.py`` lists each source's edits; a test applies exactly those (each
``old`` occurs once) and runs the files, one cell each, in a real Jupyter kernel started in
``notebooks/``, as JupyterLab starts a notebook's kernel: relative paths such as ``./data`` resolve
as they do for a learner. The only other edit is test plumbing: a fixed ``MASTER_PORT`` is replaced
with a free one, so that two test runs at once on one machine do not collide. Real kernel, real
processes, real gloo, 2 ranks. One kernel serves the module (each test starts from ``%reset``),
since each kernel costs seconds.

docs/OWN_CODE.md's table is written from the same lists by ``ci/changes_table.py``; a test checks
the doc holds what it writes.
"""

import re
import uuid

import pytest
import tutorial_edits as edits

from _support import REPO_ROOT, Kernel, wait_until_gone
from helpers.engine import free_port

# slow: a real kernel and real processes in every test but the last two
# one worker for the module (its kernel fixture) and for test_mp's fixed-port run: the tutorials' MASTER_PORT
# 12355, bound by two workers at once, gave EADDRINUSE or a gloo "Connection closed by peer"
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow, pytest.mark.xdist_group("tutorial-port-12355")]

NOTEBOOKS = REPO_ROOT / "notebooks"

#: a fresh namespace between tests; %reset also drops ``__main__.__spec__``, which a fresh kernel has
#: (None) and multiprocessing's forkserver reads (helpers.engine's fork server): put it back
RESET = "%reset -f\n__spec__ = None\n"


@pytest.fixture(scope="module")
def kernel():
    """One kernel for the module, started in ``notebooks/``; every process it started is gone at the end."""
    mark = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        # ipykernel forwards what child processes write to the kernel's stderr into the cell, as in
        # JupyterLab, except where it finds PYTEST_CURRENT_TEST (ipykernel/iostream.py, OutStream)
        mp.delenv("PYTEST_CURRENT_TEST", raising=False)
        k = Kernel(mark, cwd=NOTEBOOKS)
    try:
        yield k
    finally:
        k.close()
    left = wait_until_gone(mark, cmd_contains="")
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


def _run(kernel, source, changes=None):
    """Run ``source``'s cells (``changes`` applied, default the listed ones) in ``kernel``, after
    ``%reset``; stop at the first cell that fails. Returns (the last reply, all output text)."""
    cells = source.edited(changes)
    if source.port is not None:  # plumbing, not an edit
        hits = [i for i, c in enumerate(cells) if source.port in c]
        assert len(hits) == 1 and cells[hits[0]].count(source.port) == 1, (source.key, source.port)
        cells[hits[0]] = cells[hits[0]].replace(source.port, str(free_port()))
    reply, _ = kernel.cell(RESET + "import os\nfor _k in ('MASTER_ADDR', 'MASTER_PORT'): os.environ.pop(_k, None)\n"
                           "assert os.getcwd() == " + repr(str(NOTEBOOKS)))
    assert reply["status"] == "ok", reply
    out = []
    for cell in cells:
        reply, text = kernel.cell(cell, timeout=300)
        out.append(text)
        if reply["status"] != "ok":
            break
    return reply, "".join(out)


# ---- written in the shapes of published tutorials -----------------------------------------------------

LISTED_EDITS = {  # a source, run with its listed edits: what each rank ({r}) prints (regular expressions)
    "ddp-tutorial": (edits.DDP_TUTORIAL, [r"\[rank {r}\] Running basic DDP example on rank {r}\.",
                                          r"\[rank {r}\] Finished running basic DDP example on rank {r}\."]),
    "elastic-ddp-through-launch": (edits.ELASTIC, [r"\[rank {r}\] Start running basic DDP example on rank {r}\.",
                                                   r"\[rank {r}\] Finished running basic DDP example on rank {r}\."]),
    "seed-000-toy": (edits.SEED_000, [r"\[rank {r}\] rank {r}: loss [\d.]+ -> [\d.]+"]),
    "seed-004-dp-against-ddp": (edits.SEED_004, [r"DP and DDP agree on all 4 tensors after one step"]),
}


@pytest.mark.parametrize("source,printed", LISTED_EDITS.values(), ids=LISTED_EDITS.keys())
def test_runs_on_cpu_with_the_listed_edits(kernel, source, printed):
    reply, out = _run(kernel, source)
    assert reply["status"] == "ok", out
    assert all(re.search(line.format(r=rank), out) for line in printed for rank in range(2)), out


def test_dist_tuto_template_and_all_reduce_run_with_the_listed_edits(kernel):
    source = edits.DIST_TUTO
    (again, _), = source.then
    assert again in source.texts()[0]  # the added cell is the template's own loop, unchanged
    reply, out = _run(kernel, source)
    assert reply["status"] == "ok", out
    for rank in range(2):
        assert out.count(f"[rank {rank}] Rank  {rank}  has data  tensor(2.)") == 1, out


def test_ddp_tutorial_series_multigpu_runs_on_cpu_with_the_listed_edits(kernel):
    checkpoint = NOTEBOOKS / "checkpoint.pt"  # the program's relative PATH, from the ranks' working folder
    before = checkpoint.stat().st_mtime_ns if checkpoint.exists() else None
    try:
        reply, out = _run(kernel, edits.MULTIGPU)
        assert reply["status"] == "ok", out
        for rank in range(2):
            for epoch in range(2):
                assert f"[rank {rank}] [GPU{rank}] Epoch {epoch} | Batchsize: 32 | Steps: 32" in out, out
        for epoch in range(2):
            assert f"[rank 0] Epoch {epoch} | Training checkpoint saved at checkpoint.pt" in out, out
        assert checkpoint.is_file() and checkpoint.stat().st_mtime_ns != before
    finally:
        if before is None:
            checkpoint.unlink(missing_ok=True)


def test_elastic_ddp_that_keeps_init_process_group_fails_under_launch(kernel):
    source = edits.ELASTIC
    kept = source.changes[:1] + source.changes[2:]
    assert len(kept) == len(source.changes) - 1 and 'init_process_group("nccl")' in source.changes[1][0]
    reply, out = _run(kernel, source, changes=kept)
    assert reply["status"] == "error" and reply["ename"] == "WorkerError", out
    assert "WorkerError: rank " in out and f"failed with ValueError: {edits.TWICE}" in out, out


# ---- written in the seeds' shapes --------------------------------------------------------------------

def test_seed_002_mnist_reads_the_repositorys_data_from_notebooks(kernel):
    from helpers.data import ensure_mnist

    ensure_mnist()  # the decompressed files, where torchvision's MNIST("../data", download=True) finds them
    reply, out = _run(kernel, edits.SEED_002)
    assert reply["status"] == "ok", out
    for rank in range(2):
        for epoch in range(2):
            assert re.search(rf"\[rank {rank}\] rank {rank} epoch {epoch} mean loss [\d.]+", out), out
    assert not (NOTEBOOKS / "data").exists()  # nothing downloaded next to the notebooks


# ---- what plain torch.multiprocessing.spawn gives in a notebook cell ------------------------------

def test_plain_torch_spawn_in_a_notebook_cell_cannot_find_the_cells_function(kernel):
    """The error everybody meets first: spawn starts fresh interpreters that re-import
    ``__main__`` to find ``demo_basic``; a notebook's ``__main__`` is no file, so it is not there."""
    kernel.cell(RESET)
    kernel.cell("import torch.multiprocessing as mp\n"
                "def demo_basic(rank, world_size):\n"
                "    print('never printed')\n")
    reply, out = kernel.cell("mp.spawn(demo_basic, args=(2,), nprocs=2, join=True)", timeout=120)
    _, late = kernel.cell("import time; time.sleep(1)")  # the children's lines may come after the reply
    assert reply["status"] == "error", out
    assert reply["ename"] == "ProcessExitedException", reply
    assert re.fullmatch(r"process \d terminated with exit code 1", reply["evalue"]), reply
    assert "AttributeError: Can't get attribute 'demo_basic' on <module '__main__'" in out + late, out + late


def test_plain_torch_spawn_in_a_lesson_kernel_says_to_use_helpers_mp(kernel):
    """The same crash in a kernel that has imported the engine, as every lesson's does: under the
    ProcessExitedException, a line says why and to write ``import helpers.mp as mp``; the same call
    with that import then runs."""
    kernel.cell(RESET)
    kernel.cell("from helpers.engine import launch\n"
                "import torch.multiprocessing as mp\n"
                "def demo_basic(rank, world_size):\n"
                "    return rank\n")
    reply, out = kernel.cell("mp.spawn(demo_basic, args=(2,), nprocs=2, join=True)", timeout=120)
    kernel.cell("import time; time.sleep(1)")  # the children's lines may come after the reply
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", "\n".join(reply.get("traceback", [])))
    assert reply["status"] == "error" and reply["ename"] == "ProcessExitedException", reply
    hint = text.splitlines()[-1]
    assert hint.startswith("What to do:") and "demo_basic" in hint and "__main__" in hint, text
    assert "`import helpers.mp as mp` instead of `import torch.multiprocessing as mp`" in hint, text
    assert "What to do:" in out, "shown in the cell too"
    _, after = kernel.cell("import helpers.mp as mp\nprint(mp.spawn(demo_basic, args=(2,), nprocs=2, join=True))",
                           timeout=120)
    assert "[0, 1]" in after, after


# ---- docs/OWN_CODE.md's table is these edit lists ------------------------------------------------------

def test_docs_table_is_written_from_these_edit_lists():
    """docs/OWN_CODE.md (linked from the README) holds the table python3 -m ci.generate writes from
    tutorial_edits.py: the edits these tests make, no more, no fewer."""
    from ci import changes_table, marked

    doc = (REPO_ROOT / "docs" / "OWN_CODE.md").read_text(encoding="utf-8")
    wanted = marked.render(doc, changes_table.table(edits.SOURCES), changes_table.START, changes_table.END)
    assert doc == wanted, "docs/OWN_CODE.md's table is out of date: run python3 -m ci.generate"
    section = doc[doc.index("\n## Code from tutorials\n"):]
    assert changes_table.START in section.split("\n## ", 2)[1]  # the table is in that section
    flat = " ".join(section.split())
    assert "`ProcessExitedException: process 1 terminated with exit code 1`" in flat
    assert "`AttributeError: Can't get attribute 'demo_basic' on <module '__main__' (built-in)>`" in flat


def test_changes_table_check_finds_a_hand_edit_and_writing_fixes_it(tmp_path, capsys):
    """The table edited by hand is out of date until rewritten; a lost marker is an error."""
    from ci import changes_table, marked

    doc = tmp_path / "OWN_CODE.md"
    good = (REPO_ROOT / "docs" / "OWN_CODE.md").read_text(encoding="utf-8")
    doc.write_text(good.replace("`DDP(model)` for `DDP(model, device_ids=[rank])`; ", ""), encoding="utf-8")
    ((path, current, wanted, what),) = changes_table.outputs(doc)
    assert marked.check_or_write(path, current, wanted, True, what) == 1
    assert "out of date" in capsys.readouterr().err
    assert marked.check_or_write(path, current, wanted, False, what) == 0
    assert doc.read_text(encoding="utf-8") == good
    doc.write_text(good.replace(changes_table.START, ""), encoding="utf-8")
    with pytest.raises(ValueError, match="changes:start"):
        changes_table.outputs(doc)
