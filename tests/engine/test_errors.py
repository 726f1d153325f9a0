"""Errors a learner can read (issue 28, part 3): what a real IPython kernel shows for the project's
exceptions (IPython's ``_render_traceback_`` hook), the hints of ``helpers.engine.errors.HINTS``,
each triggered for real, and scripts piped on stdin or given with ``-c``."""

import os
import re
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import helpers.mp as hmp
import launch_workers as w
from _support import REPO_ROOT, Kernel
from helpers.engine import LaunchTimeout, WorkerError, free_port, launch

# slow: kernels or warm ranks in (nearly) every test
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
HELPERS_PATH = re.compile(r"helpers/(?:\w+/)*\w+\.py")  # a frame of helpers (the hints may name helpers.mp.spawn)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(uuid.uuid4().hex)
    yield k
    k.close()


def shown(kernel, code):
    """Run ``code`` in the kernel; the lines of the error output the learner sees (the error
    message's ``traceback``, which IPython fills from ``_render_traceback_`` when the exception has
    one), without colours."""
    reply, _ = kernel.cell(code)
    assert reply["status"] == "error", reply
    return ANSI.sub("", "\n".join(reply["traceback"])).splitlines(), reply


def test_one_line_mistake_in_a_worker_is_a_few_lines_in_a_kernel(kernel):
    """``1/0`` in a cell-defined worker, under launch and helpers.mp: at most 12 lines, naming the
    rank, showing the worker's line, and no frame of helpers; the full traceback stays on ``.traceback``."""
    kernel.cell("from helpers.engine import launch\nimport helpers.mp as mp\n"
                "def work(rank, world_size):\n    return 1/0\n"
                "def spawned(i):\n    return 1/0\n")
    for call in ("launch(work, 2)", "mp.spawn(spawned, nprocs=2)"):
        lines, reply = shown(kernel, call)
        text = "\n".join(lines)
        assert reply["ename"] == "WorkerError", text
        assert len(lines) <= 12, f"{len(lines)} lines:\n{text}"
        assert "return 1/0" in text and re.search(r"rank [01] failed with ZeroDivisionError", text), text
        assert re.search(r"Cell In\[\d+\], line 4, in work|Cell In\[\d+\], line 6, in spawned", text), text
        assert call in text, "the cell's own call is shown"
        assert not HELPERS_PATH.search(text), text
        _, out = kernel.cell("import sys\nprint(sys.last_value.traceback)")
        assert "rank_main.py" in out and "1/0" in out, f"the full traceback is kept: {out}"


def test_launch_error_and_timeout_are_a_few_lines_in_a_kernel(kernel):
    kernel.cell("from helpers.engine import launch\nimport time\ndef sleeper(rank, world_size):\n    time.sleep(60)\n")
    lines, reply = shown(kernel, "launch(sleeper, 0)")
    text = "\n".join(lines)
    assert reply["ename"] == "LaunchError" and len(lines) <= 5 and "world_size must be >= 1" in text, text
    assert not HELPERS_PATH.search(text), text
    lines, reply = shown(kernel, "launch(sleeper, 2, timeout=3)")
    text = "\n".join(lines)
    # a rank that had started by the timeout adds where it was (tests/engine/test_hang_diagnosis.py): at most
    # a header and three lines per rank, after the few lines of the error itself
    stuck = next((i for i, line in enumerate(lines) if line.startswith("Where each rank was stuck")), len(lines))
    assert reply["ename"] == "LaunchTimeout" and stuck <= 5 and len(lines) - stuck <= 1 + 3 * 2, text
    assert "ranks not finished" in text, text
    assert not HELPERS_PATH.search(text), text


def test_warm_ranks_worker_error_is_a_few_lines_in_a_kernel(kernel):
    """The same rendering for the WorkerError warm ranks raise, from ``run`` and from ``%%px``."""
    kernel.cell("from helpers.engine import start_ranks\nr = start_ranks(2, timeout=60)\n"
                "def warm_work(rank, world_size):\n    return 1/0\n")
    try:
        for call, line in (("r.run(warm_work)", "return 1/0"), ("%%px\n1/0", "1/0")):
            lines, reply = shown(kernel, call)
            text = "\n".join(lines)
            assert reply["ename"] == "WorkerError" and len(lines) <= 12, f"{len(lines)} lines:\n{text}"
            assert re.search(r"rank [01] failed with ZeroDivisionError", text), text
            assert any(ln.strip() == line for ln in lines), text
            assert not HELPERS_PATH.search(text), text
    finally:
        kernel.cell("r.stop()")



def test_interrupt_and_no_ranks_are_a_few_lines_in_a_kernel(kernel):
    """"Interrupt kernel" during a launch, and a %%px cell after ranks.stop(): a few lines each (they
    were 30 and 22 lines of helpers' and IPython's frames), and the interrupt is still a KeyboardInterrupt."""
    import signal
    import threading

    kernel.cell("from helpers.engine import launch\nimport time\n"
                "def nap(rank, world_size):\n    time.sleep(60)\n")
    timer = threading.Timer(15.0, os.kill, (kernel.pid, signal.SIGINT))
    timer.start()
    try:
        lines, reply = shown(kernel, "launch(nap, 2, timeout=120)")
    finally:
        timer.cancel()
    text = "\n".join(lines)
    # 5 lines, then where each rank was (issue 30, part 3): a heading, and per rank its line in the cell
    assert reply["ename"] == "LaunchInterrupted" and len(lines) <= 5 + 1 + 2 * 3, text
    assert "workers were ended" in text and not HELPERS_PATH.search(text), text
    assert re.search(r"rank 0, at:\n\s+Cell In ?\[\d+\], line 4, in nap\n\s+time\.sleep\(60\)", text), text
    _, out = kernel.cell("import sys\nprint(isinstance(sys.last_value, KeyboardInterrupt))")
    assert "True" in out, out
    kernel.cell("from helpers.engine import start_ranks\nr = start_ranks(2, timeout=60)\nr.stop()")
    lines, reply = shown(kernel, "%%px\nprint(rank)")
    text = "\n".join(lines)
    assert reply["ename"] == "NoRanks" and len(lines) <= 5 and "start_ranks(world_size=2)" in text, text
    assert not HELPERS_PATH.search(text), text


# ---- hints, each triggered for real ----------------------------------------------------------

def init_again(rank, world_size):
    dist.init_process_group("gloo")


def torchrun_style(i):
    dist.init_process_group("gloo")  # reads RANK, WORLD_SIZE, MASTER_* from the environment


def reads_rank(i):
    return int(os.environ["RANK"])  # torchrun-style code reads its rank before any group exists


def one_parameter(rank):
    return rank


def fixed_port(i, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=i, world_size=2)
    dist.destroy_process_group()


def returns(rank, world_size, what):
    import threading
    return (i for i in range(3)) if what == "generator" else threading.Lock()


def short(err):
    text = str(err)
    assert len(text.splitlines()) <= 8, text
    return text


def cpu_model_with_device_ids(rank, world_size):
    DDP(torch.nn.Linear(2, 1), device_ids=[rank])  # the DDP tutorial's line, the model left on CPU


def zero_saved_on_rank_0(rank, world_size):
    """06b's rank-0-only save, with a ZeroRedundancyOptimizer: no consolidate_state_dict first."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.Linear(2, 2)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    if rank == 0:
        return opt.state_dict()


def to_the_gpu(rank, world_size, how):
    model = torch.nn.Linear(2, 1)
    model.to(rank) if how == "to(rank)" else model.cuda()  # the DDP tutorial's ToyModel().to(rank)


def nccl_setup(i, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=i, world_size=world_size)  # the tutorials' GPU setup()


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU code runs where there is a GPU")
GPU_WORDS = ("What to do:", ".to(rank)", "docs/OWN_CODE.md")
HINTS = [  # the call that fails, the words (or patterns) its WorkerError must show in at most 8 lines
    pytest.param(lambda: launch(init_again, 2, timeout=120), (
        "initialize the default process group twice", "What to do:", "remove init_process_group",
        "helpers.mp.spawn", 'dist.init_process_group("gloo")'), id="init-twice-launch"),  # last: the worker's line
    pytest.param(lambda: hmp.spawn(torchrun_style, nprocs=2, timeout=120), (
        "RANK expected, but not set", "What to do:", "rank as fn's first argument", "helpers.engine.launch"),
        id="rank-expected-mp"),
    pytest.param(lambda: hmp.spawn(reads_rank, nprocs=2, timeout=120), (
        "KeyError: 'RANK'", "What to do:", "rank as fn's first argument"), id="rank-from-environment-mp"),
    pytest.param(lambda: launch(one_parameter, 2, timeout=120), (
        "takes 1 positional argument but 2 were given", "What to do:", "fn(rank, world_size, *args, **kwargs)"),
        id="wrong-parameters-launch"),
    # torch's message speaks of "GPU modules or CPU modules" and never says to drop device_ids
    pytest.param(lambda: launch(cpu_model_with_device_ids, 2, timeout=120), (
        "device_ids and output_device arguments only work", "What to do:", "DDP(model), without device_ids"),
        id="device-ids-on-cpu-model-launch"),
    pytest.param(lambda: launch(zero_saved_on_rank_0, 2, backend="gloo", timeout=120), (
        "Optimizer state has not been consolidated on this rank", "What to do:",
        "consolidate_state_dict(to=0) on every rank"), id="zero-state-dict-launch"),
    *[pytest.param(lambda what=what: launch(returns, 2, what, timeout=120), (
        f"returned a {what} that cannot be pickled back", "return plain data"), id=f"{what}-returned-launch")
      for what in ("generator", "lock")],
    # a CUDA build says "Found no NVIDIA driver", a CPU build "Torch not compiled with CUDA enabled"
    # (.cuda()) or "Cannot access accelerator device" (.to(rank)): either way, what to drop, and where
    # the tutorials' changes are listed
    *[pytest.param(lambda how=how: launch(to_the_gpu, 2, how, timeout=120), (
        re.compile("Found no NVIDIA driver|Torch not compiled with CUDA enabled|Cannot access accelerator"),
        ".cuda()", "worker_device()", *GPU_WORDS), id=f"gpu-code-{how}-on-cpu-launch", marks=no_gpu)
      for how in ("to(rank)", "cuda()")],
    pytest.param(lambda: hmp.spawn(nccl_setup, args=(2, free_port()), nprocs=2, timeout=120), (
        "ProcessGroupNCCL is only supported with GPUs, no GPUs found!", '"gloo"', *GPU_WORDS),
        id="nccl-without-gpu-mp", marks=no_gpu),
]


@pytest.mark.parametrize("call,words", HINTS)
def test_hint(call, words):
    with pytest.raises(WorkerError) as info:
        call()
    text = short(info.value)
    assert all(w.search(text) if isinstance(w, re.Pattern) else w in text for w in words), text


def test_hint_port_held_by_another_program_under_mp():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(WorkerError) as info:
            hmp.spawn(fixed_port, args=(held.getsockname()[1],), nprocs=2, timeout=120)
    text = short(info.value)
    assert info.value.rank == 0 and "EADDRINUSE" in text, text
    assert "What to do:" in text and "MASTER_PORT" in text and "free_port" in text, text


def world_of_four(i, port):
    """Rank ``i`` of 4, though only 2 processes start: the rendezvous waits for ranks 2 and 3."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=i, world_size=4)


def test_hint_ranks_that_never_meet_under_mp():
    """Every rank still in init_process_group when time runs out: the ranks never met, so the
    advice is about the rendezvous (address, port, rank, world size), not a skipped collective."""
    with pytest.raises(LaunchTimeout) as info:
        hmp.spawn(world_of_four, args=(free_port(),), nprocs=2, timeout=15)
    text = str(info.value)
    assert set(info.value.stacks) == {0, 1}, f"a stack dump per rank: {sorted(info.value.stacks)}\n{text}"
    assert "the ranks never met" in text and "MASTER_PORT" in text and "WORLD_SIZE" in text, text
    assert "skips a collective" not in text, text


@no_gpu
def test_note_accelerate_alone_on_every_rank_under_launch(monkeypatch, capfd):
    """accelerate with no GPU and neither ACCELERATE_USE_CPU nor cpu=True treats each rank as a job
    of its own, silently: a note names what to set; with either, one job of 2 processes and no note."""
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert launch(w.accelerate_state, 2, False, timeout=120) == [("NO", 1)] * 2
    err = capfd.readouterr().err
    assert re.search(r"\[rank 0\] Note: accelerate ran each of the 2 ranks as a job of its own", err), err
    assert "os.environ['ACCELERATE_USE_CPU'] = 'yes'" in err and "Accelerator(cpu=True)" in err, err
    assert "[rank 1] Note" not in err, "one note, not one per rank"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "yes")
    assert launch(w.accelerate_state, 2, False, timeout=120) == [("MULTI_CPU", 2)] * 2
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert launch(w.accelerate_state, 2, True, timeout=120) == [("MULTI_CPU", 2)] * 2
    assert "Note: accelerate" not in capfd.readouterr().err


# ---- scripts without a file: stdin and -c ------------------------------------------------------

SCRIPT = textwrap.dedent("""\
    from helpers.engine import launch, start_ranks
    import helpers.mp as mp

    def work(rank, world_size):
        return rank * 10

    def spawned(i):
        return i + 1

    if __name__ == "__main__":
        print("results", launch(work, 2, timeout=120), mp.spawn(spawned, nprocs=2, timeout=120))
        ranks = start_ranks(2, timeout=120, activate=False)
        print("warm ranks", ranks.run(work))
        ranks.stop()
""")


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_script_without_a_file_launches(how, tmp_path):
    """``python3 - <<EOF`` and ``python3 -c``: Python's preparation data asked every rank (and every
    warm rank's engine) to re-run ``<cwd>/<stdin>`` as the main module, and each died with
    FileNotFoundError."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    args, stdin = ([sys.executable, "-"], SCRIPT) if how == "stdin" else ([sys.executable, "-c", SCRIPT], "")
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert done.returncode == 0 and "results [0, 10] [1, 2]" in done.stdout, done.stderr[-3000:]
    assert "warm ranks [0, 10]" in done.stdout, done.stderr[-3000:]


# ---- hints for the casebook's errors (issue 42) ----------------------------------------------

def torch_library_strings(start: str) -> list[str]:
    """The NUL-terminated strings of the installed torch's C++ library (libtorch_cpu) that begin
    with ``start``: where torch's C++ error messages live in an installed torch."""
    import mmap
    import pathlib

    lib = next(pathlib.Path(torch.__file__).parent.joinpath("lib").glob("libtorch_cpu.*"))
    found = []
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(start.encode())
        while at != -1:
            found.append(data[at:data.find(b"\0", at)].decode())
            at = data.find(start.encode(), at + 1)
    return found


def test_hint_mps_tensor_in_a_gloo_collective_matches_torchs_messages():
    """No MPS tensor can exist on Linux: the hint must match the messages torch builds, read from
    the installed torch (c10::str(prefix, device type))."""
    from helpers.engine.errors import hint_for

    assert "mps" not in dist.Backend.backend_capability["gloo"] + dist.Backend.backend_capability["nccl"]
    for prefix in ("No backend type associated with device type ", "unsupported device type "):
        assert torch_library_strings(prefix) == [prefix], f"torch's message changed: {prefix!r}"
    gloo_op = torch_library_strings("ProcessGroupGloo::allreduce: ")
    assert "ProcessGroupGloo::allreduce: " in gloo_op, gloo_op
    for message in ("RuntimeError: No backend type associated with device type mps",
                    "RuntimeError: ProcessGroupGloo::allreduce: unsupported device type mps"):
        hint = hint_for(message)
        assert hint and "mps" in hint and "t.cpu()" in hint, (message, hint)
    assert hint_for("RuntimeError: No backend type associated with device type meta") is None


def test_hint_use_libuv_matches_torchs_message():
    """Windows builds without libuv: the message read from the installed torch (TCPStore's check)."""
    from helpers.engine.errors import hint_for

    (message,) = torch_library_strings("use_libuv was requested")
    assert "PyTorch was built without libuv support" in message, message
    hint = hint_for(f"RuntimeError: {message}")
    assert hint and 'os.environ["USE_LIBUV"] = "0"' in hint and "use_libuv=0" in hint, hint


def test_other_ranks_are_grouped_and_cut_at_a_word():
    """New-user trial: 15 other ranks on one line, a gloo message cut mid-word. Ranks with the same
    summary now share one entry (spans from four ranks on), and a long summary ends at a word."""
    from helpers.engine.errors import _other_ranks_line, _short

    line = _other_ranks_line({r: "ended by the launcher" for r in range(1, 16)} | {3: "ValueError: bad"})
    assert line == "ranks 1, 2, 4-15: ended by the launcher; rank 3: ValueError: bad", line
    long = "RuntimeError: " + "word " * 60
    cut = _short(long)
    assert len(cut) <= 164 and cut.endswith(" ...") and cut[:-4].endswith("word"), cut
