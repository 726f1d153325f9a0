"""ddp-lab helpers: everything the notebooks call, and every function DDP workers run. Two rooms.

The engine (``helpers/engine/``, tests in ``tests/engine/``): the notebook-safe distributed runtime.
Its whole public surface, what notebooks, course helpers, ``ci/`` and the docs import
(``tests/course/test_fence.py`` checks it; docs/ARCHITECTURE.md has the module map)::

    from helpers.engine import launch, worker_device   # fn(rank, world_size, ...) on N real ranks
    import helpers.mp as mp                            # torch.multiprocessing's spawn/Process, notebook-safe
    from helpers.engine import start_ranks             # warm ranks across cells (%%px)
    import helpers.engine.cluster as cluster           # notebook 07a: torchrun agents, two-node rehearsal

    helpers.engine: launch, spawn, start_ranks, current_ranks, WarmRanks, worker_device,
        main_from_env (the torchrun entry of a launch worker), resolve_backend, BACKENDS,
        threads_per_rank, MAX_RANKS_PER_CPU, free_port, loopback_interface, end_processes,
        leftover_children, stop_fork_server, QuietElastic, faults (deliberate faults), and the
        errors LaunchError, WorkerError, LaunchTimeout, LaunchInterrupted, RanksTimeout, NoRanks,
        OversubscriptionWarning
    helpers.mp: spawn, Process, get_context, get_start_method, set_start_method
    helpers.engine.cluster: torchrun_command, run_agents, run_job, failure_report, cluster_commands,
        TwoNodeNetwork, netns_available, ... (its __all__); each takes the entry module as
        ``module=``, so the engine names no course module

The course (``helpers/*.py``, ``bench/``, ``doctor/``; tests in ``tests/course/``):
    data           -- MNIST from ``data/MNIST/raw`` with SHA-256 verification, and a fast in-memory path
    sampler        -- notebook 03: tables and pictures of DistributedSampler's assignment; evaluation counts
    dataparallel   -- notebooks 01 and 04: the chunks nn.DataParallel's scatter gives each GPU
    mnist_steps    -- an MNIST run's optimizer steps, without torch (TrainConfig and 07a/07b's checks)
    mnist_config   -- the MNIST models and TrainConfig
    mnist_train    -- MNIST training as a module (single, DP, DDP) for notebooks 04, 07a, 07b and bench
    mnist_eval     -- distributed accuracy and peak memory
    mnist_torchrun -- notebook 07a: what every torchrun rank runs, ``torchrun ... -m helpers.mnist_torchrun``
                      (MNIST training, failure injection), and the engine's run_job / cluster_commands for it
    costmodel      -- notebook 05b: the alpha-beta cost model of ring all-reduce
    comm_hooks     -- notebook 07b: the bytes DDP communication hooks send, by formula
    notebook       -- the learner recipe every notebook follows: parameter checks, exercises
    param_types    -- the parameter-type rule shared by the notebooks' checks and the runner
    replicas       -- assert_in_sync(model): are the replicas of the learner's own model the same on every rank
    captured       -- notebook 06: a launch's warnings and dumps as one line, the full text folded under it
    jupyter_hooks  -- JupyterLab's pre-save hook (jupyter_lab_config.json): saving leaves git clean
    bench          -- notebooks 05a, 05b (a package): the benchmarks, python3 -m helpers.bench
    doctor         -- python3 -m helpers.doctor: a preflight (versions, launch, helpers.mp, warm ranks, MNIST,
                      JupyterLab and the kernel) that says ok or how to fix each line
    checkout       -- one copy of the course, one install: which copy's helpers and ci a process runs

``import helpers`` imports only ``helpers.checkout`` (no torch), and raises
:class:`helpers.checkout.CheckoutMismatch` in a working folder that belongs to another copy of the course.
"""

from pathlib import Path

from helpers.checkout import CheckoutMismatch, mismatch

#: Repository root (the folder holding ``data/``, ``notebooks/``, ``helpers/``).
REPO_ROOT = Path(__file__).resolve().parent.parent

_problem = mismatch(REPO_ROOT)
if _problem:  # e.g. a kernel in another copy's notebooks/: this copy's code would run there, silently
    raise CheckoutMismatch(_problem, name=__name__)
