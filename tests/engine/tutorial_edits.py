"""The sources docs/OWN_CODE.md's "Code from tutorials" table lists, and exactly the edits each one
needs to run on CPU (gloo, 2 ranks) from a notebook in ``notebooks/``.

``tests/engine/test_tutorials.py`` applies these edits to the sources and runs each in a real
Jupyter kernel started in ``notebooks/``; ``ci/changes_table.py`` writes the doc's table from them,
so the table is what the tests ran. A plain module (no pytest): the generator loads it by path.

The sources are programs written here in the shapes of the published code (the DDP tutorial, its
``elastic_ddp.py``, dist_tuto, the ddp-tutorial-series' ``datautils.py`` and ``multigpu.py``) and of
the project's seed scripts, as a learner would paste them: files under ``tests/fixtures/written/``
(its README.md names each published source). No verbatim copy of published code is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "written"

#: the first edit of every source that starts processes with ``torch.multiprocessing``
IMPORT = ("import torch.multiprocessing as mp", "import helpers.mp as mp")

#: torch's own text, when a torchrun script under ``launch`` keeps its ``init_process_group``
TWICE = "trying to initialize the default process group twice!"


@dataclass(frozen=True)
class Source:
    """One row of the table: files pasted as notebook cells, in order, and the edits they need.

    Attributes:
        key: short name (the test's id).
        label: the table's first cell (Markdown).
        cells: fixture files (relative to ``tests/fixtures/written/``), one notebook cell each, in order.
        changes: ``(old, new)`` edits; each ``old`` occurs exactly once in all the cells together.
        then: cells the learner adds after those, ``(code, how the table says it)``; ``None``
            for the second: the code itself, in backticks.
        port: test plumbing, not an edit: this fixed ``MASTER_PORT`` is replaced with a free one,
            so that two test runs at once do not collide (a learner's one run needs no change).
        note: what the table adds after the edits (Markdown).
    """

    key: str
    label: str
    cells: tuple[str, ...]
    changes: tuple[tuple[str, str], ...]
    then: tuple[tuple[str, str | None], ...] = ()
    port: str | None = None
    note: str = ""

    def texts(self) -> list[str]:
        """The cells' code, verbatim from the fixture files."""
        return [(FIXTURES / cell).read_text(encoding="utf-8") for cell in self.cells]

    def edited(self, changes=None) -> list[str]:
        """The cells with ``changes`` (default: the listed ones) applied, then the added cells.

        Raises:
            AssertionError: an ``old`` does not occur exactly once in all the cells together.
        """
        texts = self.texts()
        for old, new in self.changes if changes is None else changes:
            counts = [t.count(old) for t in texts]
            assert sum(counts) == 1, f"{self.key}: {old!r} occurs {sum(counts)} times"
            i = counts.index(1)
            texts[i] = texts[i].replace(old, new)
        return texts + [code for code, _ in self.then]


# ---- written here in the shapes of published code (tests/fixtures/written/README.md) ----------

DDP_URL = "https://pytorch.org/tutorials/intermediate/ddp_tutorial.html"

DDP_TUTORIAL = Source(
    key="ddp_tutorial",
    label=f"[DDP tutorial]({DDP_URL})-shaped code: its Basic Use Case, two cells",
    cells=("ddp_tutorial_basic_1.py", "ddp_tutorial_basic_2.py"),
    changes=(
        IMPORT,
        ("backend = torch.distributed.get_default_backend_for_device(acc)", 'backend = "gloo"'),
        ("model = ToyModel().to(rank)", "model = ToyModel()"),
        ("DDP(model, device_ids=[rank])", "DDP(model)"),
        ("labels = torch.randn(20, 5).to(rank)", "labels = torch.randn(20, 5)"),
    ),
    then=(("run_demo(demo_basic, 2)", None),),
    port="12355",
    note="on a CUDA build the backend line gives nccl, with no GPU too",
)

ELASTIC = Source(
    key="elastic_ddp",
    label=f"[DDP tutorial]({DDP_URL})-shaped code: its torchrun section's `elastic_ddp.py`, run with "
          "`helpers.engine.launch` instead of `torchrun`",
    cells=("ddp_tutorial_elastic.py",),
    changes=(
        ("    demo_basic()\n",
         "    from helpers.engine import launch\n    launch(lambda rank, world_size: demo_basic(), 2)\n"),
        ('    dist.init_process_group("nccl")\n', ""),
        ("device_id = rank % torch.cuda.device_count()", 'device_id = "cpu"'),
        ("DDP(model, device_ids=[device_id])", "DDP(model)"),
    ),
    note=f"`launch` made the group, gloo on CPU; with the script's `init_process_group(...)` kept, every "
         f"rank raises `ValueError: {TWICE}`",
)

#: dist_tuto's template ends with this process loop; the learner runs it again after the example
DIST_TUTO_LOOP = (
    'if __name__ == "__main__":\n'
    "    world_size = 2\n"
    "    processes = []\n"
    '    mp.set_start_method("spawn")\n'
    "    for rank in range(world_size):\n"
    "        p = mp.Process(target=init_process, args=(rank, world_size, run))\n"
    "        p.start()\n"
    "        processes.append(p)\n"
    "\n"
    "    for p in processes:\n"
    "        p.join()\n"
)

DIST_TUTO = Source(
    key="dist_tuto",
    label="[dist_tuto](https://pytorch.org/tutorials/intermediate/dist_tuto.html)-shaped code: the "
          "`run.py` template (its `mp.Process` loop) and the All-Reduce example, two cells",
    cells=("dist_tuto_template.py", "dist_tuto_all_reduce.py"),
    changes=(IMPORT,),
    then=((DIST_TUTO_LOOP,
           "the template's `if __name__ == \"__main__\":` part again, in a cell after the All-Reduce "
           "example's `run` (the template's own cell runs its placeholder `run`)"),),
    port="29500",
)

MULTIGPU = Source(
    key="multigpu",
    label="[ddp-tutorial-series](https://github.com/pytorch/examples/tree/main/distributed/ddp-tutorial-series)"
          "-shaped code: `datautils.py`, then `multigpu.py`, two cells",
    cells=("datautils.py", "multigpu.py"),
    changes=(
        IMPORT,
        ("from datautils import MyTrainDataset\n", ""),
        ("    torch.cuda.set_device(rank)\n", ""),
        ('init_process_group(backend="nccl"', 'init_process_group(backend="gloo"'),
        ("self.model = model.to(gpu_id)", "self.model = model"),
        ("DDP(model, device_ids=[gpu_id])", "DDP(model)"),
        ("            source = source.to(self.gpu_id)\n            targets = targets.to(self.gpu_id)\n", ""),
        ("args = parser.parse_args()", 'args = parser.parse_args(["2", "1"])'),
        ("world_size = torch.cuda.device_count()", "world_size = 2"),
    ),
    port="12355",
    note="`MyTrainDataset` comes from the `datautils.py` cell, there is no `datautils` module to import; "
         "`parse_args()` in a kernel parses the kernel's own command line; `pin_memory=True` only warns; "
         "`checkpoint.pt` lands in `notebooks/`",
)

SEED_000 = Source(
    key="seed_000",
    label="written in the seeds' shapes: a DDP toy",
    cells=("seed_000_toy.py",),
    changes=(IMPORT,),
    port="29500",
)

SEED_002 = Source(
    key="seed_002",
    label="written in the seeds' shapes: MNIST, `MASTER_ADDR`/`MASTER_PORT` set before `mp.spawn`",
    cells=("seed_002_mnist.py",),
    changes=(IMPORT, ('datasets.MNIST("./data"', 'datasets.MNIST("../data"')),
    port="12355",
    note="`../data` is the repository's `data/` from `notebooks/`, where `helpers.data.ensure_mnist()` "
         "decompressed the files, so nothing is downloaded",
)

SEED_004 = Source(
    key="seed_004",
    label="written in the seeds' shapes: DP against DDP",
    cells=("seed_004_dp_vs_ddp.py",),
    changes=(IMPORT,),
    port="29501",
)

#: the table's rows, in order
SOURCES = (DDP_TUTORIAL, ELASTIC, DIST_TUTO, MULTIGPU, SEED_000, SEED_002, SEED_004)
