# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10d · Casebook: launch, names and platforms
#
# <!-- opening:start -->
# **You need** [00a processes and collectives](00a_processes_and_collectives.ipynb), [07a torchrun and many nodes](07a_torchrun_and_many_nodes.ipynb).
# <!-- opening:end -->
#
# **What this page is.** A casebook page, not a lesson. Each section is one message or mistake
# that people report, found by its symptom. A case quotes the symptom and names the thread it
# comes from. Then come what the message means, the fix, and a check. Some cases need a machine
# this page does not run on: Windows, a Mac's GPU, or NCCL. Those cases are explanations with
# their source in torch, and the page asserts the parts it can.
#
# Cases on this page:
#
# * [error: unrecognized arguments: --local-rank=0](#case-local-rank-argument)
# * [the destroy_process_group() warning at exit](#case-destroy-process-group-warning)
# * [gloo refuses my Mac's MPS tensors](#case-gloo-mps)
# * [all_gather_into_tensor is deprecated](#case-collective-names)
# * [use_libuv was requested but PyTorch was built without libuv support](#case-windows-libuv)
#
# Each claim is in bold, "Claim:", and the code cell right after it asserts it.
#
# Terms, from the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [local rank](../docs/GLOSSARY.md#local-rank), [backend](../docs/GLOSSARY.md#backend),
# [process group](../docs/GLOSSARY.md#process-group), [torchrun](../docs/GLOSSARY.md#torchrun).

# %% tags=["parameters"]
# Parameters: none; no profile changes this lesson (docs/RUNNER.md)

# %%
nproc_per_node = 2  # processes each launcher starts in the --local-rank case

# %%
import argparse
import contextlib
import importlib
import inspect
import io
import mmap
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.elastic.utils.distributed as elastic_store
import torch.distributed.run as torchrun

from helpers.engine import free_port, launch

rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module: dist.rendezvous is a function

t_notebook = time.perf_counter()
WORLD = 2
print(f"torch {torch.__version__}")


def in_torch_library(text, name):
    """True when one of torch's compiled libraries named like ``name`` (``libtorch_cpu.so`` on
    Linux, ``.dylib`` on macOS, ``torch_cpu.dll`` on Windows) holds the message text."""
    for path in (Path(torch.__file__).parent / "lib").glob(f"*{name}.*"):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(text.encode()) >= 0:
                return True
    return False

# %% [markdown]
# <a id="case-local-rank-argument"></a>
# ## Case: error: unrecognized arguments: --local-rank=0
#
# **Symptom.** "train.py: error: unrecognized arguments: --local-rank=0", with a script that
# declares `--local_rank`. From [XPixelGroup/BasicSR#626](https://github.com/XPixelGroup/BasicSR/issues/626)
# and [microsoft/LoRA#79](https://github.com/microsoft/LoRA/issues/79). The case extends
# section 1 of [07a](07a_torchrun_and_many_nodes.ipynb), torchrun's environment.
#
# **Why.** Since torch 2.0 the old launcher, `python -m torch.distributed.launch`, passes
# `--local-rank=N` with a dash. Scripts written before declare `--local_rank` with an underscore,
# and argparse does not treat them as one. `torchrun` passes no argument at all: it sets
# `LOCAL_RANK` in the environment. Yet torchrun's own docstring, in `torch/distributed/run.py`,
# says that it passes `--local-rank`. Running both launchers shows which is right.
#
# The program: each launcher runs a script that prints its arguments and `LOCAL_RANK`. The
# script imports nothing, so the launchers are all that start.

# %%
script = Path(tempfile.mkdtemp(prefix="casebook_10d_")) / "show_args.py"
# one os.write per line: under PYTHONUNBUFFERED, print's pieces from two ranks can interleave
script.write_text("import os, sys\nos.write(1, f\"ARGS {sys.argv[1:]} {os.environ.get('LOCAL_RANK')}\\n\".encode())\n")


def what_the_script_sees(launcher):
    cmd = [sys.executable, "-m", launcher, f"--nproc-per-node={nproc_per_node}", f"--master-port={free_port()}", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return sorted(line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("ARGS"))


SEEN = {launcher: what_the_script_sees(launcher) for launcher in ("torch.distributed.run", "torch.distributed.launch")}


def parse(declared, argv):
    """What an argparse parser that declares these option names makes of argv (or its error)."""
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument(*declared, type=int, default=0)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return vars(parser.parse_args(argv))
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]

# %% [markdown]
# **Claim:** torchrun, `torch.distributed.run`, passes no argument and sets `LOCAL_RANK` to
# `0 .. nproc_per_node − 1`. `torch.distributed.launch` passes `--local-rank=N` and sets
# `LOCAL_RANK` too. Yet torchrun's docstring says "torchrun will pass the --local-rank=<rank>
# argument". A parser that declares only `--local_rank` fails on `--local-rank=1` with
# "unrecognized arguments". One that declares both names reads 1 from either.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: what each launcher passes, and how argparse reads it
ranks = [str(r) for r in range(nproc_per_node)]
assert SEEN["torch.distributed.run"] == [f"[] {r}" for r in ranks], SEEN
assert SEEN["torch.distributed.launch"] == [f"['--local-rank={r}'] {r}" for r in ranks], SEEN
assert "will pass the ``--local-rank=<rank>`` argument" in inspect.getsource(torchrun)
assert parse(["--local_rank"], ["--local-rank=1"]) == "train.py: error: unrecognized arguments: --local-rank=1"
both = ["--local-rank", "--local_rank"]
assert parse(both, ["--local-rank=1"]) == parse(both, ["--local_rank=1"]) == {"local_rank": 1}
pd.Series({k: "; ".join(v) for k, v in SEEN.items()}, name="arguments and LOCAL_RANK the script sees").to_frame()

# %% [markdown]
# **Fix.** Read `int(os.environ["LOCAL_RANK"])` and launch with `torchrun`. Code that must run
# under both launchers declares both names:
# `parser.add_argument("--local-rank", "--local_rank", type=int)`.
#
# **Caught by** the error itself, at start-up.

# %% [markdown]
# <a id="case-destroy-process-group-warning"></a>
# ## Case: the destroy_process_group() warning at exit
#
# **Symptom.** "WARNING: `destroy_process_group()` was not called before program exit, which can
# leak resources." From [pytorch/examples#1387](https://github.com/pytorch/examples/pull/1387),
# "silence `destroy_proces_group()` warning", and [ai2cm/ace#679](https://github.com/ai2cm/ace/issues/679).
#
# **Why.** The warning comes from NCCL's process group, `ProcessGroupNCCL.cpp` in torch's source.
# It is printed when the program exits while the group still exists. Tearing a group down in the
# interpreter's exit can hang, or leave a peer waiting. `destroy_process_group()` ends the group
# while every rank is still alive. The "Shutdown" section of torch.distributed's documentation
# says so; [pytorch/pytorch#122358](https://github.com/pytorch/pytorch/pull/122358) added it.
# Gloo does not print the warning. `launch` destroys the group itself after your function
# returns.

# %%
WARNING_TEXT = "destroy_process_group() was not called before program exit"
nccl_library = list((Path(torch.__file__).parent / "lib").glob("*torch_cuda.*"))

# %% [markdown]
# **Claim:** the warning's text is not in torch's CPU library, where gloo lives. Where this torch
# has a CUDA library, where NCCL's process group lives, the text is there.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: where the warning's text lives in torch
assert not in_torch_library(WARNING_TEXT, "torch_cpu")
if nccl_library:
    assert in_torch_library(WARNING_TEXT, "torch_cuda")
print("CUDA library in this torch:", [p.name for p in nccl_library] or "none")

# %% [markdown]
# **Fix.** End `main()` with `dist.destroy_process_group()` on every rank, after the last
# collective. Put it in a `try`/`finally`, so that an exception also ends the group.
#
# **Caught by** the warning itself; it does not change any result.

# %% [markdown]
# <a id="case-gloo-mps"></a>
# ## Case: gloo refuses my Mac's MPS tensors
#
# **Symptom.** "DDP on my Mac: the collectives fail with MPS tensors." From
# [pytorch/pytorch#160732](https://github.com/pytorch/pytorch/issues/160732), "GLOO backend should
# have MPS capability". This page runs without a Mac GPU, so the case is an explanation.
#
# **Why.** A process group sends each collective to the backend registered for the tensor's
# device type. torch has two tables. `backend_capability` gives each backend's device types: gloo
# has `cpu` and `cuda`. `init_process_group("gloo")` registers gloo for those two only. So an
# `mps` collective fails with "No backend type associated with device type mps", from
# `ProcessGroup.hpp` in torch's source. The other table, `default_device_backend_map`, maps `mps`
# to gloo. It is used for a backend string such as `"cpu:gloo,mps:gloo"`, and on a Mac for
# `init_process_group()` with no backend. NCCL is for CUDA only.

# %%
from torch.distributed.distributed_c10d import BackendConfig

capability, default_map = dist.Backend.backend_capability, dist.Backend.default_device_backend_map
registered = {name: BackendConfig(name).get_device_backend_map() for name in ("gloo", "cpu:gloo,mps:gloo")}

# %% [markdown]
# **Claim:** in this torch, no backend's capability lists `mps`: gloo's is `cpu` and `cuda`. The
# default device map sends `mps` to gloo. Backend `"gloo"` registers `cpu` and `cuda`, and
# `"cpu:gloo,mps:gloo"` registers `mps` too. The message "No backend type associated with device
# type" is in torch's CPU library.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: both of torch's backend tables, and what a backend string registers
assert capability["gloo"] == ["cpu", "cuda"], capability
assert not any("mps" in devices for devices in capability.values()), capability
assert default_map["mps"] == "gloo", default_map
assert sorted(registered["gloo"]) == ["cpu", "cuda"] and registered["cpu:gloo,mps:gloo"]["mps"] == "gloo", registered
assert in_torch_library("No backend type associated with device type", "torch_cpu")
pd.DataFrame({"capability": {k: ", ".join(v) for k, v in capability.items()},
              "default for device": {k: ", ".join(d for d, b in default_map.items() if b == k) for k in capability}})

# %% [markdown]
# **Fix.** Copy to the CPU around each collective:
# `t_cpu = t.cpu(); dist.all_reduce(t_cpu); t.copy_(t_cpu)`. Or train on the CPU with gloo. Or
# name `"cpu:gloo,mps:gloo"`; this page cannot run gloo on MPS tensors without a Mac GPU. DDP
# itself cannot do that copy for you: its buckets live on the model's device.
#
# **Caught by** the error, at the first collective.

# %% [markdown]
# <a id="case-collective-names"></a>
# ## Case: all_gather_into_tensor is deprecated
#
# **Symptom.** "FutureWarning: `all_gather_into_tensor` is deprecated. Use `all_gather_single`."
# torch renamed the single-tensor collectives in 2026:
# [pytorch/pytorch#186123](https://github.com/pytorch/pytorch/pull/186123), "Rename distributed
# collective ops to _single naming scheme". A later change,
# [pytorch/pytorch#193874](https://github.com/pytorch/pytorch/pull/193874), drops the warning
# but keeps the old names. Code written for an older torch has only the old names. The case
# extends section 3 of [00a](00a_processes_and_collectives.ipynb), the collectives.
#
# The program: every name on 2 ranks, rank `r` contributing `r + 1`.

# %%
NEW_OLD = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def names_case(rank, world_size):
    out = {}
    for name in [*NEW_OLD, *NEW_OLD.values()]:
        gather = name.startswith("all_gather")
        output = torch.zeros(world_size if gather else 1)
        source = torch.tensor([float(rank + 1)]) if gather else torch.arange(world_size, dtype=torch.float32) + rank
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            getattr(dist, name)(output, source)
        out[name] = {"value": output.tolist(), "warns": any(issubclass(w.category, FutureWarning) for w in seen)}
    return out


present = {name: hasattr(dist, name) for pair in NEW_OLD.items() for name in pair}
NAMES = launch(names_case, WORLD, backend="gloo", timeout=120) if all(present.values()) else None

# %% [markdown]
# **Claim:** this torch has both the new names and the old ones. Each old name gives the same
# values as its new one on both ranks, and the new names raise no `FutureWarning`. Whether the
# old names still warn depends on the torch release: the table shows it.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: old and new collective names give the same values
assert all(present.values()), present
for r in range(WORLD):
    for new, old in NEW_OLD.items():
        assert NAMES[r][new]["value"] == NAMES[r][old]["value"], NAMES[r]
        assert not NAMES[r][new]["warns"], NAMES[r]
assert NAMES[0]["all_gather_single"]["value"] == [1.0, 2.0]
pd.DataFrame(NAMES[0]).T

# %% [markdown]
# **Fix.** On a torch that has them, call `all_gather_single` and `reduce_scatter_single`. Code
# that must run on older releases too picks the name that exists:
# `all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor`.
#
# **Caught by** the warning, or `hasattr(dist, "all_gather_single")`.

# %% [markdown]
# <a id="case-windows-libuv"></a>
# ## Case: use_libuv was requested but PyTorch was built without libuv support
#
# **Symptom.** "RuntimeError: use_libuv was requested but PyTorch was build without libuv
# support", at torchrun's start on Windows. From
# [pytorch/pytorch#139990](https://github.com/pytorch/pytorch/issues/139990), "PyTorch defaults to
# using libuv but is built without support for it on Windows", and
# [pytorch/pytorch#148283](https://github.com/pytorch/pytorch/issues/148283). This page runs on
# Linux, so the case is an explanation.
#
# **Why.** The rendezvous uses a key-value store, `TCPStore`, whose server runs on libuv by
# default. torch's Windows wheels are built without libuv. `init_process_group`'s `env://` path
# turns libuv off on Windows, in `torch/distributed/rendezvous.py`. But torchrun's store, in
# `torch/distributed/elastic/utils/distributed.py`, reads `USE_LIBUV` with a default of 1 on
# every platform.

# %%
def store_backend(**kwargs):
    """Whether a one-process TCPStore server, made with these arguments, runs on libuv."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, **kwargs)
    uses_libuv = store.libuvBackend
    del store
    return uses_libuv


LIBUV = {"default": store_backend(), "use_libuv=False": store_backend(use_libuv=False)}

# %% [markdown]
# **Claim:** the message is in torch's CPU library. `TCPStore`'s `use_libuv` defaults to `True`.
# torchrun's store reads `os.environ.get("USE_LIBUV", "1")`. The `env://` rendezvous defaults to
# `"0"` on Windows and to `"1"` elsewhere, and `?use_libuv=0` in the URL turns it off. On this
# Linux torch a default store runs on libuv, and `use_libuv=False` gives one without it.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the libuv message, the defaults, a store with and without libuv
assert in_torch_library("use_libuv was requested but PyTorch was built without libuv support", "torch_cpu")
assert "use_libuv: bool = True" in dist.TCPStore.__init__.__doc__
assert 'os.environ.get("USE_LIBUV", "1")' in inspect.getsource(elastic_store)
source = inspect.getsource(rendezvous._get_use_libuv_from_query_dict)
assert 'sys.platform == "win32"' in source and 'os.environ.get("USE_LIBUV", "0")' in source
assert rendezvous._get_use_libuv_from_query_dict({"use_libuv": "0"}) is False
assert LIBUV == {"default": True, "use_libuv=False": False}, LIBUV
pd.Series(LIBUV, name="store runs on libuv").to_frame()

# %% [markdown]
# **Fix.** On Windows, set `USE_LIBUV=0` before torchrun: `set USE_LIBUV=0` in cmd,
# `$env:USE_LIBUV = "0"` in PowerShell. For the URL form, use
# `init_method="tcp://...?use_libuv=0"`. Or run the course in WSL2, a Linux where torch has
# libuv.
#
# **Caught by** the error, at the rendezvous.

# %%
print(f"casebook 10d ran in {time.perf_counter() - t_notebook:.0f} s")

# %% [markdown]
# ## What we saw
#
# | symptom | cause | fix | check |
# | --- | --- | --- | --- |
# | [unrecognized `--local-rank`](#case-local-rank-argument) | the old launcher's dashed argument | `LOCAL_RANK`, or both names | the error at start-up |
# | [`destroy_process_group()` warning](#case-destroy-process-group-warning) | NCCL's group alive at exit | `destroy_process_group()` in `finally` | the warning |
# | [gloo and MPS](#case-gloo-mps) | backend `"gloo"` registers no `mps` | copy to the CPU around collectives | the error |
# | [deprecated collective names](#case-collective-names) | renamed in 2026 | `*_single`, or pick what exists | `hasattr` |
# | [`use_libuv` on Windows](#case-windows-libuv) | Windows wheels lack libuv | `USE_LIBUV=0` | the error |
#
# These fail loudly, or warn, and none changes a result silently. So the general checks of
# [CHECKS.md](../docs/CHECKS.md) have nothing to catch here. What helps is knowing which part of
# torch prints each message, so that the fix goes to the right place.

# %% [markdown]
# <!-- next:start -->
# **Next:** this is the casebook's last page; the others: [10a casebook: the training loop](10a_casebook_training_loop.ipynb), [10b casebook: the data](10b_casebook_data.ipynb), [10c casebook: models, checkpoints and FSDP2](10c_casebook_models_and_checkpoints.ipynb).
# <!-- next:end -->
