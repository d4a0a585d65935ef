"""hf_tev on a real pretrained target (SmolLM2-135M-Instruct): chat-templated prompts, greedy output equal to the
target's own `generate` for every verifier, context drafts, a drafter, a left-padded batch and an EOS inside a
block, and the sampling law under a seeded chi-square test that can fail."""

import json

import pytest
import torch
from helpers import chi_square_pvalue, greedy, make_drafter, with_oracle

from hf_tev import TEVConfig
from hf_tev.packaged import SOURCE_FILE, packaged_model_path

pytestmark = pytest.mark.slow  # the real target (tests/conftest.py `smollm2_folder`)

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


def test_the_packaged_folder_is_a_plain_safetensors_model_reused_on_the_next_call(smollm2_folder, smollm2):
    target, tokenizer = smollm2
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    assert (smollm2_folder / "model.safetensors").is_file() and not list(smollm2_folder.glob("*.gguf"))
    source = json.loads((smollm2_folder / SOURCE_FILE).read_text())
    assert source["hub_id"] == SMOLLM2 and source["quantization"] == "Q4_1"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert sum(p.numel() for p in target.parameters()) == 134_515_008
    stamp = (smollm2_folder / "model.safetensors").stat().st_mtime_ns
    assert packaged_model_path(SMOLLM2, cache_dir=smollm2_folder.parent) == smollm2_folder
    assert (smollm2_folder / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not converted again


def test_an_interrupted_conversion_is_built_again(smollm2_folder, tmp_path):
    """A folder without its source file (a conversion that stopped) is not trusted: it is converted again."""
    from hf_tev import packaged

    folder = tmp_path / smollm2_folder.name
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # what a stopped conversion could leave
    calls = []
    real = packaged._convert
    try:
        packaged._convert = lambda model, chunks, where, source: calls.append(where)
        packaged_model_path(SMOLLM2, cache_dir=tmp_path)
    finally:
        packaged._convert = real
    assert calls == [folder]


def test_it_answers_a_chat_prompt_sensibly(smollm2, chat):
    target, tokenizer = smollm2
    prompt = chat(QUESTIONS[0])
    out = greedy(target, prompt, max_new_tokens=24)
    assert "[::-1]" in tokenizer.decode(out[0, prompt.shape[1] :])


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_equals_plain_generate_for_every_verifier_drafter_and_context_drafts(smollm2, chat, question):
    target, _ = smollm2
    prompt = chat(question)
    expected = greedy(target, prompt, max_new_tokens=32)
    verifiers = ("tev", "predraw", "residual") if question == QUESTIONS[0] else ("tev",)
    runs = {"defaults (context drafts, no drafter)": ({}, TEVConfig())}
    for verifier in verifiers:  # a drafter that mostly knows the answer, beside context drafts
        oracle = with_oracle(make_drafter(target, block_size=8, seed=3), expected, boost=400.0)
        runs[verifier] = (dict(assistant_model=oracle), TEVConfig(budget=16, verifier=verifier, lookup=True))
    if question == QUESTIONS[0]:  # an untrained drafter: almost every tree rejected, the root alone kept
        runs["fresh drafter"] = (dict(assistant_model=make_drafter(target, block_size=8, seed=3)), TEVConfig(budget=8))
    for name, (kwargs, config) in runs.items():
        out = greedy(target, prompt, max_new_tokens=32, tev_config=config, return_dict_in_generate=True, **kwargs)
        assert out.sequences.tolist() == expected.tolist(), name
        if name in verifiers:  # the trees were accepted deep: the tree path, not only the root, was tested
            assert max(out.tev_stats.accepted_lengths) >= 3, (name, out.tev_stats.accepted_lengths)


def test_a_batch_of_left_padded_chat_prompts_is_row_exact(smollm2):
    target, tokenizer = smollm2
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in [*QUESTIONS, "Name a prime number."]
    ]
    alone = [greedy(target, tokenizer(t, return_tensors="pt").input_ids, max_new_tokens=16) for t in texts]
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = "right"
    drafter = make_drafter(target, block_size=8, seed=3)
    out = target.generate(
        **batch,
        do_sample=False,
        max_new_tokens=16,
        assistant_model=drafter,
        tev_config=TEVConfig(budget=8, lookup=True),
    )
    width = batch.input_ids.shape[1]
    for row, (sequence, mask) in enumerate(zip(out, batch.attention_mask, strict=True)):
        prompt_length = int(mask.sum())
        new = sequence[width:].tolist()
        own = alone[row][0, prompt_length:].tolist()
        assert new[: len(own)] == own, row
        assert all(token == tokenizer.pad_token_id for token in new[len(own) :]), row  # finished rows are padded


def test_an_eos_inside_a_drafted_block_ends_the_output_there(smollm2, chat):
    target, tokenizer = smollm2
    prompt = chat("Reply with the single word yes.")
    expected = greedy(target, prompt, max_new_tokens=48)
    assert expected[0, -1] == tokenizer.eos_token_id and expected.shape[1] - prompt.shape[1] < 48  # ends early
    # The oracle drafts the answer, its EOS and, past it, tokens that must never be emitted.
    beyond = torch.cat([expected, torch.tensor([[tokenizer.encode(" and more")[0]] * 8])], 1)
    drafter = with_oracle(make_drafter(target, block_size=16, seed=3), beyond, boost=400.0)
    out = greedy(
        target, prompt, max_new_tokens=48, assistant_model=drafter, tev_config=TEVConfig(budget=16, lookup=True),
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == expected.tolist()
    assert out.tev_stats.accepted_lengths[-1] >= 2  # the EOS came inside an accepted path, not as a lone root


# --------------------------------------------------------------------------------------------------------
# The sampling law (T = 1, top-k 2): 4 new tokens, the law of the last two against an exact enumeration
# --------------------------------------------------------------------------------------------------------
TOP_K, NEW_TOKENS, DRAWS = 2, 4, 160


def top_k_children(target, prefixes: list[list[int]], temperature: float) -> list[dict[int, float]]:
    """For each prefix, the target's next-token law under top-k and `temperature`: {token: probability}."""
    with torch.no_grad():
        logits = target(torch.tensor(prefixes)).logits[:, -1].double() / temperature
    top = logits.topk(TOP_K, -1)
    probs = torch.softmax(top.values, -1)
    return [dict(zip(i.tolist(), p.tolist(), strict=True)) for i, p in zip(top.indices, probs, strict=True)]


def support_tree(target, prompt: list[int], temperature: float) -> dict[tuple, dict[int, float]]:
    """Every continuation of up to NEW_TOKENS tokens the sampling can produce, with each step's law."""
    tree, frontier = {}, [()]
    for _ in range(NEW_TOKENS):
        laws = top_k_children(target, [prompt + list(path) for path in frontier], temperature)
        tree.update(zip(frontier, laws, strict=True))
        frontier = [(*path, token) for path, law in zip(frontier, laws, strict=True) for token in law]
    return tree


def last_two_law(tree: dict[tuple, dict[int, float]]) -> dict[tuple[int, int], float]:
    law, paths = {}, [((), 1.0)]
    for _ in range(NEW_TOKENS):
        paths = [((*path, t), mass * p) for path, mass in paths for t, p in tree[path].items()]
    for path, mass in paths:
        law[path[-2:]] = law.get(path[-2:], 0.0) + mass
    return law


def with_support_oracle(drafter, tree, prompt_length: int):
    """The first tree after the prefill (rooted at the first new token) holds every path the sampling can take:
    depth d boosts each token some depth-d continuation of the root can be. Later blocks are drafted as is."""
    real = drafter.draft_logits

    def draft_logits(target, context, block_ids, position_ids, cache=None, num_depths=None, **kwargs):
        logits = real(target, context, block_ids, position_ids, cache, num_depths, **kwargs)
        if int(position_ids[0, -block_ids.shape[1]]) == prompt_length:
            level = [(int(block_ids[0, 0]),)]
            for depth in range(1, min(logits.shape[1], NEW_TOKENS - 1) + 1):
                level = [(*path, t) for path in level if path in tree for t in tree[path]]
                for path in level:
                    logits[0, depth - 1, path[-1]] += 400.0
        return logits

    drafter.draft_logits = draft_logits
    return drafter


def test_sampling_law_at_temperature_1_top_k_2(smollm2, chat):
    target, _ = smollm2
    prompt = chat("Give me a fun fact.")
    tree = support_tree(target, prompt[0].tolist(), temperature=1.0)
    law = last_two_law(tree)
    cells = sorted(law)
    drafter = with_support_oracle(make_drafter(target, block_size=8, seed=3), tree, prompt.shape[1])
    counts, accepted = torch.zeros(len(cells)), []
    torch.manual_seed(1234)
    for _ in range(DRAWS):
        out = target.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_k=TOP_K, top_p=1.0,
            assistant_model=drafter, tev_config=TEVConfig(budget=12), return_dict_in_generate=True,
        )  # fmt: skip
        counts[cells.index(tuple(out.sequences[0, -2:].tolist()))] += 1
        accepted.append(out.tev_stats.accepted_lengths[0])
    assert chi_square_pvalue(counts, torch.tensor([law[c] for c in cells])) > 1e-3
    assert sum(a >= 3 for a in accepted) > DRAWS // 4, "the tree's deep paths were rarely accepted: no power"
    # the same counts reject the law of another temperature: the test can fail
    wrong = last_two_law(support_tree(target, prompt[0].tolist(), temperature=0.5))
    assert chi_square_pvalue(counts, torch.tensor([wrong.get(c, 0.0) for c in cells])) < 1e-3
