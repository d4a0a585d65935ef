"""Run a function right after a module finishes loading, without importing that module first.

`import hf_tev` does not import transformers; what hf_tev adds to transformers (the `generate` route, the
drafter's `AutoModel` entry) is put in place the moment the transformers module it extends finishes executing,
or at once when that module is already loaded. One finder on `sys.meta_path` serves every hook.

A hook is named as (module, function name), looked up when it runs, so that after `importlib.reload` of an
hf_tev module (Jupyter's autoreload) the current function runs, and registering it again adds nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys


def after_import(module_name: str, hook_module: str, hook_name: str) -> None:
    """Call `hook_module.hook_name(module)` once `module_name` is loaded (now if it is) and again every time it is
    executed anew: an `importlib.reload` of a module loaded before hf_tev replaces what the hook put in place,
    so the hook is kept for the module whichever was imported first."""
    _PostImportFinder.installed().hooks.setdefault(module_name, set()).add((hook_module, hook_name))
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        _run(hook_module, hook_name, loaded)


def _run(hook_module: str, hook_name: str, module) -> None:
    getattr(importlib.import_module(hook_module), hook_name)(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each hooked module so that its hooks run right after the module executes."""

    def __init__(self):
        self.hooks: dict[str, set[tuple[str, str]]] = {}

    @classmethod
    def installed(cls) -> _PostImportFinder:
        # by name: after a reload of this module the finder of the earlier copy is still there, and enough
        for finder in sys.meta_path:
            if type(finder).__qualname__ == cls.__qualname__:
                return finder
        finder = cls()
        sys.meta_path.insert(0, finder)
        return finder

    def find_spec(self, name, path, target=None):
        # The hooks stay: a module executed again (`importlib.reload`, or imported anew after leaving
        # `sys.modules`) gets them again, as its new classes and functions need them.
        if name not in self.hooks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_run_hooks(module):
            exec_module(module)
            for hook_module, hook_name in sorted(self.hooks.get(name, ())):
                _run(hook_module, hook_name, module)

        spec.loader.exec_module = exec_and_run_hooks
        return spec
