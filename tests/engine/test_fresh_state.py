"""Each rank starts like a fresh process: its own random state, per rank and per launch (and per
start of warm ranks), as under ``torch.multiprocessing.spawn`` or torchrun. Ranks are forked from
one fork server (helpers.engine.fork_server), so without a reseed they all inherited its
generators and drew the same numbers. Real processes, real gloo groups, 2 ranks."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import helpers.mp as hmp
from _support import REPO_ROOT, TESTS_DIR
from helpers.engine import launch, start_ranks
from launch_workers import draws

# slow: real processes in every test
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(300), pytest.mark.slow]

GENERATORS = ("initial_seed", "torch", "numpy", "random")


def _all_differ(results: list[dict]) -> None:
    """Every generator gives each process (``results[i]``) numbers of its own."""
    for name in GENERATORS:
        values = [json.dumps(r[name]) for r in results]
        assert len(set(values)) == len(values), (name, values)


def _plain_torch_spawn(tmp_path, seed=None) -> list[dict]:
    """:func:`launch_workers.draws` in 2 processes of plain ``torch.multiprocessing.spawn`` (a script)."""
    folder = tmp_path / f"spawn-{seed}"
    folder.mkdir()
    script = ("import torch.multiprocessing as mp, launch_workers\n"
              f"mp.spawn(launch_workers.draws_to_file, args=({str(folder)!r}, {seed!r}), nprocs=2)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=240)
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(2)]


def test_ranks_and_launches_draw_their_own_numbers():
    first, second = launch(draws, 2), launch(draws, 2)
    _all_differ(first)
    _all_differ(first + second)


def test_helpers_mp_processes_draw_their_own_numbers():
    spawned = hmp.spawn(draws, nprocs=2)
    procs = [hmp.Process(target=draws, args=(r,)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    _all_differ(spawned)


def test_warm_ranks_draw_their_own_numbers_per_start():
    got = []
    for _ in range(2):
        ranks = start_ranks(2, timeout=120, activate=False)
        try:
            got += ranks.run(draws)
        finally:
            ranks.stop()
    _all_differ(got)


def test_seeded_worker_draws_what_plain_torch_spawn_draws(tmp_path):
    """Unseeded, plain ``torch.multiprocessing.spawn``'s processes differ too (the behaviour we
    copy); seeded inside the worker, launch, helpers.mp and warm ranks give exactly its numbers."""
    reference = _plain_torch_spawn(tmp_path)
    _all_differ(reference)
    seeded = _plain_torch_spawn(tmp_path, seed=7)
    assert seeded[0] == seeded[1]
    assert launch(draws, 2, seed=7) == seeded
    assert hmp.spawn(draws, args=(), nprocs=2) != seeded  # unseeded: not the seeded numbers
    ranks = start_ranks(2, timeout=120, activate=False)
    try:
        assert ranks.run(draws, seed=7) == seeded
    finally:
        ranks.stop()


#: a program in the shape people paste: each process builds its model unseeded, as DDP's tutorial
#: does, and DDP's broadcast from rank 0 makes the replicas equal
UNSEEDED_MODELS = textwrap.dedent("""\
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import helpers.mp as mp
    from torch.nn.parallel import DistributedDataParallel as DDP


    def worker(rank, world_size):
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = FREE_PORT
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        model = nn.Linear(4, 1)
        before = model.weight.sum().item()
        ddp = DDP(model)
        print(f"rank {rank}: weight sum before DDP {before:.6f}, after {ddp.module.weight.sum().item():.6f}")
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(2,), nprocs=2, join=True)
""")


def test_unseeded_models_differ_before_ddp_and_agree_after(tmp_path):
    from helpers.engine import free_port

    script = tmp_path / "unseeded.py"
    script.write_text(UNSEEDED_MODELS.replace("FREE_PORT", repr(str(free_port()))))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.findall(r"\[rank (\d)\] rank \1: weight sum before DDP (\S+), after (\S+)", done.stdout)
    assert len(found) == 2, done.stdout
    (_, before0, after0), (_, before1, after1) = sorted(found)
    assert before0 != before1, "each rank's model is its own before DDP's broadcast"
    assert after0 == after1 == before0, "after it, every rank holds rank 0's"


def _string_hash(rank, *rest):
    return hash("ddp-lab"), list({"weight", "bias", "running_mean", "running_var"})


def test_string_hash_seed_is_the_one_documented_difference():
    """What a fork cannot renew: Python's string-hash seed is fixed at interpreter start, so every
    rank forked from the server has the server's (docs/ARCHITECTURE.md, the guarantees), where each
    process of torchrun or plain spawn has its own. Set ``PYTHONHASHSEED`` in a test that relies on it."""
    ranks = launch(_string_hash, 2) + launch(_string_hash, 2)
    assert len({r[0] for r in ranks}) == 1, ranks
    fresh = [subprocess.run([sys.executable, "-c", "print(hash('ddp-lab'))"], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}, check=True).stdout
             for _ in range(2)]
    assert fresh[0] != fresh[1], "two fresh interpreters draw their own string-hash seed"
