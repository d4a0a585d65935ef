"""Tree decoding bound to one model: `hf_tev.bind(target, drafter)` changes nothing outside that model.

`import hf_tev` wraps `transformers.GenerationMixin.generate` for the whole process (`hf_tev.route`); with
`HF_TEV_NO_PATCH=1` set before the import it wraps nothing, and `bind` gives tree decoding to one model instead.
It sets that model's own `generate` (an attribute of the instance: its class, every other model and transformers
stay as they are), which hands every call to the entry the route uses, `hf_tev.route.routed_generate`, with the
bound drafter and `TEVConfig` as defaults; the call is then resolved once, by `hf_tev.generate_call.resolve_call`,
as on the route. A bound model therefore takes and refuses exactly what the route does (docs/generate_options.md):
streamers, `stop_strings` and `token_healing` (with `tokenizer=`), positional arguments, a passed
`generation_config`, pipelines (which call `model.generate`), and the same refusals by name.

The drafter is held by the binding, not registered as a submodule: `save_pretrained`, `state_dict` and
`.to(...)` of the target do not see it. `unbind(model)` gives the model its class's `generate` back.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from .generate_call import check_drafter_or_lookup
from .route import as_keywords, positional_names, routed_generate

BINDING_ATTRIBUTE = "_hf_tev_binding"


@dataclass
class Binding:
    """What `bind` attached to a model: the drafter and the tree settings its calls default to."""

    drafter: Any = None
    tev_config: Any = None


def bind(model, drafter=None, tev_config=None):
    """Give `model` tree decoding without changing anything global; returns `model`.

    Every later `model.generate(...)` call is decoded by hf_tev's tree decoder: `assistant_model=` (or `drafter=`)
    defaults to `drafter`, `tev_config=` to `tev_config` (else the generation config's `tev_config`, else
    `TEVConfig()`, as on the route). Options are taken or refused by name as on the route.

    Args:
        model (`PreTrainedModel`): the target, a model with transformers' `generate`.
        drafter (`DFlashDraftModel`, *optional*): the drafter; None for tree lookup decoding, which then needs
            `TEVConfig(lookup=True)`.
        tev_config (`TEVConfig` or `dict`, *optional*): the tree settings of every call that passes none.
    """
    from .config import TEVConfig

    if not callable(getattr(type(model), "generate", None)):
        raise TypeError(f"hf_tev.bind needs a model with transformers' generate, got {type(model).__name__}")
    tev_config = None if tev_config is None else TEVConfig.coerce(tev_config)
    # the binding holds for every call: without a drafter, context drafts must be asked for (lookup=True), not left
    # to each call's `lookup="auto"`
    check_drafter_or_lookup(drafter, tev_config is not None and tev_config.lookup is True)
    vars(model)[BINDING_ATTRIBUTE] = Binding(drafter, tev_config)
    # a method of this instance: a deep copy of the model is bound to the copy, not to this model
    vars(model)["generate"] = types.MethodType(bound_generate, model)
    return model


def unbind(model):
    """Take `bind`'s tree decoding off `model` (its class's `generate` again); returns `model`."""
    vars(model).pop(BINDING_ATTRIBUTE, None)
    if getattr(vars(model).get("generate"), "__func__", None) is bound_generate:
        del vars(model)["generate"]
    return model


def is_bound(model) -> bool:
    """Whether `model.generate` is `bind`'s tree decoding."""
    return getattr(vars(model).get("generate"), "__func__", None) is bound_generate


def bound_generate(self, *args, **kwargs):
    """`generate` of a bound model: the route's entry with the binding's drafter and tree settings as defaults.

    The class's `generate` (transformers', or the route's wrapper when `import hf_tev` installed it, which passes
    a call it does not route through untouched) runs with the tree decoder as its `custom_generate`."""
    binding = vars(self)[BINDING_ATTRIBUTE]
    generate = type(self).generate
    if len(args) > 1:  # generate(input_ids, generation_config, ...): read by name, as the route reads them
        args, kwargs = as_keywords(positional_names(generate), args, kwargs)
    if binding.drafter is not None and kwargs.get("assistant_model") is None and kwargs.get("drafter") is None:
        kwargs["assistant_model"] = binding.drafter
    if binding.tev_config is not None and kwargs.get("tev_config") is None:
        kwargs["tev_config"] = binding.tev_config
    return routed_generate(generate, self, *args, **kwargs)
