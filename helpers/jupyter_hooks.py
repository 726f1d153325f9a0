"""Saving a lesson from JupyterLab leaves it byte-identical to git: a Jupyter server pre-save hook.

When JupyterLab opens a notebook it copies the kernel's ``language_info`` into the notebook's
metadata, ``version`` (the Python version, ``"3.11.7"``) included, and autosaves it; jupytext,
which saves the paired ``.py`` twin, writes its own version into the twin's header
(``jupytext_version: 1.19.6``). Both differ from machine to machine, so opening a lesson would
dirty ``git status``. :func:`pre_save` (configured in ``jupyter_lab_config.json`` at the
repository root, which the README's ``jupyter lab`` command loads) removes
``language_info.version`` from every notebook saved and keeps the ``jupytext_version`` line a
``.py`` file already has on disk. The committed notebooks are in :func:`committed_form`
(``python3 -m ci.lessons check``'s ``saved-form`` rule), so a save writes the same bytes.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["committed_form", "pre_save"]

#: What ipykernel reports as ``language_info``, less ``version``: the committed form.
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3"}
_JUPYTEXT_VERSION = re.compile(r"^#\s+jupytext_version: .*$", re.M)


def committed_form(metadata: dict) -> dict:
    """``metadata`` (a notebook's) with ``language_info`` less its machine-specific ``version``."""
    out = dict(metadata)
    if isinstance(out.get("language_info"), dict):
        out["language_info"] = {k: v for k, v in out["language_info"].items() if k != "version"}
    return out


def pre_save(model: dict, path: str = "", contents_manager: Any = None, **kwargs: Any) -> None:
    """Jupyter server ``ContentsManager.pre_save_hook``: edits ``model`` in place (see the module
    docstring). Never raises for a model it does not know."""
    content = model.get("content")
    if model.get("type") == "notebook" and isinstance(content, dict) and isinstance(content.get("metadata"), dict):
        content["metadata"] = committed_form(content["metadata"])
    elif model.get("type") == "file" and path.endswith(".py") and isinstance(content, str) and contents_manager:
        os_path = contents_manager._get_os_path(path) if hasattr(contents_manager, "_get_os_path") else None
        if not os_path or not os.path.isfile(os_path):
            return
        with open(os_path, encoding="utf-8") as f:
            on_disk = _JUPYTEXT_VERSION.search(f.read(4096))
        if on_disk:
            model["content"] = _JUPYTEXT_VERSION.sub(lambda _: on_disk.group(0), content, count=1)
