"""hf_tev's tree speculative decoding as a transformers `custom_generate` recipe (Hub repository layout).

    out = target.generate(input_ids, custom_generate="<this repo or folder>", trust_remote_code=True,
                          assistant_model=drafter, tev_config={"budget": 64}, max_new_tokens=256)

transformers calls `generate(model=..., **every generate argument)`; the drafter comes as `assistant_model=` (or
`drafter=`), the tree settings as `tev_config=` (an `hf_tev.TEVConfig` or a dict of its fields; default
`TEVConfig()`). Everything else (sampling settings, stopping criteria, streamer, tokenizer + stop_strings,
return_dict_in_generate) is generate's own. Needs `pip install hf_tev` (requirements.txt).
"""


def generate(model, *args, **kwargs):
    from transformers import GenerationMixin

    from hf_tev.route import routed_generate

    return routed_generate(GenerationMixin.generate, model, *args, **kwargs)
