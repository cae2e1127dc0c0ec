"""Policy plug-ins on the command line: modules that register policies when imported.

A plug-in registers itself where Python code does (``EVICTION_POLICIES["mine"] = Mine``, and
the same for prefetch, selection and retention) at its module's top level. The command line
imports the modules named by ``tiercache --plugin MODULE`` (repeatable) and by the
environment variable ``TIERCACHE_PLUGINS`` (comma-separated) before it reads any policy
name; a MODULE is a dotted module name on ``sys.path`` or the path of a ``.py`` file.

The command line passes the modules on to the processes it starts, in ``TIERCACHE_PLUGINS``:
``bench decode`` runs each set-up in a process of its own, which imports them. A policy
registered some other way exists in one process only; ``bench decode`` refuses it by name
(``check_shared``), where its set-up failed after the others had run.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Iterable

ENV = "TIERCACHE_PLUGINS"

# spec -> the (kind, name) entries of the registries it added or replaced when imported
_loaded: dict = {}


def specs_from_env() -> list:
    """The plug-in modules ``TIERCACHE_PLUGINS`` names (none when unset or empty)."""
    return [spec.strip() for spec in os.environ.get(ENV, "").split(",") if spec.strip()]


def _registries() -> dict:
    from tiercache.policies import EVICTION_POLICIES, PREFETCH_POLICIES, RETENTION_POLICIES, SELECTION_POLICIES

    return {"eviction": EVICTION_POLICIES, "prefetch": PREFETCH_POLICIES, "selection": SELECTION_POLICIES,
            "retention": RETENTION_POLICIES}


def _entries() -> set:
    return {(kind, name, id(factory)) for kind, registry in _registries().items()
            for name, factory in registry.items()}


def load(specs: Iterable[str], source: str = "--plugin") -> None:
    """Import each plug-in module of ``specs`` once. One that cannot be imported (not found,
    or its own error) is a ``ValueError`` naming it and ``source``; one that registers no
    policy is one too: a typo in a module name that happened to import something else
    would otherwise leave the policy unknown with no word of why."""
    for spec in specs:
        if spec in _loaded:
            continue
        before = _entries()
        try:
            module = _import(spec)
        except Exception as exc:  # noqa: BLE001 - the plug-in's, named
            raise ValueError(f"{source} {spec!r}: cannot import it ({type(exc).__name__}: {exc})") from exc
        # what it added or replaced, and what its classes are registered as (a module imported
        # before, by the caller, adds nothing now)
        added = {(kind, name) for kind, name, _ in _entries() - before}
        added |= {(kind, name) for kind, registry in _registries().items() for name, factory in registry.items()
                  if getattr(factory, "__module__", None) == module.__name__}
        if not added:
            raise ValueError(f"{source} {spec!r}: imported, but it registered no policy (a plug-in adds its "
                             f"classes to tiercache.policies' registries, e.g. EVICTION_POLICIES['mine'] = Mine, "
                             f"when it is imported)")
        _loaded[spec] = added


def _import(spec: str):
    if not (spec.endswith(".py") or os.sep in spec):
        return importlib.import_module(spec)
    path = os.path.abspath(spec)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file {path!r}")
    name = "tiercache_plugin_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(path)[0])
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look a class's module up there
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def check_shared(kind: str, name: str, where: str) -> None:
    """A ``kind`` policy registered as ``name`` that a process of its own can make too: one
    shipped with tiercache or registered by a plug-in module loaded here. Else a ValueError
    for ``where`` (the benchmark that runs set-ups in processes of their own)."""
    from tiercache.guard import is_plugin_class

    factory = _registries()[kind].get(name)
    if factory is None:
        return  # unknown: TierConfig names it, with the known ones
    if isinstance(factory, type) and not is_plugin_class(factory):
        return
    if any((kind, name) in added for added in _loaded.values()):
        return
    raise ValueError(f"{where}: the {kind} policy {name!r} is registered in this process only, and {where} runs "
                     f"each set-up in a process of its own; register it at a module's top level and name the "
                     f"module with tiercache --plugin MODULE (or {ENV}=MODULE)")
