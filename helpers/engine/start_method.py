"""The hint for a cell-defined class or function that a ``spawn`` or ``forkserver`` process cannot import.

Under ``spawn`` or ``forkserver`` (``DataLoader(..., multiprocessing_context="spawn")``) a cell's class is
pickled by reference and cannot be found by name: ``Can't get attribute 'Points' on <module '__main__'>``.
The same lookup fails plain ``torch.multiprocessing.spawn`` of a cell's function (the kernel gets only
``ProcessExitedException``): :func:`install_spawn_hint` (on importing :mod:`helpers.engine.errors`)
adds :func:`spawn_exit_hint`'s "What to do" line to that traceback: use ``helpers.mp``.
"""

from __future__ import annotations

import re
import sys

__all__ = ["install_spawn_hint", "main_object_hint", "spawn_exit_hint", "with_hint"]

# Python 3.6-3.13: "attribute lookup X on __main__ failed"; 3.14: "it's not found as __main__.X"
_PATTERNS = (
    re.compile(r"Can't pickle <class '__main__\.(?P<name>[\w.]+)'>: (?:attribute lookup|it's not found)"),
    re.compile(r"Can't pickle <function (?P<name>[\w.]+) at 0x[0-9a-fA-F]+>: "
               r"(?:attribute lookup \S+ on __main__ failed|it's not found as __main__\.)"),
    re.compile(r"Can't get attribute '(?P<name>[\w.]+)' on <module '__main__'"),
)


def main_object_hint(message: str) -> str | None:
    """What to do, if ``message`` (an exception's text) says a ``__main__`` object could not be
    pickled or found by name; else ``None``."""
    for pattern in _PATTERNS:
        found = pattern.search(message)
        if found:
            name = found["name"]
            return (f"Hint: {name} is defined in a notebook cell (__main__), which a process started with "
                    f"'spawn' or 'forkserver' cannot import. Keep the default start method (leave out "
                    f"multiprocessing_context, or pass multiprocessing_context='fork'), or move {name} into "
                    f"a .py module and import it.")
    return None


def with_hint(message: str) -> str:
    """``message``, with :func:`main_object_hint`'s hint on a new line when there is one."""
    hint = main_object_hint(message)
    return message if hint is None else f"{message}\n{hint}"


def _spawned_function(tb):
    """The ``fn`` that ``torch.multiprocessing``'s ``start_processes`` (behind ``spawn``) was starting,
    from the frames of traceback ``tb``, and its start method; ``(None, None)`` if not found."""
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "start_processes" and "multiprocessing" in frame.f_code.co_filename:
            return frame.f_locals.get("fn"), frame.f_locals.get("start_method")
        tb = tb.tb_next
    return None, None


def spawn_exit_hint(error: BaseException, tb) -> str | None:
    """What to do, if ``error`` (with traceback ``tb``) is ``torch.multiprocessing.spawn``'s
    ``ProcessExitedException`` for a function defined in an interactive ``__main__`` (a notebook
    cell, which has no file a spawned child could re-import); else ``None``."""
    fn, method = _spawned_function(tb)
    fn = getattr(fn, "func", fn)  # functools.partial
    main = sys.modules.get("__main__")
    if (type(error).__name__ != "ProcessExitedException" or fn is None or method == "fork"
            or getattr(fn, "__module__", None) != "__main__" or getattr(main, "__file__", None)):
        return None
    name = getattr(fn, "__qualname__", repr(fn))
    return (f"What to do: torch.multiprocessing's {method or 'spawn'} starts fresh interpreters, which look "
            f"{name} up in __main__ (each printed \"AttributeError: Can't get attribute '{name}' on <module "
            f"'__main__'>\"); a notebook's __main__ is no file, so a function defined in a cell is not there. "
            f"Write `import helpers.mp as mp` instead of `import torch.multiprocessing as mp`: the same "
            f"mp.spawn, which sends {name} by value (docs/OWN_CODE.md, \"Code from tutorials\").")


def _show_with_spawn_hint(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler: the usual traceback, then :func:`spawn_exit_hint`'s line."""
    try:
        stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
        hint = spawn_exit_hint(value, tb)
        sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # as showtraceback does
        shell._showtraceback(etype, value, [*stb, hint] if hint else stb)
    except Exception:  # noqa: BLE001 - IPython would unregister the handler: its own traceback instead
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)


def install_spawn_hint(shell=None) -> bool:
    """Have IPython ``shell`` (default: the running one) show :func:`spawn_exit_hint`'s line under a
    ``ProcessExitedException``'s traceback (``InteractiveShell.set_custom_exc``). Does nothing outside
    IPython, nor where the shell already has a custom handler of its own; returns whether it is set."""
    if shell is None:
        if "IPython" not in sys.modules:
            return False
        try:
            from IPython import get_ipython
            shell = get_ipython()
        except Exception:  # noqa: BLE001 - a broken IPython: as in a script
            return False
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    from torch.multiprocessing.spawn import ProcessExitedException

    if shell.custom_exceptions == (ProcessExitedException,):
        return True
    if shell.custom_exceptions:
        return False
    shell.set_custom_exc((ProcessExitedException,), _show_with_spawn_hint)
    return True
