"""``python -m helpers.engine.cluster ...``: the torchrun entry point of notebook 07a.

What each rank runs is the course's MNIST training (:mod:`helpers.mnist_torchrun`), which the
engine runs by name (:data:`ENTRY`), so no engine module imports a course module.
"""

import importlib

#: the module whose ``main()`` every rank runs
ENTRY = "helpers.mnist_torchrun"

if __name__ == "__main__":
    importlib.import_module(ENTRY).main()
