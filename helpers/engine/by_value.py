"""What may be sent to the ranks, and the refusal that names the variable when it may not.

``launch``, :mod:`helpers.mp` and warm ranks send ``fn, args, kwargs`` with ``cloudpickle``: what is
defined in ``__main__`` (a cell), in a function, and lambdas go *by value* (with the cell code and
values they use); what importable modules define goes *by reference*, as ``pickle`` sends it.

Before pickling, :func:`serialise_call` walks what the learner named (arguments, globals and closure
variables of by-value functions, attributes of cell classes, two levels into containers) and refuses,
naming the variable, what belongs to one process: an open file, a lock, a socket, a generator, a CUDA
tensor; anything else that does not pickle likewise. Code sent by value keeps its file name and a
cell's source lines (cloudpickle would name it ``<dynamic-code>``), so a rank's traceback shows the line.

Reference: https://github.com/cloudpipe/cloudpickle (``_should_pickle_by_reference``).
"""

from __future__ import annotations

import functools
import io
import linecache
import os
import socket
import sys
import threading
import types
from typing import Any

import cloudpickle

from helpers.engine.errors import LaunchError

__all__ = ["dumps", "serialise_call", "unsendable"]

_DYNAMIC = "<dynamic-code>"  # what cloudpickle names the file of every code object it sends


def _code_in(code: types.CodeType, filename: str, lines: list[str] | None) -> types.CodeType:
    """In the receiving process: ``code`` with its own file name back, and the file's ``lines``
    in ``linecache`` (a notebook cell's, which exist nowhere else), so tracebacks show the line."""
    if lines is not None and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, but code sent by value keeps its file name (and a cell's source)."""

    def reducer_override(self, obj):
        if type(obj) is types.CodeType and obj.co_filename != _DYNAMIC:
            entry = linecache.cache.get(obj.co_filename)
            lines = None
            if entry is not None and len(entry) == 4 and not os.path.exists(obj.co_filename):
                lines = entry[2]  # the same list for every code of the cell: pickled once
            return _code_in, (obj.replace(co_filename=_DYNAMIC), obj.co_filename, lines)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, except that code sent by value keeps its file name, and a
    notebook cell's code its source lines (so that a rank's traceback shows the cell's line);
    ``cloudpickle.loads`` (or ``pickle.loads``) reads it where ``helpers`` is importable."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _by_value(obj: Any) -> bool:
    """True when cloudpickle sends ``obj`` (a function or class) by value: it is defined in
    ``__main__`` (a notebook cell), inside another function, or is a lambda; False when the
    worker can import it by name (helpers, torch, a test module)."""
    try:
        return not cloudpickle.cloudpickle._should_pickle_by_reference(obj)
    except Exception:  # noqa: BLE001 - an odd object: let the pickling attempt decide
        return False


def _code_names(code) -> set[str]:
    """Global names a code object (and the functions, lambdas, comprehensions nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _kind_of(value: Any) -> str | None:
    """Why ``value`` cannot be sent to another process, or None if nothing is known against it."""
    torch = sys.modules.get("torch")  # no torch imported: no tensor or module to check
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu" and value.device.type != "meta":
            return f"a {value.device.type.upper()} tensor on {value.device} (torch.Tensor)"
        return None
    if torch is not None and isinstance(value, torch.nn.Module):
        for what, tensors in (("parameters", value.parameters()), ("buffers", value.buffers())):
            for t in tensors:
                if t.device.type not in ("cpu", "meta"):
                    return f"an nn.Module ({type(value).__name__}) with {what} on {t.device}"
        return None
    if isinstance(value, (types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType)):
        return f"a generator ({type(value).__name__})"
    if isinstance(value, io.IOBase):
        return f"an open file ({type(value).__module__}.{type(value).__name__})"
    if isinstance(value, socket.socket):
        return f"a socket ({type(value).__module__}.{type(value).__name__})"
    if isinstance(value, _LOCK_TYPES):
        return f"a lock ({type(value).__module__}.{type(value).__name__})"
    return None


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Semaphore,
               threading.Event)

_SEND_ADVICE = {
    "tensor": "Move it to the CPU first (`x.cpu()`, `model.cpu()`) or create it inside the worker on "
              "`worker_device()`.",
    "other": "Open files, locks, sockets and generators belong to one process: create it inside the "
             "worker function (each rank opens its own) and pass plain data (a path, numbers, CPU "
             "tensors) instead.",
}


def _named_values(fn: Any, args: tuple, kwargs: dict):
    """``(where, value)`` for everything sent to the workers that a learner named: each argument,
    and, for a function sent by value, the globals it uses and its closure variables (recursively
    through the cell-defined functions and classes it uses)."""
    for i, a in enumerate(args):
        yield f"positional argument {i}", a
    for k, v in kwargs.items():
        yield f"keyword argument {k!r}", v
    seen: set[int] = set()

    def refs(obj: Any, owner: str, depth: int):
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            for i, a in enumerate(obj.args):
                yield f"argument {i} of the partial {owner}", a
            for k, v in obj.keywords.items():
                yield f"keyword {k!r} of the partial {owner}", v
            yield from refs(obj.func, owner, depth + 1)
            return
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    yield from refs(f, owner, depth + 1)
            return
        if isinstance(obj, types.MethodType):
            yield f"the object {owner} is bound to", obj.__self__
            obj = obj.__func__
        if isinstance(obj, types.FunctionType):
            if not _by_value(obj):
                return
            name = f"`{obj.__qualname__}`"
            code = obj.__code__
            for g in sorted(_code_names(code)):
                if g in obj.__globals__:
                    value = obj.__globals__[g]
                    yield f"the global `{g}` used by {name}", value
                    yield from refs(value, f"`{g}`", depth + 1)
            for var, cell in zip(code.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell (assigned later)
                    continue
                yield f"the closure variable `{var}` of {name}", value
                yield from refs(value, f"`{var}`", depth + 1)
            return
        if isinstance(obj, type):
            if not _by_value(obj):
                return
            for attr, value in vars(obj).items():
                if not (attr.startswith("__") and attr.endswith("__")):
                    yield f"the class attribute `{obj.__qualname__}.{attr}`", value
                yield from refs(value, f"`{obj.__qualname__}.{attr}`", depth + 1)
            return
        if _by_value(type(obj)):  # an instance of a cell-defined class: its class and attributes
            yield from refs(type(obj), owner, depth + 1)

    yield from refs(fn, "fn", 0)


def unsendable(where: str, value: Any):
    """``(where, kind, item)`` for ``value`` and each item inside it that :func:`_kind_of` knows cannot be sent."""
    for inner_where, inner in _walk(where, value):
        if kind := _kind_of(inner):
            yield inner_where, kind, inner


def _walk(where: str, value: Any, depth: int = 0):
    """``value`` and the items of the lists, tuples, sets and dicts inside it (two levels)."""
    yield where, value
    if depth >= 2:
        return
    if isinstance(value, dict):
        for k, v in list(value.items())[:200]:
            yield from _walk(f"{where}[{k!r}]", v, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(value)[:200]):
            yield from _walk(f"{where}[{i}]" if not isinstance(value, (set, frozenset)) else f"an item of {where}",
                             v, depth + 1)


def _refuse(where: str, kind: str, fn_name: str) -> LaunchError:
    advice = _SEND_ADVICE["tensor" if "tensor" in kind or "nn.Module" in kind else "other"]
    return LaunchError(
        f"cannot send {where} to the worker processes: it is {kind}. {advice}"
        + (f" (fn: {fn_name})" if fn_name and fn_name not in where else "")
    )


def serialise_call(fn: Any, args: tuple, kwargs: dict) -> bytes:
    """``cloudpickle.dumps((fn, args, kwargs))``, after refusing, with the variable named, what
    cannot be sent to another process.

    Raises:
        LaunchError: an argument, a global, a closure variable (or an item inside one) is an open
            file, a lock, a socket, a generator or a CUDA tensor, or cannot be pickled.
    """
    fn_name = getattr(fn, "__qualname__", type(fn).__name__)
    named = list(_named_values(fn, args, kwargs))
    for where, value in named:
        for inner_where, kind, _ in unsendable(where, value):
            raise _refuse(inner_where, kind, fn_name)
    try:
        return dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - find which named value is the culprit
        error = e
    for where, value in [("fn", fn), *named]:
        if isinstance(value, (types.FunctionType, type)):
            continue  # their contents are named separately
        try:
            cloudpickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            raise LaunchError(
                f"cannot send {where} ({type(value).__name__}) to the worker processes: it cannot be "
                f"pickled ({type(e).__name__}: {e}). {_SEND_ADVICE['other']}"
            ) from None
    raise LaunchError(
        f"cannot send fn {fn_name!r} and its arguments to the worker processes: "
        f"{type(error).__name__}: {error}. {_SEND_ADVICE['other']}"
    ) from None
