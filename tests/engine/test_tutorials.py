"""Code from tutorials and seed scripts runs on CPU with the changes docs/OWN_CODE.md's "Code from
tutorials" section lists, and nothing more.

Each source below is code written here in the style of its original (the DDP tutorial, dist_tuto,
ddp-tutorial-series' multigpu.py, a torchrun script, the seed scripts), as a learner would paste
it. A test applies exactly the listed ``CHANGES`` to it (each ``old`` text must occur once) and
runs the result as a real ``__main__`` script (``python3 file.py`` in a subprocess), so its
functions are defined in ``__main__`` as in a notebook cell. The only other edit is test plumbing:
a fixed ``MASTER_PORT`` is replaced with a free one, so that two tests (or two helpers' test runs)
at once on one machine do not collide. Real processes, real gloo, 2 ranks.
"""

import os
import re
import subprocess
import sys
import uuid

import pytest

from _support import REPO_ROOT, Kernel
from helpers.engine import free_port

# slow: real processes in (nearly) every test
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(400), pytest.mark.slow]

IMPORT = ("import torch.multiprocessing as mp", "import helpers.mp as mp")


def _apply(source: str, changes: list[tuple[str, str]]) -> str:
    """``source`` with each ``(old, new)`` replaced; every ``old`` occurs exactly once."""
    for old, new in changes:
        assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times"
        source = source.replace(old, new)
    return source


def _run(tmp_path, source: str, *argv: str, port: str | None = None, cwd=None, timeout=300):
    """Run ``source`` as ``python3 script.py *argv``; a fixed ``port`` in it becomes a free one."""
    if port is not None:
        assert source.count(port) == 1, port
        source = source.replace(port, str(free_port()))
    script = tmp_path / f"script_{uuid.uuid4().hex[:8]}.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script), *argv], cwd=str(cwd or tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


# ---- the official DDP tutorial, "Basic Use Case" -------------------------------------------------
# https://pytorch.org/tutorials/intermediate/ddp_tutorial.html (the accelerator form of setup; its
# older form had "gloo" there already). On a CUDA build without a GPU the backend line gives nccl.

DDP_TUTORIAL = '''\
import os
import sys
import tempfile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import torch.multiprocessing as mp

from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'

    # We want to be able to train our model on an accelerator
    # such as CUDA, MPS, MTIA, or XPU.
    acc = torch.accelerator.current_accelerator()
    backend = torch.distributed.get_default_backend_for_device(acc)
    # initialize the process group
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and move it to GPU with id rank
    model = ToyModel().to(rank)
    ddp_model = DDP(model, device_ids=[rank])

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(rank)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn,
             args=(world_size,),
             nprocs=world_size,
             join=True)


if __name__ == "__main__":
    n_gpus = torch.cuda.device_count()
    assert n_gpus >= 2, f"Requires at least 2 GPUs to run, but got {n_gpus}"
    world_size = n_gpus
    run_demo(demo_basic, world_size)
'''

#: what docs/OWN_CODE.md lists for the DDP tutorial on CPU
DDP_TUTORIAL_CHANGES = [
    IMPORT,
    ("backend = torch.distributed.get_default_backend_for_device(acc)", 'backend = "gloo"'),
    ("model = ToyModel().to(rank)", "model = ToyModel()"),
    ("DDP(model, device_ids=[rank])", "DDP(model)"),
    ("labels = torch.randn(20, 5).to(rank)", "labels = torch.randn(20, 5)"),
    ("    n_gpus = torch.cuda.device_count()\n"
     '    assert n_gpus >= 2, f"Requires at least 2 GPUs to run, but got {n_gpus}"\n'
     "    world_size = n_gpus\n", "    world_size = 2\n"),
]


def test_ddp_tutorial_runs_on_cpu_with_the_listed_changes(tmp_path):
    rc, out = _run(tmp_path, _apply(DDP_TUTORIAL, DDP_TUTORIAL_CHANGES), port="12355")
    assert rc == 0, out
    for rank in range(2):
        assert f"[rank {rank}] Running basic DDP example on rank {rank}." in out, out
        assert f"[rank {rank}] Finished running basic DDP example on rank {rank}." in out, out


# ---- dist_tuto: "Writing Distributed Applications with PyTorch" -----------------------------------
# https://pytorch.org/tutorials/intermediate/dist_tuto.html: its Process loop, and its all-reduce run

DIST_TUTO = '''\
"""run.py:"""
#!/usr/bin/env python
import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])


def init_process(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ['MASTER_PORT'] = '29500'
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    world_size = 2
    processes = []
    mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    print("exit codes", [p.exitcode for p in processes])
'''

DIST_TUTO_CHANGES = [IMPORT]


def test_dist_tuto_process_loop_runs_with_one_changed_import(tmp_path):
    rc, out = _run(tmp_path, _apply(DIST_TUTO, DIST_TUTO_CHANGES), port="29500")
    assert rc == 0, out
    for rank in range(2):
        assert f"[rank {rank}] Rank  {rank}  has data  tensor(2.)" in out, out
    assert "exit codes [0, 0]" in out, out


# ---- pytorch/examples, distributed/ddp-tutorial-series/multigpu.py --------------------------------
# https://github.com/pytorch/examples/tree/main/distributed/ddp-tutorial-series (datautils.py's
# MyTrainDataset pasted into the same file, as into a cell)

MULTIGPU = '''\
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader

import torch.multiprocessing as mp
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group
import os


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(rank, world_size):
    """
    Args:
        rank: Unique identifier of each process
        world_size: Total number of processes
    """
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    torch.cuda.set_device(rank)
    init_process_group(backend="nccl", rank=rank, world_size=world_size)


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        gpu_id: int,
        save_every: int,
    ) -> None:
        self.gpu_id = gpu_id
        self.model = model.to(gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.model = DDP(model, device_ids=[gpu_id])

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source = source.to(self.gpu_id)
            targets = targets.to(self.gpu_id)
            self._run_batch(source, targets)

    def _save_checkpoint(self, epoch):
        ckp = self.model.module.state_dict()
        PATH = "checkpoint.pt"
        torch.save(ckp, PATH)
        print(f"Epoch {epoch} | Training checkpoint saved at {PATH}")

    def train(self, max_epochs: int):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def load_train_objs():
    train_set = MyTrainDataset(256)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=True,
        shuffle=False,
        sampler=DistributedSampler(dataset)
    )


def main(rank: int, world_size: int, save_every: int, total_epochs: int, batch_size: int):
    ddp_setup(rank, world_size)
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, rank, save_every)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description='simple distributed training job')
    parser.add_argument('total_epochs', type=int, help='Total epochs to train the model')
    parser.add_argument('save_every', type=int, help='How often to save a snapshot')
    parser.add_argument('--batch_size', default=32, type=int, help='Input batch size on each device (default: 32)')
    args = parser.parse_args()

    world_size = torch.cuda.device_count()
    mp.spawn(main, args=(world_size, args.save_every, args.total_epochs, args.batch_size), nprocs=world_size)
'''

MULTIGPU_CHANGES = [
    IMPORT,
    ("    torch.cuda.set_device(rank)\n", ""),
    ('init_process_group(backend="nccl"', 'init_process_group(backend="gloo"'),
    ("self.model = model.to(gpu_id)", "self.model = model"),
    ("DDP(model, device_ids=[gpu_id])", "DDP(model)"),
    ("            source = source.to(self.gpu_id)\n            targets = targets.to(self.gpu_id)\n", ""),
    ("world_size = torch.cuda.device_count()", "world_size = 2"),
]


def test_ddp_tutorial_series_multigpu_runs_on_cpu_with_the_listed_changes(tmp_path):
    rc, out = _run(tmp_path, _apply(MULTIGPU, MULTIGPU_CHANGES), "2", "1", port="12355")
    assert rc == 0, out
    for rank in range(2):
        for epoch in range(2):
            assert f"[rank {rank}] [GPU{rank}] Epoch {epoch} | Batchsize: 32 | Steps: 4" in out, out
    assert "[rank 0] Epoch 1 | Training checkpoint saved at checkpoint.pt" in out, out
    assert (tmp_path / "checkpoint.pt").is_file()


# ---- a torchrun script through helpers.engine.launch ---------------------------------------------
# the tutorial's elastic_ddp.py shape, CPU form: reads the torchrun variables, makes its own group

TORCHRUN = '''\
import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    print(f"Start running basic DDP example on rank {rank} (local rank {local_rank}) of {world_size}.")

    ddp_model = DDP(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    demo_basic()
'''

#: under launch: call it from launch (which calls fn(rank, world_size)) ...
TORCHRUN_CALL = ("if __name__ == \"__main__\":\n    demo_basic()\n",
                 "if __name__ == \"__main__\":\n    from helpers.engine import launch\n"
                 "    launch(lambda rank, world_size: demo_basic(), 2)\n")
#: ... and drop its init_process_group (launch made the group); its destroy_process_group may stay
TORCHRUN_CHANGES = [TORCHRUN_CALL, ('    dist.init_process_group("gloo")\n', "")]

#: what a torchrun script that keeps its init_process_group gets under launch (torch's own text)
TWICE = "trying to initialize the default process group twice!"


def test_torchrun_script_runs_through_launch_with_the_listed_changes(tmp_path):
    rc, out = _run(tmp_path, _apply(TORCHRUN, TORCHRUN_CHANGES))
    assert rc == 0, out
    for rank in range(2):
        assert f"[rank {rank}] Start running basic DDP example on rank {rank} (local rank {rank}) of 2." in out, out


def test_torchrun_script_that_keeps_init_process_group_fails_under_launch(tmp_path):
    rc, out = _run(tmp_path, _apply(TORCHRUN, [TORCHRUN_CALL]))
    assert rc == 1, out
    assert "WorkerError: rank " in out and f"failed with ValueError: {TWICE}" in out, out


# ---- seed-style scripts: one changed import --------------------------------------------------------

SEED_000 = '''\
"""A minimal DDP toy: two processes train one Linear layer together."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 10, generator=g)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for step in range(30):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, losses
    print(f"rank {rank}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 2
    mp.spawn(worker, args=(world_size,), nprocs=world_size, join=True)
'''

SEED_002 = '''\
"""MNIST with DDP: the rendezvous address is set once, in the main process, before mp.spawn."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def train(rank, world_size, epochs):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    dataset = datasets.MNIST("./data", train=True, download=True, transform=transform)
    dataset = Subset(dataset, range(1024))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item()
        print(f"rank {rank} epoch {epoch} mean loss {total / len(loader):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    world_size = 2
    mp.spawn(train, args=(world_size, 2), nprocs=world_size, join=True)
'''

SEED_004 = '''\
"""DP against DDP: one step of nn.DataParallel on the whole batch and one step of DDP on two
halves give the same parameters."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def make_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def dp_step():
    model = nn.DataParallel(make_model())  # on CPU: no devices, it simply calls the module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_batch()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    return model.module.state_dict()


def ddp_worker(rank, world_size, path):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29501"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_batch()
    n = len(x) // world_size
    F.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
    optimizer.step()
    if rank == 0:
        torch.save(model.module.state_dict(), path)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 2
    path = os.path.join(tempfile.mkdtemp(), "ddp.pt")
    mp.spawn(ddp_worker, args=(world_size, path), nprocs=world_size, join=True)
    dp, ddp = dp_step(), torch.load(path)
    for name in dp:
        torch.testing.assert_close(ddp[name], dp[name])
    print(f"DP and DDP agree on all {len(dp)} tensors after one step")
'''


def test_seed_000_toy_runs_with_one_changed_import(tmp_path):
    rc, out = _run(tmp_path, _apply(SEED_000, [IMPORT]), port="29500")
    assert rc == 0, out
    for rank in range(2):
        assert re.search(rf"\[rank {rank}\] rank {rank}: loss [\d.]+ -> [\d.]+", out), out


def test_seed_002_mnist_keeps_the_master_address_set_before_spawn(tmp_path):
    from helpers.data import ensure_mnist

    ensure_mnist()  # the decompressed files, where torchvision's MNIST("./data", download=True) finds them
    rc, out = _run(tmp_path, _apply(SEED_002, [IMPORT]), port="12355", cwd=REPO_ROOT)
    assert rc == 0, out
    for rank in range(2):
        for epoch in range(2):
            assert re.search(rf"\[rank {rank}\] rank {rank} epoch {epoch} mean loss [\d.]+", out), out


def test_seed_004_dp_against_ddp_runs_with_one_changed_import(tmp_path):
    rc, out = _run(tmp_path, _apply(SEED_004, [IMPORT]), port="29501")
    assert rc == 0, out
    assert "DP and DDP agree on all 4 tensors after one step" in out, out


# ---- what plain torch.multiprocessing.spawn gives in a notebook cell ------------------------------

def test_plain_torch_spawn_in_a_notebook_cell_cannot_find_the_cells_function(monkeypatch):
    """The error everybody meets first: spawn starts fresh interpreters that re-import
    ``__main__`` to find ``demo_basic``; a notebook's ``__main__`` is no file, so it is not there."""
    # ipykernel forwards what child processes write to the kernel's stderr into the cell, as in
    # JupyterLab, except where it finds PYTEST_CURRENT_TEST (ipykernel/iostream.py, OutStream)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    k = Kernel(uuid.uuid4().hex)
    try:
        k.cell("import torch.multiprocessing as mp\n"
               "def demo_basic(rank, world_size):\n"
               "    print('never printed')\n")
        reply, out = k.cell("mp.spawn(demo_basic, args=(2,), nprocs=2, join=True)", timeout=120)
        _, late = k.cell("import time; time.sleep(1)")  # the children's lines may come after the reply
    finally:
        k.close()
    assert reply["status"] == "error", out
    assert reply["ename"] == "ProcessExitedException", reply
    assert re.fullmatch(r"process \d terminated with exit code 1", reply["evalue"]), reply
    assert "AttributeError: Can't get attribute 'demo_basic' on <module '__main__'" in out + late, out + late



def test_plain_torch_spawn_in_a_lesson_kernel_says_to_use_helpers_mp(monkeypatch):
    """The same crash in a kernel that has imported the engine, as every lesson's does: under the
    ProcessExitedException, a line says why and to write ``import helpers.mp as mp``; the same call
    with that import then runs."""
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    k = Kernel(uuid.uuid4().hex)
    try:
        k.cell("from helpers.engine import launch\n"
               "import torch.multiprocessing as mp\n"
               "def demo_basic(rank, world_size):\n"
               "    return rank\n")
        reply, out = k.cell("mp.spawn(demo_basic, args=(2,), nprocs=2, join=True)", timeout=120)
        k.cell("import time; time.sleep(1)")  # the children's lines may come after the reply
        text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", "\n".join(reply.get("traceback", [])))
        assert reply["status"] == "error" and reply["ename"] == "ProcessExitedException", reply
        hint = text.splitlines()[-1]
        assert hint.startswith("What to do:") and "demo_basic" in hint and "__main__" in hint, text
        assert "`import helpers.mp as mp` instead of `import torch.multiprocessing as mp`" in hint, text
        assert "What to do:" in out, "shown in the cell too"
        _, after = k.cell("import helpers.mp as mp\nprint(mp.spawn(demo_basic, args=(2,), nprocs=2, join=True))",
                          timeout=120)
        assert "[0, 1]" in after, after
    finally:
        k.close()


# ---- docs/OWN_CODE.md's table is these change lists --------------------------------------------------

def test_docs_list_the_changes_these_tests_make():
    """docs/OWN_CODE.md (linked from the README) lists exactly the changes these tests make."""
    text = (REPO_ROOT / "docs" / "OWN_CODE.md").read_text()
    section = text[text.index("\n## Code from tutorials\n"):]
    section = section.split("\n## ", 2)[1]  # up to the next section, if any
    rows = {row.split(" | ")[0]: row for row in section.splitlines() if row.startswith("| ")}

    def row(start):
        return next(r for name, r in rows.items() if name.startswith(start))

    for source, words in [
        ("| [DDP tutorial]", ["the import", 'backend = "gloo"', "get_default_backend_for_device(acc)",
                              "ToyModel().to(rank)", "device_ids=[rank]", "torch.randn(20, 5).to(rank)",
                              "world_size = 2", "torch.cuda.device_count()"]),
        ("| [dist_tuto]", ["the import"]),
        ("| [ddp-tutorial-series]", ["the import", 'backend="gloo"', "torch.cuda.set_device(rank)",
                                     ".to(gpu_id)", "`source`", "`targets`", "device_ids=[gpu_id]",
                                     "world_size = 2", "torch.cuda.device_count()"]),
        ("| a `torchrun` script", ["launch(lambda rank, world_size: main(), 2)", "init_process_group(...)",
                                   TWICE, "destroy_process_group()` may stay"]),
        ("| scripts of the seeds' shapes", ["the import"]),
    ]:
        for word in words:
            assert word in row(source), (source, word)
    assert len(rows) == 2 + 5, rows  # header, rule, one row per source above
    # the change lists above are exactly these (one changed import where the doc says so)
    assert DIST_TUTO_CHANGES == [IMPORT] and len(DDP_TUTORIAL_CHANGES) == 6 and len(MULTIGPU_CHANGES) == 7
    flat = " ".join(section.split())
    assert "`ProcessExitedException: process 1 terminated with exit code 1`" in flat
    assert "`AttributeError: Can't get attribute 'demo_basic' on <module '__main__' (built-in)>`" in flat
