"""helpers.mp.spawn, the notebook-safe drop-in for torch.multiprocessing.spawn: the DDP tutorial's
code runs from notebook cells with docs/OWN_CODE.md's edits. Real processes, real gloo."""

import pytest
import tutorial_edits as edits

from _support import as_cell, repo_env, run_papermill, write_notebook
from helpers import mp
from helpers.engine import LaunchError, WorkerError

# slow: real processes in (nearly) every test
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(400), pytest.mark.slow]

# The DDP tutorial's Basic Use Case as a learner pastes it (its two cells, written here in its
# shape) with exactly docs/OWN_CODE.md's CPU edits (tests/engine/tutorial_edits.py): the import of
# mp, the gloo backend, no .to(rank), no device_ids.
TUTORIAL_CELLS = edits.DDP_TUTORIAL.edited()[:-1]  # less the `run_demo(demo_basic, 2)` cell it adds


@pytest.mark.matrix
@pytest.mark.xdist_group("tutorial-port-12355")  # with test_tutorials: one user of port 12355 at a time
def test_ddp_tutorial_runs_from_a_notebook_twice_on_its_fixed_port(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", repo_env()["PYTHONPATH"])
    write_notebook(tmp_path / "tutorial.ipynb", *TUTORIAL_CELLS, "run_demo(demo_basic, world_size)",
                   "run_demo(demo_basic, world_size)  # again: MASTER_PORT 12355 is free again",
                   params="world_size = 2")
    for text in run_papermill(tmp_path / "tutorial.ipynb", cwd=tmp_path)[-2:]:
        for rank in range(2):
            assert f"[rank {rank}] Running basic DDP example on rank {rank}." in text, text
            assert f"[rank {rank}] Finished running basic DDP example on rank {rank}." in text, text


@pytest.mark.matrix
def test_results_in_rank_order_no_group_and_no_agent_environment():
    ns = as_cell(
        "import os\n"
        "import torch.distributed as dist\n"
        "def fn(i, base):\n"
        "    agent = sorted(k for k in os.environ if k in ('RANK', 'WORLD_SIZE', 'MASTER_PORT', 'MASTER_ADDR')\n"
        "                  or k.startswith('TORCHELASTIC_'))\n"
        "    return base + i, dist.is_initialized(), agent\n"
    )
    assert mp.spawn(ns["fn"], args=(100,), nprocs=2) == [(100, False, []), (101, False, [])]


@pytest.mark.matrix
def test_error_names_the_rank():
    ns = as_cell("def fn(i):\n    if i == 1:\n        raise ZeroDivisionError('rank one divides by zero')\n")
    with pytest.raises(WorkerError, match="rank 1 failed with ZeroDivisionError") as info:
        mp.spawn(ns["fn"], nprocs=2)
    assert "rank one divides by zero" in info.value.traceback or "rank one" in str(info.value)


@pytest.mark.matrix
@pytest.mark.parametrize("kwargs,words", [
    ({"join": False}, ["join=False", "join=True"]),
    ({"start_method": "fork"}, ["'fork'", "Cannot re-initialize CUDA in forked subprocess", "'spawn' or 'forkserver'"]),
    ({"args": [2]}, ["args must be a tuple"]),
    ({"nprocs": 0}, ["nprocs must be >= 1"]),
])
def test_refused_before_any_process_starts(kwargs, words):
    with pytest.raises(LaunchError) as info:
        mp.spawn(print, **kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_master_address_and_port_the_caller_set_reach_the_ranks_and_the_agents_do_not(monkeypatch):
    """As torch.multiprocessing.spawn passes the parent's environment on: a cell that sets
    MASTER_ADDR/MASTER_PORT before spawn, and a worker that rendezvouses on them (env://)."""
    from helpers.engine import free_port

    port = str(free_port())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    ns = as_cell(
        "import os\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "def fn(i, world_size):\n"
        "    dist.init_process_group('gloo', rank=i, world_size=world_size)\n"
        "    t = torch.tensor([float(i + 1)])\n"
        "    dist.all_reduce(t)\n"
        "    dist.destroy_process_group()\n"
        "    return os.environ.get('MASTER_ADDR'), os.environ.get('MASTER_PORT'), t.item()\n"
    )
    assert mp.spawn(ns["fn"], args=(2,), nprocs=2) == [("127.0.0.1", port, 3.0)] * 2
    # only what the caller set comes back: the agent's own MASTER_ADDR does not leak in
    monkeypatch.delenv("MASTER_ADDR")
    ns = as_cell("import os\ndef fn(i):\n    return os.environ.get('MASTER_ADDR'), os.environ.get('MASTER_PORT')\n")
    assert mp.spawn(ns["fn"], nprocs=2) == [(None, port)] * 2


def test_process_exit_codes_pids_subclass_and_the_callers_environment(monkeypatch, capsys):
    monkeypatch.setenv("MASTER_PORT", "23456")
    ns = as_cell(
        "import os\n"
        "import sys\n"
        "import helpers.mp as mp\n"
        "def leave(code):\n"
        "    sys.exit(code)\n"
        "class Worker(mp.Process):\n"
        "    def run(self):\n"
        "        print('worker sees MASTER_PORT', os.environ.get('MASTER_PORT'))\n"
    )
    processes = [mp.Process(target=ns["leave"], args=(3,)), ns["Worker"]()]
    for p in processes:
        p.start()
    assert [p.exitcode for p in processes] == [None, None]
    processes[1].join()  # runs both, together
    assert [p.exitcode for p in processes] == [3, 0]
    assert [p.is_alive() for p in processes] == [False, False]
    assert all(isinstance(p.pid, int) for p in processes) and processes[0].pid != processes[1].pid
    processes[0].join()  # already run: returns at once
    assert "[rank 1] worker sees MASTER_PORT 23456" in capsys.readouterr().out


def test_process_that_raises_makes_join_raise_naming_it():
    ns = as_cell("def work(i):\n    if i == 1:\n        raise KeyError('process one')\n")
    processes = [mp.Process(target=ns["work"], args=(i,)) for i in range(2)]
    for p in processes:
        p.start()
    with pytest.raises(WorkerError, match="rank 1 failed with KeyError"):
        processes[0].join()
    assert processes[1].exitcode == 1 and processes[0].exitcode in (0, -15)
    processes[1].join()  # the run is over: no second launch, no second error


def test_spawn_and_join_set_no_limit_as_torch_does(monkeypatch):
    """issue 40: torch's spawn and Process.join() wait as long as the processes run (a 5-epoch MNIST
    was once ended after 300 s here). helpers.mp keeps torch's signatures and defaults, and a run
    started without a timeout reaches the launcher's supervisor with none."""
    import inspect
    import multiprocessing

    import torch.multiprocessing

    from helpers.engine import launcher

    ours, torchs = inspect.signature(mp.spawn).parameters, inspect.signature(torch.multiprocessing.spawn).parameters
    assert {n: ours[n].default for n in torchs} == {n: p.default for n, p in torchs.items()}
    assert ours["timeout"].default is None
    join_default = inspect.signature(multiprocessing.Process.join).parameters["timeout"].default
    assert inspect.signature(mp.Process.join).parameters["timeout"].default is join_default is None
    limits = []
    supervise = launcher._supervise

    def recording(config, entry_args, run_dir, timeout, before):
        limits.append(timeout)
        return supervise(config, entry_args, run_dir, timeout, before)

    monkeypatch.setattr(launcher, "_supervise", recording)
    ns = as_cell("def fn(i):\n    return i\n")
    assert mp.spawn(ns["fn"], nprocs=2) == [0, 1]
    processes = [mp.Process(target=ns["fn"], args=(i,)) for i in range(2)]
    for p in processes:
        p.start()
    processes[0].join()
    assert [p.exitcode for p in processes] == [0, 0]
    assert limits == [None, None], f"the limits the runs got: {limits}"


def test_process_misuse_is_refused_before_anything_runs():
    import threading

    p = mp.Process(target=print)
    with pytest.raises(LaunchError, match="was not started"):
        p.join()
    lock = threading.Lock()
    with pytest.raises(LaunchError, match="positional argument 0.*a lock"):
        mp.Process(target=print, args=(lock,)).start()
    p.start()
    with pytest.raises(LaunchError, match="already started"):
        p.start()
    p.terminate()  # dropped before it ran
    assert p.exitcode == -15 and not p.is_alive()


def test_start_methods_context_and_the_rewrite_for_what_is_missing():
    mp.set_start_method("spawn")
    mp.set_start_method("spawn")  # again, as a re-run cell does: no RuntimeError
    assert mp.get_start_method() == "spawn"
    ctx = mp.get_context("spawn")
    assert ctx.Process is mp.Process and ctx.get_start_method() == "spawn"
    for call in (lambda: mp.set_start_method("fork"), lambda: mp.get_context("fork")):
        with pytest.raises(LaunchError, match="Cannot re-initialize CUDA in forked subprocess"):
            call()
    for get, words in [(lambda: mp.Queue, "return the value from the function instead"),
                       (lambda: ctx.SimpleQueue, "return the value from the function instead"),
                       (lambda: mp.cpu_count, "`os.cpu_count()`"),
                       (lambda: mp.ProcessRaisedException, "except helpers.engine.WorkerError"),
                       (lambda: mp.set_sharing_strategy, "`torch.multiprocessing.set_sharing_strategy`")]:
        with pytest.raises(AttributeError, match="helpers.mp has no") as info:
            get()
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not hasattr(mp, "__wrapped__")
