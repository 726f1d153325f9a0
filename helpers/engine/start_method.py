"""The hint for a cell-defined class or function that a ``spawn`` or ``forkserver`` process cannot import.

Inside a rank the start method is the platform's default (Linux before Python 3.14: ``fork``), so a
``DataLoader``'s workers get a cell-defined ``Dataset`` without pickling it. Under ``spawn`` or
``forkserver`` (``DataLoader(..., multiprocessing_context="spawn")``) it is pickled by reference,
and a class defined in ``__main__`` (a notebook cell) cannot be found by name:
``PicklingError: Can't pickle <class '__main__.Points'>: attribute lookup Points on __main__ failed``
in the rank, or ``AttributeError: Can't get attribute 'Points' on <module '__main__'>`` in the child.
"""

from __future__ import annotations

import re

__all__ = ["main_object_hint", "with_hint"]

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
