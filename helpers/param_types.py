"""The parameter-type rule: which values a notebook parameter accepts, and the message for one it
does not. One rule for the notebook's ``check_parameters`` (:mod:`helpers.notebook`) and the
runner's check before any kernel starts (``ci.planning.type_check_parameters``)."""

from __future__ import annotations

import ast
import json
import numbers
from typing import Any

__all__ = ["PARAMETER_TYPES", "NOTEBOOK_FIX", "NOTEBOOK_TEXT_NOTE", "accepts", "type_problem"]

#: The parameter types the checks know, by name (the runner reads a name from a parameters cell:
#: the type of a literal default, or an annotation).
PARAMETER_TYPES: dict[str, type] = {t.__name__: t for t in (int, float, bool, str, list, tuple, set, dict)}

_TYPE_WORDS = {
    int: ("an int", "a whole number (no decimal point, no quotes)", "2"),
    float: ("a float", "a number (an int is fine too)", "0.01"),
    bool: ("a bool", "True or False, without quotes", "True"),
    str: ("a str", "text in quotes", '"linear"'),
    list: ("a list", "a list in brackets", "[1, 2]"),
    tuple: ("a tuple", "a tuple in parentheses", "(1, 2)"),
    set: ("a set", "a set in braces (a list is fine too)", "{1, 2}"),
    dict: ("a dict", "a dict in braces", '{"a": 1}'),
}

#: How to pass a right value, in a notebook: the parameters cell, or papermill's ``-p NAME VALUE``
#: ``{name}``, ``{example}`` (a Python literal) and ``{cli}`` (the same for a shell) are filled in.
NOTEBOOK_FIX = "`{name} = {example}` in the parameters cell (with papermill: `-p {name} {cli}`)"
#: The note added when the value is text that would be right without its quotes.
NOTEBOOK_TEXT_NOTE = "the value arrived as text: no quotes, and with papermill use -p, not -r."


def accepts(value: Any, expected: type | tuple[type | None, ...]) -> bool:
    """Whether ``value`` is acceptable for a parameter of type ``expected``: the one rule, used
    by :func:`check_parameters` in the notebook and by the runner's check before it starts
    anything (``ci.planning.type_check_parameters``).

    ``expected`` is a type or a tuple of types (``None`` in it allows ``None``). An ``int`` is
    accepted for a ``float``; a ``bool`` is **not** an ``int`` (nor a ``float``); numpy integers
    and floats are accepted; a list and a tuple are accepted for each other (JSON, papermill's
    parameter injection and ``-p`` all carry a tuple as a list), and both for a ``set``.
    """
    for t in expected if isinstance(expected, tuple) else (expected,):
        if t is None or t is type(None):
            ok = value is None
        elif t is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        elif t is float:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        elif t in (list, tuple):
            ok = isinstance(value, (list, tuple))
        elif t is set:
            ok = isinstance(value, (list, tuple, set, frozenset))
        else:
            ok = isinstance(value, t)
        if ok:
            return True
    return False


def _describe_types(types: tuple[type, ...]) -> str:
    words = [_TYPE_WORDS.get(t, (f"a {t.__name__}",))[0] if t is not type(None) else "None" for t in types]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _example(value: Any, types: tuple[type, ...], text_note: str) -> tuple[str, str]:
    """``(literal, note)``: a value of the right type to suggest, derived from the wrong one when
    possible, and why."""
    first = next(t for t in types if t is not type(None))
    if isinstance(value, str):  # e.g. papermill -r (raw) or quotes around a number
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            parsed = None
        if parsed is not None and accepts(parsed, first):
            return repr(parsed), text_note
    if first is int and isinstance(value, float) and value.is_integer():
        return str(int(value)), ""
    if first in (int, float) and isinstance(value, bool):
        return _TYPE_WORDS[first][2], "True/False is a bool, not a number."
    return _TYPE_WORDS.get(first, ("", "", "..."))[2], ""


def _types(name: str, expected: Any) -> tuple[type, ...]:
    types = expected if isinstance(expected, tuple) else (expected,)
    types = tuple(type(None) if t is None else t for t in types)
    if not types or not all(isinstance(t, type) for t in types) or all(t is type(None) for t in types):
        raise TypeError(f"check_parameters({name}=...): the second item must be a type or a tuple of "
                        f"types, got {expected!r}")
    return types


def type_problem(name: str, value: Any, expected: type | tuple[type | None, ...], *, fix: str = NOTEBOOK_FIX,
                 source: str | None = None, text_note: str = NOTEBOOK_TEXT_NOTE) -> str | None:
    """``None`` when ``value`` is acceptable for ``expected`` (:func:`accepts`), else the one-line
    message both parameter checks give::

        parameter 'world_size' must be an int, but it is 2.5 (float). Pass a whole number
        (no decimal point, no quotes), e.g. `world_size = 2` in the parameters cell, or
        `-p world_size 2` with papermill.

    ``fix`` says where to pass a right value (a template, see :data:`NOTEBOOK_FIX`; the runner
    gives its own ``-p NAME=VALUE`` and profiles-file forms, and may use ``{json}``, the example
    as JSON); ``source`` says where the value came from (shown as ``(from ...)``); ``text_note``
    is added when the value is text that would be right without its quotes.

    Raises:
        TypeError: ``expected`` is not a type or a tuple of types (``None`` allowed).
    """
    types = _types(name, expected)
    if accepts(value, types):
        return None
    need = _describe_types(types)
    how = _TYPE_WORDS.get(next(t for t in types if t is not type(None)), ("", "a value of that type"))[1]
    example, note = _example(value, types, text_note)
    cli = example.strip('"') if str in types else example  # the shell eats the quotes anyway
    try:
        as_json = json.dumps(ast.literal_eval(example))
    except (ValueError, SyntaxError, TypeError):
        as_json = example
    where = f" (from {source})" if source else ""
    return (f"parameter {name!r} must be {need}, but it is {value!r} ({type(value).__name__}){where}. "
            f"Pass {how}, e.g. " + fix.format(name=name, example=example, cli=cli, json=as_json) + "."
            + (f" Note: {note}" if note else ""))
