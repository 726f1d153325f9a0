"""ddp-lab helpers: everything the notebooks call, and every function DDP workers run.

Worker functions reused by several notebooks or run under ``torchrun`` live in these modules;
:func:`helpers.engine.launch` also runs functions written in a notebook cell (sent to the
spawned ranks by value with cloudpickle).

Modules:
    launch   -- the notebook-safe DDP launcher (built on torch's elastic agent, as torchrun is)
    ranks    -- warm ranks: a process group on ipyparallel engines that lives across cells (%%px)
    data     -- MNIST from ``data/MNIST/raw`` with SHA-256 verification, and a fast in-memory path
    faults   -- deliberate faults (a rank that raises, hangs, exits, is killed) for tests and lessons
    sampler      -- notebook 03: tables and pictures of DistributedSampler's assignment; evaluation counts
    mnist_train  -- MNIST training as a module (single, DP, DDP; TrainConfig) for notebook 07, cluster and bench
    cluster      -- notebook 07 (a package): torchrun entry point (python -m helpers.engine.cluster), torchrun
                    agents started from Python, two-node rehearsal in network namespaces
    comm_hooks   -- notebook 07: the bytes DDP communication hooks send, by formula
    dataparallel -- notebooks 01 and 04: the chunks nn.DataParallel's scatter gives each GPU
    notebook     -- the learner recipe every notebook follows: parameter checks, exercises
    doctor       -- python3 -m helpers.doctor: a preflight (versions, launch, helpers.mp, warm ranks, MNIST,
                    JupyterLab and the kernel) that says ok or how to fix each line
"""

from pathlib import Path

#: Repository root (the folder holding ``data/``, ``notebooks/``, ``helpers/``).
REPO_ROOT = Path(__file__).resolve().parent.parent
