"""What to do, by error: :data:`HINTS`, the one table of (pattern, hint) that adds a line to a
rank's :class:`helpers.engine.errors.WorkerError` (re-exported there), and :func:`hint_for`.

Each hint is tested with the real error (tests/engine/test_errors.py): triggered in real ranks, or,
where this machine cannot raise it (an MPS tensor, a Windows build), matched against torch's own
message read from the installed torch at test time.
"""

from __future__ import annotations

import re

__all__ = ["HINTS", "hint_for"]


#: ``(pattern, hint)``: the first pattern found (``re.search``) in a failing rank's
#: ``"<type>: <message>"`` adds ``"What to do: <hint>"`` to its :class:`WorkerError`. A hint that depends
#: on the call that ran the ranks is ``{caller: hint}`` (``"launch"``: launch, warm ranks, spawn; ``"simulate"``).
HINTS: list[tuple[re.Pattern, str | dict[str, str]]] = [
    (re.compile(r"trying to initialize the default process group twice"),
     {"launch": "launch and warm ranks have already initialised the default process group for your code: remove "
                "init_process_group and destroy_process_group from it (dist.all_reduce and DDP use that group), "
                "or run code that sets up its own group with helpers.mp.spawn.",
      "simulate": "simulate has already initialised each rank's default process group (its threaded backend): "
                  "remove init_process_group and destroy_process_group from your code (dist.all_reduce and DDP "
                  "use that group), or run code that sets up its own group with helpers.mp.spawn."}),
    (re.compile(r"environment variable (RANK|WORLD_SIZE|LOCAL_RANK) expected"
                r"|KeyError: '(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE)'"),
     {"launch": "this is torchrun-style code, which reads RANK and WORLD_SIZE from the environment; helpers.mp.spawn, "
                "like torch.multiprocessing.spawn, passes the rank as fn's first argument instead: use it "
                "(init_process_group(backend, rank=rank, world_size=world_size)), or run the code with "
                "helpers.engine.launch, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does.",
      "simulate": "this is torchrun-style code, which reads RANK and WORLD_SIZE from the environment; simulated "
                  "ranks are threads of one process, sharing one os.environ, so simulate sets neither: use fn's "
                  "first two parameters, rank and world_size, or run the code with helpers.engine.launch, which "
                  "sets them as torchrun does."}),
    (re.compile(r"environment variable MASTER_(ADDR|PORT) expected"),
     "init_process_group's env:// rendezvous needs both: set os.environ['MASTER_ADDR'] = 'localhost' and "
     "os.environ['MASTER_PORT'] = '12355' (any free port) before calling it, as the DDP tutorial's "
     "setup() does, or use helpers.engine.launch, which sets them."),
    (re.compile(r"^TypeError: \S+\(\) (takes|missing) .*positional argument"),
     {"launch": "if this is your worker function: launch and warm ranks call fn(rank, world_size, *args, **kwargs), "
                "helpers.mp.spawn calls fn(rank, *args) as torch.multiprocessing.spawn does; give it those first "
                "parameters (e.g. def fn(rank, world_size): ...).",
      "simulate": "if this is your worker function: simulate calls fn(rank, world_size, *args, **kwargs); give it "
                  "those first parameters (e.g. def fn(rank, world_size): ...)."}),
    (re.compile(r"Detected mismatch between collectives on ranks"),
     "TORCH_DISTRIBUTED_DEBUG=DETAIL found the ranks in different collectives (the OpType of each above, "
     "e.g. ALLREDUCE on one rank, BARRIER on another): every rank must call the same collectives in the "
     "same order; look for a collective inside `if rank == ...:` or a loop that runs a different number "
     "of times on some rank."),
    (re.compile(r"EADDRINUSE|[Aa]ddress already in use"),
     "another program (or a run still ending) holds the port in MASTER_PORT: before init_process_group, set "
     "os.environ['MASTER_PORT'] to another port (one free now: `from helpers.engine import free_port`, "
     "str(free_port())), or use helpers.engine.launch, which picks a free port for every launch."),
    # GPU code on a machine without one: CUDA builds say "no NVIDIA driver"; CPU builds (torch 2.13's, seen)
    # "not compiled" for .cuda() and "Cannot access accelerator device" for .to(rank)
    (re.compile(r"ProcessGroupNCCL is only supported with GPUs"),
     "backend nccl needs a GPU per rank and this machine has none: use \"gloo\" "
     "(init_process_group(\"gloo\", rank=rank, world_size=world_size)), and drop the code's .to(rank), "
     ".cuda() and torch.cuda.set_device(rank): on CPU, models and tensors stay where they are. "
     "docs/OWN_CODE.md, \"Code from tutorials\", lists each tutorial's changes."),
    (re.compile(r"Found no NVIDIA driver on your system|Torch not compiled with CUDA enabled"
                r"|Cannot access accelerator device when none is available"),
     "this line moves something to a GPU and this machine has none: drop .cuda() and .to(rank) (an int "
     "device is a GPU's index) and torch.cuda.set_device(rank), or write .to(worker_device()) (from "
     "helpers.engine: cpu under gloo); backend \"gloo\" for nccl. docs/OWN_CODE.md, \"Code from "
     "tutorials\", lists each tutorial's changes."),
    (re.compile(r"device_ids and output_device arguments only work with single-device"),
     "the model is on CPU, and device_ids names a GPU: on CPU wrap it as DDP(model), without device_ids "
     "(and output_device); device_ids is for a model on one GPU: DDP(model.to(rank), device_ids=[rank])."),
    # torch/distributed/optim/zero_redundancy_optimizer.py, ZeroRedundancyOptimizer.state_dict()
    (re.compile(r"Optimizer state has not been consolidated on this rank"),
     "ZeroRedundancyOptimizer keeps a shard of the optimizer state on each rank: call "
     "opt.consolidate_state_dict(to=0) on every rank (it is a collective), then opt.state_dict() and "
     "torch.save on rank 0 only; a save on rank 0 alone, as for a plain optimizer, is not enough."),
    # an MPS tensor in a collective: a "gloo" group has no backend for mps ("No backend type ..."), and
    # gloo itself takes only cpu and cuda tensors ("ProcessGroupGloo::<op>: unsupported device type")
    (re.compile(r"(No backend type associated with device type|unsupported device type) mps"),
     "torch.distributed has no backend for Apple's GPU (mps): gloo takes CPU and CUDA tensors, nccl "
     "only CUDA. Train with the model and data on the CPU (gloo), or move each tensor to the CPU for "
     "the collective (t.cpu()) and back (.to(\"mps\"))."),
    # Windows builds of torch without libuv (TCPStore): the message says USE_LIBUV=0 but not where
    # a rank killed by SIGKILL that its code did not send: Linux's out-of-memory killer sends it (dmesg says so,
    # where a learner may read it); warm ranks and launch name the signal the same way
    (re.compile(r"^killed by SIGKILL|a signal such as SIGKILL"),
     "a SIGKILL your code did not send is often the out-of-memory killer (Linux ends the largest process when "
     "memory runs out; `dmesg` shows \"Out of memory: Killed process\" where you may read it): use fewer ranks, "
     "a smaller model or batch, or close other programs."),
    (re.compile(r"use_libuv was requested but PyTorch was built without libuv support"),
     "this PyTorch build (Windows) has no libuv for its TCP store: set os.environ[\"USE_LIBUV\"] = \"0\" "
     "before init_process_group (or before starting torchrun or Jupyter), or add ?use_libuv=0 to a "
     "tcp:// init_method."),
]


def hint_for(text: str, caller: str = "launch") -> str | None:
    """The hint of the first :data:`HINTS` pattern found in ``text``, worded for ``caller`` (``"launch"``,
    ``"simulate"``), or ``None``."""
    for pattern, hint in HINTS:
        if pattern.search(text):
            return hint.get(caller, hint["launch"]) if isinstance(hint, dict) else hint
    return None
