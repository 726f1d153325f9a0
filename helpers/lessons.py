"""The course's lessons, read from ``notebooks/lessons.toml``: the one list every tool uses.

The README's path table, each lesson's opening block and "Next" link, the runner and its
profiles, the site, the handout, the agendas and the tests all call :func:`load`; the 3-hour
workshop path (docs/TEACHING.md) is :func:`workshop`. A record's
keys are described at the top of the manifest; :func:`load` checks them and raises
:class:`ManifestError` naming the record and what to fix.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (requirements.txt installs tomli there)
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = REPO_ROOT / "notebooks" / "lessons.toml"
KINDS = ("lesson", "casebook")
PROFILES = ("smoke", "full", "gpu")
_KEYS = {"stem", "title", "outcome", "needs", "kind", *PROFILES}


class ManifestError(ValueError):
    """``notebooks/lessons.toml`` is unreadable or a record is incomplete or inconsistent."""


@dataclass(frozen=True)
class Lesson:
    """One record of the manifest. ``label`` is the stem's part before ``_`` (``06a``)."""

    stem: str
    title: str
    outcome: str
    needs: tuple[str, ...] = ()
    kind: str = "lesson"
    profiles: dict = field(default_factory=dict)  # {"full": {NAME: VALUE}, "gpu": {...}}

    @property
    def label(self) -> str:
        return self.stem.split("_", 1)[0]

    @property
    def name(self) -> str:
        """``06a training-loop pitfalls``: how links and tables name the lesson."""
        return f"{self.label} {self.title}"


def load(path: str | Path | None = None) -> list[Lesson]:
    """Every record of the manifest at ``path`` (default ``notebooks/lessons.toml``), in its order.

    Raises:
        ManifestError: the file is missing or not TOML, a record lacks ``stem``, ``title`` or
            ``outcome``, has an unknown key or kind, repeats a stem, or needs a label that no
            earlier record has.
    """
    path = Path(path) if path is not None else MANIFEST
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ManifestError(f"cannot read the lesson manifest {path}: {e}") from None
    lessons: list[Lesson] = []
    for i, rec in enumerate(data.get("lesson", []), 1):
        where = f"{path.name}, record {i} ({rec.get('stem', 'no stem')})"
        missing = [k for k in ("stem", "title", "outcome") if not isinstance(rec.get(k), str) or not rec[k]]
        unknown = sorted(set(rec) - _KEYS)
        if missing or unknown:
            raise ManifestError(f"{where}: " + "; ".join(
                ([f"needs a text for {', '.join(missing)}"] if missing else [])
                + ([f"unknown keys {unknown} (known: {sorted(_KEYS)})"] if unknown else [])))
        if not re.fullmatch(r"[0-9]{2}[a-z]?_[A-Za-z0-9_]+", rec["stem"]):
            raise ManifestError(f"{where}: a stem is two digits, an optional letter, '_' and a name "
                                f"(00a_processes_and_collectives), not {rec['stem']!r}")
        kind = rec.get("kind", "lesson")
        if kind not in KINDS:
            raise ManifestError(f"{where}: kind must be one of {KINDS}, not {kind!r}")
        known = {lesson.label for lesson in lessons}
        needs = tuple(rec.get("needs", []))
        if rec["stem"] in {lesson.stem for lesson in lessons}:
            raise ManifestError(f"{where}: the stem appears twice")
        if not set(needs) <= known:
            raise ManifestError(f"{where}: needs {sorted(set(needs) - known)}, which no earlier record is")
        profiles = {p: dict(rec[p]) for p in PROFILES if p in rec}
        lessons.append(Lesson(rec["stem"], rec["title"], rec["outcome"], needs, kind, profiles))
    if not lessons:
        raise ManifestError(f"{path} has no [[lesson]] record")
    return lessons


@dataclass(frozen=True)
class WorkshopPart:
    """One lesson's part of the 3-hour workshop path: the ``## N.`` sections taught (their labels,
    ``"1"``, ``"2b"``) and the exercises done in the room (numbers)."""

    lesson: str  # a label, 00a
    sections: tuple[str, ...]
    exercises: tuple[int, ...] = ()


def workshop(path: str | Path | None = None) -> list[WorkshopPart]:
    """The ``[[workshop]]`` records of the manifest, in teaching order.

    Raises:
        ManifestError: a record names no known lesson, no section, or an unknown key.
    """
    path = Path(path) if path is not None else MANIFEST
    labels = {lesson.label for lesson in load(path)}
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    parts = []
    for i, rec in enumerate(data.get("workshop", []), 1):
        where = f"{path.name}, workshop record {i} ({rec.get('lesson', 'no lesson')})"
        unknown = sorted(set(rec) - {"lesson", "sections", "exercises"})
        if unknown or rec.get("lesson") not in labels or not rec.get("sections"):
            raise ManifestError(f"{where}: needs lesson (a label of a record), sections (a list of the "
                                f"lesson's section numbers) and optionally exercises; unknown keys {unknown}")
        parts.append(WorkshopPart(rec["lesson"], tuple(str(s) for s in rec["sections"]),
                                  tuple(int(n) for n in rec.get("exercises", []))))
    return parts


def stems(kind: str | None = "lesson", path: str | Path | None = None) -> list[str]:
    """The stems in manifest order: only ``kind``'s (default the path's lessons), or all for None."""
    return [lesson.stem for lesson in load(path) if kind is None or lesson.kind == kind]


def by_label(lessons: list[Lesson]) -> dict[str, Lesson]:
    return {lesson.label: lesson for lesson in lessons}
