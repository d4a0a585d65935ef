"""The `generate` route: `model.generate(..., assistant_model=drafter, tev_config=...)` goes to the tree decoder.

`import hf_tev` installs one wrapper around `transformers.GenerationMixin.generate`; a call that carries
`tev_config=` (or `custom_generate=hf_tev.tree_speculative_decode`), or passes a DFlash drafter as
`assistant_model=` (without `speculation_type="dflash"`, transformers' own chain path), becomes transformers'
supported `custom_generate` call of the tree decoding loop, `hf_tev.generation.decode_with_trees`
(`routed_generate`: the call read, coerced and checked once by `hf_tev.generate_call.resolve_call`, before
generate acts on anything, and bound; token healing and stop strings done here, since transformers drops the
tokenizer on that route); every other call passes through untouched. Without the route,
`custom_generate=tree_speculative_decode` is transformers' own hook, whose entry resolves the call the same way
from what reaches it (`hf_tev.generation.custom_generate`).
The decoder (and transformers) load on the first routed call only.

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

import copy
import functools
import importlib
import inspect
import sys

from .generate_call import generate_option, resolve_call
from .import_hooks import after_import

_HOOKED_MODULE = "transformers.generation.utils"
_ROUTE_ATTRIBUTE = "_hf_tev_route"  # on GenerationMixin: our wrapper, the one source of truth
# enable() was called last (read by the post-import hook through sys.modules; a reload keeps the value)
_wanted = globals().get("_wanted", False)


def _make_route(original):
    names = positional_names(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if len(args) > 1:  # e.g. generate(input_ids, generation_config): the route reads options by name
            args, kwargs = as_keywords(names, args, kwargs)
        if not generate._hf_tev_active or not wants_tree_decoding(self, kwargs):
            return original(self, *args, **kwargs)
        return routed_generate(original, self, *args, **kwargs)

    generate._hf_tev_active = True
    return generate


def positional_names(function) -> list[str]:
    """The names of `function`'s parameters that can be passed by position, `self` excluded."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds][1:]


def as_keywords(names: list[str], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`generate`'s positional arguments after the prompt passed by name instead (as generate binds them), so
    that the route sees a positional `generation_config` or `assistant_model`; a name given both ways is
    refused as Python refuses it."""
    if len(args) > len(names):  # more than generate takes: generate's own TypeError says so
        return args, kwargs
    for name in names[1 : len(args)]:
        if name in kwargs:
            raise TypeError(f"generate() got multiple values for argument '{name}'")
    return args[:1], {**dict(zip(names[1:], args[1:], strict=False)), **kwargs}


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
    return resolved_option(model, kwargs, "speculation_type") != "dflash"


def resolved_option(model, kwargs: dict, name: str):
    """The value of generate option `name` for a call, as generate resolves it: the keyword argument, else the
    passed `generation_config`'s, else the model's `generation_config`'s (None when unset everywhere)."""
    return generate_option(name, kwargs, generation_configs(model, kwargs))


def generation_configs(model, kwargs: dict) -> tuple:
    """The generation configs a `generate` call reads an option it does not pass from: its own, then the model's."""
    return kwargs.get("generation_config"), getattr(model, "generation_config", None)


# the arguments that name the tree decoder's inputs (read into the `TreeCall`), not handed on to generate
_READ_BY_THE_ROUTE = ("tev_config", "custom_generate", "drafter", "assistant_model")


def routed_generate(original, model, *args, **kwargs):
    """A `generate` call routed to the tree decoder (`hf_tev.route`), made transformers' `custom_generate` call
    of the loop (`decode_with_trees`) with the resolved call bound (`hf_tev.generate_call.resolve_call`: the
    drafter, the tree settings and the streamer; every refusal by name, before generate runs). transformers drops
    the streamer and the tokenizer on the callable route, so `stop_strings` and `token_healing` are done here.

    The drafter is `assistant_model=` (or `drafter=` with `custom_generate=tree_speculative_decode`); the tree
    settings are `tev_config=`, else the generation config's `tev_config` (e.g. from `generation_config.json`),
    else `TEVConfig()`.
    """
    from .generation import decode_with_trees
    from .generation.checks import check_prompt, refuse_encoded_inputs

    call = resolve_call(kwargs, generation_configs(model, kwargs))
    for name in _READ_BY_THE_ROUTE:
        kwargs.pop(name, None)
    refuse_encoded_inputs(model, kwargs)  # images / video: refused before generate runs the model's encoder
    check_prompt(_prompt_ids(args, kwargs), kwargs.get("attention_mask"), kwargs.get("position_ids"))
    args = _heal_tokens(model, args, kwargs)
    _stop_strings_as_criteria(model, kwargs)
    decode = functools.partial(decode_with_trees, call=call)
    return original(model, *args, custom_generate=decode, **kwargs)


def _prompt_ids(args: tuple, kwargs: dict):
    """The prompt generate will decode from: its first positional argument, `inputs=` or `input_ids=`."""
    for given in (args[0] if args else None, kwargs.get("inputs"), kwargs.get("input_ids")):
        if given is not None:
            return given
    return None


def _heal_tokens(model, args: tuple, kwargs: dict) -> tuple:
    """`token_healing` done here, as generate would (the callable route loses the tokenizer it needs); returns
    `args` with the healed prompt, and turns the option off for the call handed on."""
    if not resolved_option(model, kwargs, "token_healing"):
        return args
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("`token_healing` needs the tokenizer: pass `tokenizer=` to generate.")
    _off_for_this_call(kwargs, token_healing=False)
    if args:
        return (model.heal_tokens(args[0], tokenizer), *args[1:])
    key = "inputs" if kwargs.get("inputs") is not None else "input_ids"
    kwargs[key] = model.heal_tokens(kwargs[key], tokenizer)
    return args


def _stop_strings_as_criteria(model, kwargs: dict) -> None:
    """`stop_strings` as a `StopStringCriteria` in `kwargs["stopping_criteria"]`.

    On the `custom_generate` callable route transformers drops the tokenizer before it builds the stopping
    criteria ("could not locate a tokenizer"), so the route builds this one criterion itself, exactly as
    generate would, and turns the strings off for the call it hands on (`_off_for_this_call`)."""
    from transformers.generation import StoppingCriteriaList, StopStringCriteria

    stop_strings = kwargs.pop("stop_strings", None) or resolved_option(model, kwargs, "stop_strings")
    if not stop_strings:
        return
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("`stop_strings` need the tokenizer: pass `tokenizer=` to generate.")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    _off_for_this_call(kwargs, stop_strings=None)


# Options the route does itself (`_off_for_this_call`): a passed generation config's copy keeps them off.
_DONE_BY_ROUTE = ("stop_strings", "token_healing")


def _off_for_this_call(kwargs: dict, **settings) -> None:
    """Options the route does itself, set as `settings` for the `generate` call it hands on, without changing the
    model's or the caller's generation config: another call (another thread) may be reading them.

    generate's keyword arguments outrank both configs, so without a passed `generation_config` they go there.
    With one (generate warns about keyword arguments next to a config), the call gets its own copy holding them;
    generate fills a passed config's unset (None) fields from the model's generation config, which would bring
    the model's `stop_strings` back, so the copy's class keeps the route's options out of that fill."""
    config = kwargs.get("generation_config")
    if config is None:
        kwargs.update(settings)
        return
    for name in settings:
        kwargs.pop(name, None)
    if not getattr(config, "_hf_tev_call_copy", False):
        config = copy.deepcopy(config)
        config.__class__ = _call_copy_class(type(config))
        kwargs["generation_config"] = config
    for name, value in settings.items():
        setattr(config, name, value)


@functools.cache
def _call_copy_class(config_class):
    """`config_class` (a `GenerationConfig` class) whose fill from the model's config skips `_DONE_BY_ROUTE`."""

    def update(self, defaults_only=False, allow_custom_entries=False, **kwargs):
        if defaults_only:  # the fill of unset fields from the model's generation config and the global defaults
            kwargs = {name: value for name, value in kwargs.items() if name not in _DONE_BY_ROUTE}
        return config_class.update(
            self, defaults_only=defaults_only, allow_custom_entries=allow_custom_entries, **kwargs
        )

    return type(config_class.__name__, (config_class,), {"update": update, "_hf_tev_call_copy": True})


def _mixin(load: bool):
    """`GenerationMixin`, or None when transformers' generation module is not loaded and `load` is False."""
    module = sys.modules.get(_HOOKED_MODULE)
    if module is None:
        if not load:
            return None
        module = importlib.import_module(_HOOKED_MODULE)
    return module.GenerationMixin


def install_route(generation_utils) -> None:
    """Put the route on `generation_utils.GenerationMixin` if it is wanted (run by `enable()` and by the import hook
    when `transformers.generation.utils` finishes loading)."""
    if _wanted:
        _install(generation_utils.GenerationMixin)


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
    after_import(_HOOKED_MODULE, __name__, "install_route")


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
