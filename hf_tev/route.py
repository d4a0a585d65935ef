"""The `generate` route: `model.generate(..., assistant_model=drafter, tev_config=...)` goes to the tree decoder.

`import hf_tev` installs one wrapper around `transformers.GenerationMixin.generate`; a call that carries
`tev_config=` (or `custom_generate=hf_tev.tree_speculative_decode`), or passes a DFlash drafter as
`assistant_model=` (without `speculation_type="dflash"`, transformers' own chain path), becomes transformers'
supported `custom_generate` call of `hf_tev.generation.tree_speculative_decode`; every other call passes through
untouched.

What keeps the route safe:
- Importing hf_tev does not import transformers. When transformers is not loaded yet, a post-import hook
  installs the wrapper the moment `transformers.generation.utils` finishes loading.
- The wrapper is found by identity (`GenerationMixin._hf_tev_route`), never by an attribute a foreign
  `functools.wraps` could copy: `enable()` under `importlib.reload` (Jupyter autoreload) re-activates the one
  wrapper instead of wrapping it again.
- `disable()` restores the original `generate` when our wrapper is the outermost; when another library wrapped
  `generate` after us, their wrapper stays and ours becomes a pure pass-through (re-activated by `enable()`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_HOOKED_MODULE = "transformers.generation.utils"
_ROUTE_ATTRIBUTE = "_hf_tev_route"  # on GenerationMixin: our wrapper, the one source of truth
# enable() was called last (read by the post-import hook through sys.modules; a reload keeps the value)
_wanted = globals().get("_wanted", False)


def _make_route(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if not generate._hf_tev_active or not wants_tree_decoding(self, kwargs):
            return original(self, *args, **kwargs)
        from .generation import routed_generate  # the decoder (and transformers) load on first use only

        return routed_generate(original, self, *args, **kwargs)

    generate._hf_tev_active = True
    return generate


def wants_tree_decoding(model, kwargs: dict) -> bool:
    """Whether a `generate` call goes to the tree decoder: it carries `tev_config=` or
    `custom_generate=hf_tev.tree_speculative_decode`, or it passes a DFlash drafter as `assistant_model=`
    (the tree settings then come from the generation config's `tev_config`, else `TEVConfig()`) without
    `speculation_type="dflash"`, which asks for transformers' own chain path."""
    custom = kwargs.get("custom_generate")
    if isinstance(custom, str):  # a Hub or folder recipe (ours included) handles its own arguments
        return False
    if kwargs.get("tev_config") is not None or getattr(custom, "_hf_tev_decode", False):
        return True
    if custom is not None or not getattr(kwargs.get("assistant_model"), "_hf_tev_drafter", False):
        return False
    return generation_setting(model, kwargs, "speculation_type") != "dflash"


def generation_setting(model, kwargs: dict, name: str):
    """The value of generate option `name` for a call, as generate resolves it: the keyword argument, else the
    passed `generation_config`'s, else the model's `generation_config`'s (None when unset everywhere)."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _mixin(load: bool):
    """`GenerationMixin`, or None when transformers' generation module is not loaded and `load` is False."""
    module = sys.modules.get(_HOOKED_MODULE)
    if module is None:
        if not load:
            return None
        module = importlib.import_module(_HOOKED_MODULE)
    return module.GenerationMixin


def _installed_route(mixin):
    return mixin.__dict__.get(_ROUTE_ATTRIBUTE)


def _chain(function):
    """`function` and every function it wraps (`__wrapped__`, as set by functools.wraps)."""
    seen = []
    while function is not None and not any(function is f for f in seen):
        seen.append(function)
        function = getattr(function, "__wrapped__", None)
    return seen


def _install(mixin) -> None:
    route = _installed_route(mixin)
    if route is not None and any(f is route for f in _chain(mixin.generate)):
        route._hf_tev_active = True  # already in place (an earlier import, or a reloaded module)
        return
    route = _make_route(mixin.generate)
    mixin.generate = route
    setattr(mixin, _ROUTE_ATTRIBUTE, route)


def enable() -> None:
    """Route `generate` calls that carry `tev_config=` into the tree decoder (done on `import hf_tev`).

    Idempotent. If transformers is not imported yet, the route is installed when it is."""
    global _wanted
    _wanted = True
    mixin = _mixin(load=False)
    if mixin is None:
        _PostImportHook.register()
    else:
        _install(mixin)


def disable() -> None:
    """Take the route out: restore transformers' own `generate`, or, when another library has wrapped
    `generate` after hf_tev, leave their wrapper in place and make ours a pure pass-through."""
    global _wanted
    _wanted = False
    mixin = _mixin(load=False)
    if mixin is None:
        return
    route = _installed_route(mixin)
    if route is None:
        return
    if mixin.generate is route:
        mixin.generate = route.__wrapped__
        delattr(mixin, _ROUTE_ATTRIBUTE)
    else:
        route._hf_tev_active = False


def is_enabled() -> bool:
    """Whether `generate(..., tev_config=...)` reaches the tree decoder (or will, once transformers loads)."""
    mixin = _mixin(load=False)
    if mixin is None:
        return _wanted
    route = _installed_route(mixin)
    return route is not None and route._hf_tev_active and any(f is route for f in _chain(mixin.generate))


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Installs the route right after `transformers.generation.utils` is executed (imports stay lazy)."""

    @classmethod
    def register(cls) -> None:
        # by name: after a reload of this module the hook of the earlier copy is still there, and enough
        if not any(type(finder).__qualname__ == cls.__qualname__ for finder in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, name, path, target=None):
        if name != _HOOKED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_route(module):
            exec_module(module)
            current = sys.modules[__name__]  # this module as it is now, even if reloaded since
            if current._wanted:
                current._install(module.GenerationMixin)

        spec.loader.exec_module = exec_and_route
        return spec
