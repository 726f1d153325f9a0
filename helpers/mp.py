"""``import helpers.mp as mp``: the notebook-safe drop-in for ``torch.multiprocessing``'s process starting.

The public name of :mod:`helpers.engine.mp` (the code and its docs live there): ``helpers.mp`` is that
very module object, so ``mp.spawn``, ``mp.Process`` and the hints for names it does not cover
(``AttributeError`` naming what to write instead) are the engine's.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("helpers.engine.mp")
