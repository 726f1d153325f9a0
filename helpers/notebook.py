"""What lesson cells import besides the lesson: parameter checks, exercise checks, GPU/CPU claims
(tests/course/test_learner.py). The rules a lesson follows are ``ci/lessons.py``'s table."""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from helpers.param_types import type_problem

__all__ = ["check_parameters", "check_value", "check_answer", "seal", "sealed_check",
           "assert_close_once", "UNPROVEN", "NOT_PROVEN", "gpu_claim", "cpu_claim", "CHECKS",
           "record_checks"]


def check_parameters(**params: tuple[Any, type | tuple[type | None, ...]]) -> None:
    """Check the types of a notebook's parameters, in the cell right after the ``parameters`` cell:
    ``check_parameters(world_size=(world_size, int), lr=(lr, float))``. A type or a tuple of types
    (``None`` in it allows ``None``), judged as the runner does (``helpers.param_types.accepts``:
    an ``int`` is a ``float``, a ``bool`` is not an ``int``, a list is a tuple).

    Raises:
        TypeError: one line per wrong parameter (name, expected type, value, what to pass
            instead); or a malformed call (not a ``(value, type)`` pair).
    """
    for name, spec in params.items():
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise TypeError(f"check_parameters({name}=...) expects a (value, type) pair, got {spec!r}")
    problems = [p for name, spec in params.items() if (p := type_problem(name, *spec))]
    if problems:
        raise TypeError("wrong parameter type" + ("s" if len(problems) > 1 else "") + ":\n  "
                        + "\n  ".join(problems))


def check_value(name: str, value: Any, ok: bool, requirement: str) -> None:
    """Raise ``ValueError`` when a parameter has the right type but an unusable value: ``ok`` is the
    condition, ``requirement`` what the value must be, in words:
    ``check_value("world_size", world_size, world_size >= 2, "at least 2")``.

    Raises:
        ValueError: ``parameter 'world_size' = 1 is not allowed: it must be at least 2. ...``
    """
    if not ok:
        raise ValueError(f"parameter {name!r} = {value!r} is not allowed: it must be "
                         f"{requirement}. Change it in the parameters cell, then run the cells "
                         f"from there again (with papermill: `-p {name} VALUE`).")


def _plain(value: Any) -> Any:
    """Tensors, numpy arrays and scalars, pandas Series -> Python numbers and lists."""
    plain = (str, bytes, bool, int, float, Fraction, list, tuple, dict, set, frozenset, type(None))
    if isinstance(value, plain) or not callable(getattr(value, "tolist", None)):
        return value
    try:
        return value.tolist()
    except Exception:  # noqa: BLE001 - not convertible: compare as is
        return value


def _as_number(value: Any) -> Any:
    """A learner's number; also accepts text such as ``"7/12"`` or ``"0.5"``."""
    try:
        return Fraction(value.strip()) if isinstance(value, str) else value
    except (ValueError, ZeroDivisionError):
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _place(path: tuple, labels: tuple) -> str:
    """Where in the answer ``path`` (indices and keys) points, named with ``labels`` as in
    :func:`check_answer`; levels past ``labels`` are written ``[i]``."""
    words, tail = [], ""
    for level, key in enumerate(path):
        label = labels[level] if level < len(labels) else None
        if isinstance(label, str):
            words.append(label.format(key))
        elif label is not None and isinstance(key, int) and 0 <= key < len(label):
            words.append(str(label[key]))
        else:
            tail += f"[{key!r}]"
    return " ".join(words) + tail


def _values(n: int) -> str:
    return f"{n} value" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class _Sealed:
    """An expected leaf (a number, text or bool) kept only as the SHA-256 of its rounded form."""
    kind: str
    digest: str


def _digest(kind: str, value: Any, digits: int, abs_tol: float) -> str:
    return hashlib.sha256(_rounded(kind, value, digits, abs_tol).encode()).hexdigest()


def _rounded(kind: str, value: Any, digits: int, abs_tol: float) -> str | None:
    """The text a leaf is digested as: a number on the grid of ``abs_tol``'s power of ten, then to
    ``digits`` significant digits; text casefolded; None when ``value`` is not of ``kind``."""
    if kind == "bool":
        return repr(value) if isinstance(value, bool) else None
    if kind == "text":
        return value.strip().casefold() if isinstance(value, str) else None
    if kind == "repr":  # anything else (None, an object): compared by its repr
        return repr(value)
    value = _as_number(value)
    if not _is_number(value):
        return None
    grid = 10.0 ** math.ceil(math.log10(max(abs_tol, 1e-300)))
    return f"{round(float(value) / grid) * grid + 0.0:.{digits}g}"


def seal(expected: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> Any:
    """``expected`` with every number, text and bool replaced by a digest of its rounded form
    (to ``-log10(rel_tol)`` significant digits, 1 to 6): the lists, tuples and dict keys stay, so
    :func:`check_answer` still says which entry is wrong. Sets are digested whole; any other
    value by its ``repr``."""
    digits = min(6, max(1, round(-math.log10(max(rel_tol, 1e-12)))))
    expected = _plain(expected)
    if isinstance(expected, dict):
        return {k: seal(v, rel_tol, abs_tol) for k, v in expected.items()}
    if isinstance(expected, (list, tuple)):
        return type(expected)(seal(v, rel_tol, abs_tol) for v in expected)
    if isinstance(expected, (set, frozenset)):
        expected = repr(sorted(map(repr, expected)))
    kind = ("bool" if isinstance(expected, bool) else "number" if _is_number(expected)
            else "text" if isinstance(expected, str) else "repr")
    return _Sealed(f"{kind}:{digits}", _digest(kind, expected, digits, abs_tol))


def sealed_check(key: str, answer: Any, expected: Any, **options: Any) -> None:
    """:func:`check_answer` for a learner, given only :func:`seal` of ``expected``: the check
    cells of the handout call this (ci/student_copies.py), so neither a ``check_answer`` the
    learner redefines nor any kernel name ever sees the expected value."""
    tolerances = options.get("rel_tol", 1e-6), options.get("abs_tol", 1e-9)
    check_answer(key, answer, seal(expected, *tolerances), **options)


def _difference(answer: Any, expected: Any, rel_tol: float, abs_tol: float, path: tuple = (),
                labels: tuple = ()) -> str | None:
    """``None`` when ``answer`` matches ``expected``, else a short reason (which never quotes
    the expected value, so it does not give the answer away). A list or tuple asked for must be
    given as a list or tuple: a tensor or an array where a list is asked is a wrong type.
    A :func:`seal` ed leaf matches an answer of the same rounded form (or within ``rel_tol``)."""
    where = _place(path, labels)
    at = f" at {where}" if where else ""
    if isinstance(expected, _Sealed):
        kind, digits = expected.kind.split(":")
        if isinstance(answer, (set, frozenset)) and kind == "text":
            answer = repr(sorted(map(repr, answer)))
        value = _as_number(_plain(answer)) if kind == "number" else _plain(answer)
        if _rounded(kind, value, int(digits), abs_tol) is None:
            wanted = dict(bool="True or False", text="text").get(kind, "a number")
            return f"expected {wanted}{at}, you gave {answer!r}"
        # near a rounding edge, the answer's neighbours within rel_tol or abs_tol round to its side
        near = [value] if kind != "number" else [
            value, value * (1 - rel_tol), value * (1 + rel_tol), value - abs_tol, value + abs_tol]
        digests = {_digest(kind, v, int(digits), abs_tol) for v in near}
        return None if expected.digest in digests else f"{answer!r}{at} is not it"
    if isinstance(expected, (list, tuple)) and not isinstance(answer, (list, tuple)) \
            and getattr(answer, "tolist", None) is not None:
        return (f"expected a list of {_values(len(expected))}{at}, you gave a {type(answer).__name__}: "
                "turn it into a list (`.tolist()`)")
    answer, expected = _plain(answer), _plain(expected)
    gave = f"you gave {answer!r} ({type(answer).__name__})"
    if isinstance(expected, bool):
        if not isinstance(answer, bool):
            return f"expected True or False{at}, {gave}"
        return None if answer == expected else f"True/False{at} is the other way round"
    if _is_number(expected):
        answer = _as_number(answer)
        if not _is_number(answer):
            return f"expected a number{at}, {gave}"
        if math.isclose(float(answer), float(expected), rel_tol=rel_tol, abs_tol=abs_tol):
            return None
        return f"{answer!r}{at} is too {'large' if float(answer) > float(expected) else 'small'}"
    if isinstance(expected, str):
        if not isinstance(answer, str):
            return f"expected text{at}, {gave}"
        same = answer.strip().casefold() == expected.strip().casefold()
        return None if same else f"{answer!r}{at} is not it"
    if isinstance(expected, (set, frozenset)):
        if not isinstance(answer, (set, frozenset, list, tuple)):
            return f"expected a set{at}, you gave {type(answer).__name__}"
        return None if set(answer) == set(expected) else f"the set{at} is not it"
    if isinstance(expected, dict):
        if not isinstance(answer, dict):
            return f"expected a dict{at}, you gave {type(answer).__name__}"
        if set(answer) != set(expected):
            return (f"expected the keys {sorted(map(str, expected))}{at}, "
                    f"you gave {sorted(map(str, answer))}")
        pairs = [(k, answer[k], expected[k]) for k in expected]
    elif isinstance(expected, (list, tuple)):
        if not isinstance(answer, (list, tuple)):
            return f"expected a list of {_values(len(expected))}{at}, {gave}"
        if len(answer) != len(expected):
            return f"expected {len(expected)} values{at}, you gave {len(answer)}"
        pairs = list(zip(range(len(expected)), answer, expected))
    else:
        return None if answer == expected else f"{answer!r}{at} is not it"
    found = (_difference(a, e, rel_tol, abs_tol, (*path, k), labels) for k, a, e in pairs)
    return next(filter(None, found), None)


def _crash_report(key: str, error: BaseException, max_lines: int = 8) -> str:
    """What a check cell prints when the learner's code raised ``error``: that it crashed, the
    error's first ``max_lines`` lines (a rank's :class:`helpers.engine.WorkerError` says the rank
    and the learner's own frames), and what to do."""
    first, *rest = str(error).strip().splitlines() or [""]
    if not first.startswith("rank "):
        first = f"{type(error).__name__}: {first}".rstrip(": ")
    return "\n".join([f"{key}: your code crashed (not a wrong value): {first}",
                      *("  " + ln for ln in rest[:max_lines - 1]),
                      f"{key}: fix the error above, then run this cell again."])


def check_answer(key: str, answer: Any, expected: Any, *, strict: bool = False, rel_tol: float = 1e-6,
                 abs_tol: float = 1e-9, hint: str | None = None, run: Any = None, labels: tuple = ()) -> None:
    """Compare an exercise answer with the expected value and say so.

    The learner's check (``strict=False``) only prints, never raising because of ``answer``:
    ``ex1: not answered yet ...`` (None), ``ex1: correct`` or ``ex1: not yet: <why> <hint>``. A
    solution's (``strict=True``) prints ``ex1: solution checked`` or raises ``AssertionError``
    with both values, or when only the :func:`seal` ed ``expected`` rejects it, saying so.

    Matching: numbers with ``math.isclose`` (``Fraction``, numpy / torch scalars, text like
    ``"7/12"``); lists and tuples element by element (tensors and arrays as lists); dicts key by
    key; sets as sets; text ignoring case and surrounding spaces; bools exactly.

    ``run`` turns an answer that is code into the value to compare (``run=lambda fn: launch(fn,
    3, data)``); not called while ``answer`` is None; what it raises is printed as a crash (the
    rank's own frames, no ``hint``), or propagates with strict=True. ``labels`` name a nested
    answer's places, one per level, a text with ``{}`` or a sequence of names: with
    ``labels=("rank {}'s", ("weight", "bias", "rank_buffer"))`` a wrong ``answer[1][2][0]`` is
    ``rank 1's rank_buffer[0]``.
    """
    if run is not None and answer is not None:
        try:
            answer = run(answer)
        except Exception as e:  # the learner's code failed: say so, do not raise
            if strict:
                raise
            from helpers.engine import NoRanks, RanksStopped
            ranks = isinstance(e, (NoRanks, RanksStopped))  # the ranks, not the learner's code
            print(f"{key}: could not run your code: {e}" if ranks else _crash_report(key, e))
            return
    if strict:
        if answer is None:
            raise AssertionError(f"{key}: the solution left its answer as None")
        reason = _difference(answer, expected, rel_tol, abs_tol, (), tuple(labels))
        if reason is not None:
            raise AssertionError(f"{key}: the solution gives {_plain(answer)!r} but the expected "
                                 f"value is {_plain(expected)!r} ({reason}): the solution or the "
                                 "expected value is wrong")
        sealed = seal(expected, rel_tol, abs_tol)
        if _difference(answer, sealed, rel_tol, abs_tol, (), tuple(labels)) is not None:
            raise AssertionError(f"{key}: the solution matches the expected value but not its digest, "
                                 "which the handout's check compares (helpers.notebook.seal)")
        print(f"{key}: solution checked")
        return
    if answer is None:
        print(f"{key}: not answered yet (replace None with your answer, then run this cell again)")
        return
    try:
        reason = _difference(answer, expected, rel_tol, abs_tol, (), tuple(labels))
    except Exception as e:  # noqa: BLE001 - never raise because of the learner's value
        reason = f"could not compare your answer ({type(e).__name__}: {e})"
    print(f"{key}: correct" if reason is None
          else f"{key}: not yet: {reason}." + (f" Hint: {hint}" if hint else ""))


def assert_close_once(actual: Any, expected: Any, *, what: str, rerun_from: str, **tolerances: Any) -> None:
    """``torch.testing.assert_close`` for a value that a cell run twice accumulates (``.grad``):
    when ``actual`` is k times ``expected`` (k >= 2) the error says so, that the cell ran k times,
    and to re-run from ``rerun_from`` (the cell that recreates or zeroes it).

    Raises:
        AssertionError: the values differ.
    """
    import torch
    from torch.testing import assert_close

    try:
        assert_close(actual, expected, **tolerances)
    except AssertionError as e:
        a, x = (torch.as_tensor(v, dtype=torch.float64) for v in (actual, expected))
        xx = float((x * x).sum())
        k = round(float((a * x).sum()) / xx) if a.shape == x.shape and xx > 0 else 0
        if k >= 2 and torch.allclose(a, k * x, rtol=1e-4, atol=1e-6):
            raise AssertionError(
                f"{what} is {k} times the expected value: gradients accumulate (backward adds "
                f"into .grad), so the cell with the backward ran {k} times on the same model. "
                f"Re-run from {rerun_from}, then the cells after it in order.") from None
        raise e


#: The start of the line a check cell prints when its claim cannot be proven on this machine;
#: ``ci/gpu_claims.py`` finds it in executed notebooks.
NOT_PROVEN = "not proven here:"
#: ``{"claim": ..., "needs": "GPU" or "CPU", "why": ...}`` for every claim this kernel could not
#: prove, in the order the check cells ran.
UNPROVEN: list[dict[str, str]] = []


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_claim(claim: str, gpus: int = 1) -> bool:
    """Whether the check of a ``**Claim (GPU):**`` runs here (at least ``gpus`` CUDA devices), as
    its asserts' condition: ``if gpu_claim("real DP ..."): assert ...``; else ``_not_proven``."""
    found = _cuda_devices()  # who proves it is said in learner words, no script named
    return found >= gpus or _not_proven(
        claim, "GPU", f"needs {'a GPU' if gpus == 1 else f'{gpus} GPUs'} (found {found}); a GPU run proves it")


def cpu_claim(claim: str) -> bool:
    """Whether the check of a ``**Claim (CPU):**`` (true only without GPUs) runs here (no CUDA
    device); else :func:`_not_proven`."""
    found = _cuda_devices()
    return found == 0 or _not_proven(claim, "CPU", f"true only without a GPU (found {found}); the CPU runs prove it")


def _not_proven(claim: str, needs: str, why: str) -> bool:
    """The refusal of :func:`gpu_claim` and :func:`cpu_claim`: records the claim in :data:`UNPROVEN`,
    prints the ``not proven here:`` line the runner and ci/gpu_check.py read, returns False."""
    UNPROVEN.append({"claim": claim, "needs": needs, "why": why})
    print(f"{NOT_PROVEN} {why}. Claim ({needs}): {claim}")
    return False


#: The general checks, one per invariant, as docs/CHECKS.md's columns.
CHECKS = ("against_one_process", "data_coverage", "assert_in_sync")


def record_checks(page: str, rows: dict) -> Path:
    """Write what the general checks said about a page's cases to ``build/checks/<page>.json``
    (``python3 -m ci.checks_table`` renders docs/CHECKS.md), after the asserts that make it true.

    Args:
        page: the notebook's stem, e.g. ``"06d_silent_bugs"``.
        rows: case -> {check in :data:`CHECKS`: what it said}; a text starting ``"caught"`` counts
            as caught, any other (``"not caught: ..."``, ``"passes"``) not.

    Raises:
        ValueError: an unknown check name (before anything is written).
    """
    import json

    from helpers.lessons import REPO_ROOT

    unknown = sorted({c for said in rows.values() for c in said} - set(CHECKS))
    if unknown:
        raise ValueError(f"record_checks: unknown check(s) {unknown}; use {list(CHECKS)}")
    path = REPO_ROOT / "build" / "checks" / f"{page}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return path
