"""Draft tree builder vs brute-force enumeration; chain trees; tree attention mask and positions."""

import itertools
import math

import pytest
import torch

from hf_tev.tree import (
    TREE_BUILDERS,
    DraftTree,
    TreeInputs,
    build_chain,
    build_tree,
    tree_attention_mask,
    tree_position_ids,
)


def brute_force_tree(draft_logprobs: torch.Tensor, budget: int):
    """Every token path of length 1..D sorted by (-score, depth, ranks), the first `budget` kept.

    Returns (tokens, depths, parents, ancestors) of the drafted nodes in that order, root excluded;
    ancestors[i] = the node indices root..i (root = 0, drafted node i = i + 1).
    """
    rows = draft_logprobs.double().tolist()
    num_depths, vocab = draft_logprobs.shape
    # Rank of each token at each depth: descending value, ascending token id on ties.
    ranks = [
        {tok: r for r, tok in enumerate(sorted(range(vocab), key=lambda t, row=row: (-row[t], t)))} for row in rows
    ]
    keyed = []
    for depth in range(1, num_depths + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            score = 0.0
            for d, tok in enumerate(path):
                score = score + rows[d][tok]
            keyed.append(((-score, depth, tuple(ranks[d][tok] for d, tok in enumerate(path))), path))
    keyed.sort()
    chosen = [path for _, path in keyed[:budget]]
    index = {(): 0, **{path: i + 1 for i, path in enumerate(chosen)}}
    tokens = [path[-1] for path in chosen]
    depths = [len(path) for path in chosen]
    parents = [index[path[:-1]] for path in chosen]  # KeyError here = not prefix-closed
    ancestors = [[index[path[:j]] for j in range(len(path) + 1)] for path in chosen]
    return tokens, depths, parents, ancestors


def assert_tree_equals_brute_force(draft_logprobs, budget, root=7):
    tree = build_tree(draft_logprobs, budget, root)
    tokens, depths, parents, ancestors = brute_force_tree(draft_logprobs, budget)
    assert tree.tokens.tolist() == [root] + tokens
    assert tree.depths.tolist() == [0] + depths
    assert tree.parents.tolist() == [-1] + parents
    expected_visibility = torch.zeros(len(tokens) + 1, len(tokens) + 1, dtype=torch.bool)
    expected_visibility[0, 0] = True
    for node, chain in enumerate(ancestors, start=1):
        expected_visibility[node, chain] = True
    assert torch.equal(tree.visibility, expected_visibility)
    assert tree.max_depth == max(depths, default=0) == int(tree.depths.max())
    return tree


def num_paths(num_depths, vocab):
    return sum(vocab**d for d in range(1, num_depths + 1))


@pytest.mark.parametrize("num_depths,vocab", [(1, 4), (2, 3), (3, 4), (4, 3), (3, 5)])
def test_builder_equals_brute_force_continuous(num_depths, vocab):
    gen = torch.Generator().manual_seed(num_depths * 10 + vocab)
    for _ in range(6):
        logprobs = (2 * torch.randn(num_depths, vocab, generator=gen)).log_softmax(-1)
        for budget in sorted(
            {0, 1, 2, 3, vocab, vocab + 1, 7, 13, num_paths(num_depths, vocab), num_paths(num_depths, vocab) + 5}
        ):
            assert_tree_equals_brute_force(logprobs, budget)


@pytest.mark.parametrize("num_depths,vocab", [(2, 4), (3, 3), (3, 4), (4, 3), (4, 2)])
def test_builder_equals_brute_force_with_ties(num_depths, vocab):
    # Quantised log-probs (multiples of 1/2, exact in binary) produce many equal values and equal
    # path scores; the tie rule must still give one exact answer. Some entries are -inf (q = 0).
    gen = torch.Generator().manual_seed(100 + num_depths * 10 + vocab)
    total = num_paths(num_depths, vocab)
    for trial in range(8):
        levels = torch.randint(0, 3, (num_depths, vocab), generator=gen).double()
        logprobs = -0.5 * levels
        if trial % 2:
            logprobs[torch.rand(num_depths, vocab, generator=gen) < 0.2] = -math.inf
        logprobs = logprobs.float()
        for budget in range(0, total + 3):
            assert_tree_equals_brute_force(logprobs, budget)


def test_all_equal_logprobs_follow_token_ids():
    # Everything ties: order = depth, then rank path = token ids in lexicographic order.
    tree = assert_tree_equals_brute_force(torch.zeros(2, 3), 20)
    assert tree.tokens.tolist() == [7, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_ranked_topk_matches_stable_sort_on_large_vocab(dtype):
    from hf_tev.tree import ranked_topk

    gen = torch.Generator().manual_seed(3)
    logprobs = -0.25 * torch.randint(0, 6, (5, 1000), generator=gen).float()  # heavy ties
    logprobs[0, ::7] = -math.inf
    logprobs[1] = -torch.rand(1000, generator=gen) * 1e3  # mixed exponents, positives excluded
    logprobs[2, 10], logprobs[2, 20] = -0.0, 0.0  # equal values, the lower id must come first
    logprobs = logprobs.to(dtype)
    for k in (1, 7, 170, 1000):
        values, ids, row_max = ranked_topk(logprobs, k)
        expected_values, expected_ids = logprobs.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(ids, expected_ids[:, :k])
        assert torch.equal(values, expected_values[:, :k])
        assert torch.equal(row_max, expected_values[:, 0])


def test_builder_invariants_at_realistic_size():
    gen = torch.Generator().manual_seed(0)
    logprobs = (3 * torch.randn(15, 500, generator=gen)).log_softmax(-1)
    for budget in (1, 16, 64, 128):
        tree = build_tree(logprobs, budget, torch.tensor([11]))
        n = tree.num_nodes
        assert n == budget + 1 and tree.tokens[0] == 11
        parents, depths, tokens = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist()
        assert all(0 <= parents[i] < i for i in range(1, n))
        assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, n))
        siblings = {}
        for i in range(1, n):
            assert tokens[i] not in siblings.setdefault(parents[i], set())
            siblings[parents[i]].add(tokens[i])
        scores = [0.0] * n
        for i in range(1, n):
            scores[i] = scores[parents[i]] + float(logprobs[depths[i] - 1, tokens[i]])
        assert all(scores[i] >= scores[i + 1] - 1e-9 for i in range(1, n - 1))  # pop order
        # Prefix-closed and best: no left-out child of a tree node scores above the worst node.
        worst = min(scores[1:])
        for u in range(n):
            if depths[u] < 15:
                taken = siblings.get(u, set())
                best_free = max(float(logprobs[depths[u], t]) for t in range(500) if t not in taken)
                assert scores[u] + best_free <= worst + 1e-9
        assert tree.internal_nodes.tolist() == sorted(set(parents[1:]))  # known at build time
        assert torch.equal(tree.parent_rows, torch.searchsorted(tree.internal_nodes, tree.parents[1:]))


def test_budget_zero_and_no_depth_give_root_only():
    for tree in (build_tree(torch.zeros(3, 4), 0, 5), build_tree(torch.zeros(0, 4), 10, 5)):
        assert tree.tokens.tolist() == [5] and tree.parents.tolist() == [-1] and tree.depths.tolist() == [0]
        assert tree.visibility.tolist() == [[True]] and tree.max_depth == 0
        assert tree.internal_nodes.tolist() == []


def test_root_trees_equal_the_chain_of_no_node():
    from hf_tev.tree import RootTrees

    root_trees = RootTrees(torch.device("cpu"))
    for token in (5, 0):
        root = torch.tensor([token])
        tree, expected = root_trees(root), build_chain(torch.zeros(0, 1), 0, root)
        for name in ("tokens", "depths", "parents", "visibility", "internal_nodes", "parent_rows"):
            assert torch.equal(getattr(tree, name), getattr(expected, name)), name
            assert getattr(tree, name).dtype == getattr(expected, name).dtype
        assert tree.lists == expected.lists and tree.max_depth == 0 and tree.path_logprobs == expected.path_logprobs


def test_host_long_and_host_topk_equal_their_slow_forms():
    from hf_tev.tree import host_long, host_topk, ranked_topk

    for values in ([], [0], [-1, 2**40, 7]):
        assert torch.equal(host_long(values), torch.tensor(values, dtype=torch.long))
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        logprobs = (2 * torch.randn(5, 300, generator=gen)).log_softmax(-1).to(dtype)
        logprobs[1] = -math.inf  # a tie across every rank
        logprobs[2] = -0.25 * torch.randint(0, 6, (300,), generator=gen)  # heavy ties inside and across rank k
        logprobs[3, 150:] = -math.inf
        logprobs[4, 10], logprobs[4, 20] = -0.0, 0.0  # equal values, the lower id first
        for k in (1, 9, 160, 300):  # (on CPU, a top-k of the values with the ties put right: the same lists)
            values, ids = host_topk(logprobs, k)
            expected_values, expected_ids, _ = ranked_topk(logprobs, k)
            assert values == expected_values.double().tolist() and ids == expected_ids.tolist()
    for vocab in (5, 400):  # the key's path, and on CPU the top-k of the values (which ranks NaN first)
        nan_row = torch.zeros(2, vocab).log_softmax(-1)
        nan_row[1, vocab // 2] = math.nan
        with pytest.raises(ValueError, match="log-probabilities"):
            host_topk(nan_row, 3)
        with pytest.raises(ValueError, match="log-probabilities"):
            host_topk(torch.full((2, vocab), 0.5), 3)


def test_build_chain():
    logprobs = torch.tensor([[-1.0, -0.5, -0.5], [-0.1, -2.0, -3.0], [-3.0, -3.0, -0.2]])
    tree = build_chain(logprobs, 99, torch.tensor(9))
    assert tree.tokens.tolist() == [9, 1, 0, 2]  # argmax, lowest id on ties
    assert tree.parents.tolist() == [-1, 0, 1, 2] and tree.depths.tolist() == [0, 1, 2, 3]
    assert torch.equal(tree.visibility, torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.max_depth == 3 and tree.internal_nodes.tolist() == [0, 1, 2]
    assert torch.equal(tree.parent_rows, torch.searchsorted(tree.internal_nodes, tree.parents[1:]))
    short = build_chain(logprobs, 1, 9)
    assert short.tokens.tolist() == [9, 1] and short.max_depth == 1
    assert build_chain(logprobs, 0, 9).tokens.tolist() == [9]
    # A chain is the builder's tree when each depth's runner-up is far behind.
    sharp = torch.full((3, 3), -50.0)
    sharp[[0, 1, 2], [2, 0, 1]] = 0.0
    built = build_tree(sharp, 3, 9)
    assert torch.equal(built.tokens, build_chain(sharp, 99, 9).tokens)
    assert torch.equal(built.parents, build_chain(sharp, 99, 9).parents)


def ancestors_by_parents(parents):
    chains = []
    for node in range(len(parents)):
        chain, u = [], node
        while u >= 0:
            chain.append(u)
            u = parents[u]
        chains.append(set(chain))
    return chains


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tree_attention_mask_and_positions(dtype):
    gen = torch.Generator().manual_seed(1)
    tree = build_tree(torch.randn(4, 6, generator=gen).log_softmax(-1), 12, 3)
    past = 5
    mask = tree_attention_mask(tree, past, dtype)
    n = tree.num_nodes
    assert mask.shape == (1, 1, n, past + n) and mask.dtype == dtype
    hidden = torch.finfo(dtype).min
    chains = ancestors_by_parents(tree.parents.tolist())
    for i in range(n):
        for j in range(past + n):
            visible = j < past or (j - past) in chains[i]
            assert mask[0, 0, i, j].item() == (0.0 if visible else hidden)
    positions = tree_position_ids(tree, past)
    assert positions.shape == (1, n) and positions.dtype == torch.long
    assert positions[0].tolist() == [past + d for d in tree.depths.tolist()]
    assert tree_attention_mask(tree, 0, torch.float32).shape == (1, 1, n, n)


def test_bad_inputs_raise_clear_errors():
    good = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="budget"):
        build_tree(good, -1, 0)
    with pytest.raises(TypeError, match="budget"):
        build_tree(good, 2.0, 0)
    with pytest.raises(TypeError, match="budget"):
        build_tree(good, True, 0)
    with pytest.raises(ValueError, match=r"shape \[D, V\]"):
        build_tree(torch.zeros(3), 2, 0)
    with pytest.raises(ValueError, match=r"shape \[D, V\]"):
        build_tree(torch.zeros(2, 3, 4), 2, 0)
    with pytest.raises(TypeError, match="floating"):
        build_tree(torch.zeros(2, 3, dtype=torch.long), 2, 0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        build_tree([[0.0, 0.0]], 2, 0)
    with pytest.raises(ValueError, match="log-probabilities"):
        build_tree(torch.tensor([[0.5, -1.0]]), 2, 0)
    with pytest.raises(ValueError, match="log-probabilities"):
        build_tree(torch.tensor([[-0.5, -1.0], [-1.0, math.nan]]), 1, 0)
    with pytest.raises(ValueError, match="log-probabilities"):
        build_tree(torch.tensor([[-0.5, -1.0], [-1.0, -math.nan]]), 1, 0)  # a NaN with the sign bit set
    with pytest.raises(ValueError, match="root_token"):
        build_tree(good, 2, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="root_token"):
        build_tree(good, 2, torch.tensor(1.0))
    with pytest.raises(TypeError, match="root_token"):
        build_tree(good, 2, "a")
    with pytest.raises(ValueError, match="budget"):
        build_chain(good, -1, 0)
    with pytest.raises(ValueError, match="past_length"):
        tree_attention_mask(build_chain(good, 99, 0), -1, torch.float32)
    with pytest.raises(TypeError, match="floating"):
        tree_attention_mask(build_chain(good, 99, 0), 0, torch.long)


def test_draft_tree_properties():
    tree = DraftTree(
        tokens=torch.tensor([4, 5, 6]),
        depths=torch.tensor([0, 1, 1]),
        parents=torch.tensor([-1, 0, 0]),
        visibility=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool(),
    )
    assert tree.num_nodes == 3 and tree.max_depth == 1 and tree.internal_nodes.tolist() == [0]


def test_draft_tree_rejects_bad_shapes():
    ok = dict(
        tokens=torch.tensor([4, 5]),
        depths=torch.tensor([0, 1]),
        parents=torch.tensor([-1, 0]),
        visibility=torch.tensor([[True, False], [True, True]]),
    )
    assert DraftTree(**ok).max_depth == 1 and DraftTree(**ok).lists.children == [[1], []]
    for name, bad in [
        ("tokens", torch.tensor([4.0, 5.0])),
        ("depths", torch.tensor([0])),
        ("parents", torch.tensor([[-1, 0]])),
        ("visibility", torch.ones(2, 3, dtype=torch.bool)),
        ("visibility", torch.ones(2, 2)),
    ]:
        with pytest.raises(ValueError, match=name):
            DraftTree(**{**ok, name: bad})


def test_tree_builders_share_one_signature():
    logprobs = torch.log_softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert set(TREE_BUILDERS) >= {"best_first", "chain"}
    for name, builder in TREE_BUILDERS.items():
        for budget in (0, 1, 3, 50):
            tree = builder(logprobs, budget, 5)
            assert tree.tokens[0] == 5 and 1 <= tree.num_nodes <= budget + 1, (name, budget)
            assert (tree.parents[1:] < torch.arange(1, tree.num_nodes)).all()


def test_tree_inputs_reuse_buffers_and_equal_fresh_masks():
    """Cycle after cycle (growing past, trees of changing size), the reused buffers give exactly the fresh
    mask and positions, with pad columns hidden throughout."""
    gen = torch.Generator().manual_seed(0)
    pads = torch.tensor([0, 1])
    inputs = TreeInputs(max_past=40, dtype=torch.float32, device="cpu", hidden_columns=pads)
    past, first_buffer = 5, None
    for budget in (4, 9, 2, 9, 0, 12, 3):
        tree = build_tree(torch.log_softmax(torch.randn(3, 6, generator=gen), -1), budget, 1)
        mask, positions = inputs(tree, past, past + 7)
        expected = tree_attention_mask(tree, past, torch.float32)
        expected[..., pads] = torch.finfo(torch.float32).min
        assert torch.equal(mask, expected) and positions.tolist() == [(past + 7 + tree.depths).tolist()]
        if first_buffer is None and tree.num_nodes == 13:
            first_buffer = inputs.mask.data_ptr()
        past += int(tree.num_nodes // 2) + 1
    assert first_buffer == inputs.mask.data_ptr()  # no re-allocation once the largest tree was seen
    with pytest.raises(ValueError, match="past_length"):
        inputs(tree, -1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_vocabulary_builds_the_trees_of_its_spread_log_probs(dtype):
    """Drafting over a draft vocabulary (`token_ids`: the target id of each column, ascending) builds, with every
    builder and the merged tree, the very trees its log-probs spread over the target's vocabulary build (-inf
    outside it): the same tokens, parents and scores, ties to the lower token id included."""
    from hf_tev.lookup import LookupStats, build_merged_tree
    from hf_tev.models.dflash.vocabulary import to_target_vocab

    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randperm(600, generator=generator)[:90].sort().values
    logits = (torch.randn(5, 90, generator=generator) * 2).round(decimals=1)  # rounded: ties across ranks
    draft = torch.log_softmax(logits, -1).to(dtype)
    spread = to_target_vocab(draft, token_ids, 600)  # the same values (a log-softmax over them may round apart)
    continuations = [([int(token_ids[3]), 17, int(token_ids[5])], 2), ([int(token_ids[3]), int(token_ids[9])], 1)]

    def same(a, b):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert a.path_logprobs == b.path_logprobs

    for budget in (1, 7, 40, 200):
        for builder in TREE_BUILDERS.values():
            same(builder(draft, budget, 5, token_ids=token_ids), builder(spread, budget, 5))
        merged = [
            build_merged_tree(q, budget, 5, continuations, LookupStats(), token_ids=ids)
            for q, ids in ((draft, token_ids), (spread, None))
        ]
        same(*merged)
    with pytest.raises(ValueError, match="token_ids"):
        build_tree(draft, 4, 5, token_ids=token_ids[:-1])
