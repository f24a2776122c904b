"""The code of a local run's ``module:function`` rewards, as its driver checked it.

Without ``--workdir`` a local replica imports its reward module from the user's folder as
that folder is when the replica starts. A file edited during the run would then reach only
the replicas that start after the edit (a restart after a kill), which would score their
completions with other code than their peers. So the driver keeps the source of every module
it imported from the rewards' folder for its checks (:func:`snapshot`), puts it in the run
folder (``layout.reward_code_key``, one per content) and names it in each replica's
environment (``layout.ENV_REWARD_CODE``); a replica imports those modules from that source
(:func:`install`), under their own file names, so a restart runs what its peers run. Each
launch (the first, or a resume) takes its own copy: a resume runs the code as it is then,
checked again before any replica starts, which is how a reward is fixed and the run continued.
A module the checks never imported (a submodule imported later), and a data file a reward
reads, are read from the folder as they are. With ``--workdir`` the shipped copy pins all of
it instead, across resumes too.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import linecache
import os
import sys
import sysconfig
from collections.abc import Sequence
from typing import Any

from crf import layout

#: the module names a replica imports from its driver's copy (:func:`install`), once
_pinned: list[str] = []


def _installed_folders() -> set[str]:
    """The folders of installed packages and of Python's own library."""
    found = {os.path.realpath(p) for p in sysconfig.get_paths().values() if p}
    return found | {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}


def _user_roots(modules: Sequence[str], installed: set[str]) -> list[str]:
    """The folders (sys.path entries) the rewards' ``modules`` were imported from, leaving
    out the ``installed`` ones: the user's own folders."""
    roots: list[str] = []
    for module in modules:
        path = getattr(sys.modules.get(module.split(".")[0]), "__file__", None)
        if not path:
            continue
        path = os.path.realpath(path)
        root = os.path.dirname(path)
        if os.path.basename(path) == "__init__.py":
            root = os.path.dirname(root)
        if not any(_under(root, p) for p in installed) and root not in roots:
            roots.append(root)
    return roots


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def snapshot(modules: Sequence[str]) -> bytes | None:
    """The source of every module this process imported from the folders of the rewards'
    ``modules`` (:func:`crf.replica.rewards.reward_modules`; after the checks imported and
    called them), as JSON; None when none of them comes from a folder of the user's (an
    installed package). crf's own modules are left out (the replicas run the driver's crf)."""
    installed = _installed_folders()
    roots = _user_roots(modules, installed)
    kept: dict[str, dict[str, Any]] = {}
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py") or name.split(".")[0] == "crf":
            continue
        real = os.path.realpath(path)  # a virtualenv may sit inside the user's folder
        if not any(_under(real, r) for r in roots) or any(_under(real, p) for p in installed):
            continue
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError:
            continue
        is_package = os.path.basename(path) == "__init__.py"
        kept[name] = {"path": os.path.abspath(path), "package": is_package,
                      "source": base64.b64encode(source).decode()}  # fmt: skip
    if not kept:
        return None
    return json.dumps({"modules": kept}, sort_keys=True).encode()


def key_of(data: bytes) -> str:
    """The run-folder key of a :func:`snapshot`."""
    return layout.reward_code_key(hashlib.sha256(data).hexdigest()[:16])


class _Source(importlib.machinery.SourceFileLoader):
    """A module loaded from the driver's copy of its source, under its own file name (so a
    traceback and ``__file__`` name the user's file); no bytecode is read or written."""

    def __init__(self, fullname: str, path: str, source: bytes) -> None:
        super().__init__(fullname, path)
        self._source = source

    def get_data(self, path: str) -> bytes:
        if path == self.path:
            return self._source
        raise OSError(f"{path}: read from the driver's copy of {self.path}")

    def path_stats(self, path: str) -> Any:
        raise OSError("no bytecode cache for the driver's copy")  # compiled from the copy


class _Copies(importlib.abc.MetaPathFinder):
    """Finds the modules of the driver's copy, ahead of every other finder."""

    def __init__(self, modules: dict[str, dict[str, Any]]) -> None:
        self.modules = modules

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        entry = self.modules.get(fullname)
        if entry is None:
            return None
        file, source = entry["path"], base64.b64decode(entry["source"])
        # a traceback quotes the lines that ran, not the file as it is now
        lines = source.decode("utf-8", "replace").splitlines(keepends=True)
        linecache.cache[file] = (len(source), None, lines, file)
        where = [os.path.dirname(file)] if entry["package"] else None
        return importlib.util.spec_from_file_location(
            fullname, file, loader=_Source(fullname, file, source),
            submodule_search_locations=where,
        )  # fmt: skip


def install() -> None:
    """In a replica (or rollout worker) whose driver kept the reward code
    (``layout.ENV_REWARD_CODE``): import those modules from that copy from now on. Once per
    process; nothing without the variable (a cloud run, a --workdir run, the launcher)."""
    key = os.environ.get(layout.ENV_REWARD_CODE)
    if not key or _pinned:
        return
    from crf.store import RunStore

    data = json.loads(RunStore(os.environ[layout.ENV_RUN_URI]).get(key))
    modules = data["modules"]
    sys.meta_path.insert(0, _Copies(modules))
    _pinned[:] = sorted(modules)
