"""runtime.tree / runtime.accept against the pure-Python oracle (tests/tree_reference.py), properties,
input validation, and a lossless end-to-end toy (greedy decode == tree-speculative decode)."""
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from runtime.accept import CommitPlan, commit_plan, committed_tokens, fill_draft_head, walk
from runtime.tree import DraftTree, build_tree, chain_tree, fill_verify_slots

sys.path.insert(0, os.path.dirname(__file__))
from tree_reference import build_tree_ref, chain_tree_ref, walk_ref  # noqa: E402

FIELDS = ("tokens", "depths", "parents", "scores", "visibility")


def random_inputs(rng, L, K, vocab=None, ties=False, ids_dtype=np.int32):
    """Sorted-descending log-probs (<= 0) and distinct ids per row. ties=True draws from a few
    multiples of 0.5, so many cumulative scores are exactly equal and the push-order rule decides."""
    if ties:
        lp = -rng.integers(0, 4, (L, K)) * 0.5
    else:
        lp = -rng.exponential(1.0, (L, K))
    lp = -np.sort(-lp, axis=1).astype(np.float32)
    vocab = vocab or max(2 * K, 8)
    ids = np.stack([rng.permutation(vocab)[:K] for _ in range(L)]).astype(ids_dtype)
    return lp, ids


def assert_same_tree(tree, ref):
    assert len(tree) == len(ref["tokens"])
    for name in FIELDS:
        got, want = getattr(tree, name), ref[name]
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)


def matching_targets(rng, tree, vocab, p_match=0.7):
    """Target tokens that follow a random child with probability p_match (so walks go deep)."""
    target = rng.integers(0, vocab, len(tree)).astype(np.int32)
    for i in range(len(tree)):
        kids = tree.children(i)
        if kids and rng.random() < p_match:
            target[i] = tree.tokens[kids[rng.integers(len(kids))]]
    return target


# ---------------------------------------------------------------- Cython == reference

def test_matches_reference_random_small():
    rng = np.random.default_rng(1234)
    workspace = DraftTree(64)  # reused across shapes: stale rows from bigger trees must never leak
    for case in range(3000):
        L = int(rng.integers(1, 7))
        K = int(rng.integers(1, 9))
        budget = int(rng.integers(1, L * K + 1))
        if case % 7 == 0:
            budget = L * K
        lp, ids = random_inputs(rng, L, K, ties=case % 2 == 0,
                                ids_dtype=np.int64 if case % 3 == 0 else np.int32)
        root = int(rng.integers(0, 100))
        tree = build_tree(lp, ids, budget, root, out=workspace if budget <= 64 else None)
        ref = build_tree_ref(lp, ids, budget, root)
        assert_same_tree(tree, ref)
        target = matching_targets(rng, tree, int(ids.max()) + 1)
        accepted, bonus = walk(tree, target)
        ref_accepted, ref_bonus = walk_ref(ref["tokens"], ref["parents"], target)
        np.testing.assert_array_equal(accepted, ref_accepted)
        assert accepted.dtype == np.int32 and bonus == ref_bonus


@pytest.mark.parametrize("L,K", [(1, 1), (1, 9), (9, 1), (3, 3)])
def test_degenerate_shapes_every_budget(L, K):
    rng = np.random.default_rng(L * 100 + K)
    for ties in (False, True):
        lp, ids = random_inputs(rng, L, K, ties=ties)
        for budget in range(1, L * K + 1):
            assert_same_tree(build_tree(lp, ids, budget, 3), build_tree_ref(lp, ids, budget, 3))


def test_all_equal_logprobs_pop_in_push_order():
    # Every candidate scores exactly 0: the order is decided by the push counter alone.
    L, K = 4, 3
    lp = np.zeros((L, K), np.float32)
    ids = np.arange(L * K, dtype=np.int32).reshape(L, K)
    tree = build_tree(lp, ids, L * K, 99)
    assert_same_tree(tree, build_tree_ref(lp, ids, L * K, 99))
    # Pushes: root's first child (order 0) pops; it pushes sibling (1) then child (2); sibling pops next.
    assert tree.parents[:4].tolist() == [-1, 0, 0, 1]


@pytest.mark.parametrize("ties", [False, True])
def test_budget_1024_depth_15(ties):
    rng = np.random.default_rng(7 + ties)
    L, K = 15, 1024
    lp, ids = random_inputs(rng, L, K, vocab=5000, ties=ties)
    tree = build_tree(lp, ids, 1024, 17)
    assert_same_tree(tree, build_tree_ref(lp, ids, 1024, 17))
    assert tree.visibility.shape == (1025, 33)


def test_realistic_softmax_rows_and_strided_inputs():
    rng = np.random.default_rng(5)
    L, V, K = 15, 3000, 64
    logits = rng.standard_normal((L, V)) * 3
    logp = (logits - np.log(np.exp(logits).sum(1, keepdims=True))).astype(np.float32)
    order = np.argsort(-logp, axis=1, kind="stable")
    full_ids = order.astype(np.int64)
    full_lp = np.take_along_axis(logp, order, 1)
    lp, ids = full_lp[:, :K], full_ids[:, :K]  # non-contiguous views
    assert not lp.flags.c_contiguous
    tree = build_tree(lp, ids, 64, 1)
    assert_same_tree(tree, build_tree_ref(np.ascontiguousarray(lp), ids, 64, 1))
    fortran = np.asfortranarray(lp)
    assert_same_tree(build_tree(fortran, ids, 64, 1), build_tree_ref(lp, ids, 64, 1))


def test_chain_tree():
    rng = np.random.default_rng(3)
    for L in (1, 2, 15, 40):
        tokens = rng.integers(0, 1000, L)
        tree = chain_tree(tokens, 5)
        assert_same_tree(tree, chain_tree_ref(tokens, 5))
        assert tree.children(0) == [1]
        target = np.append(tokens[: L // 2], [1001] * (L + 1 - L // 2)).astype(np.int32)
        accepted, bonus = walk(tree, target)
        assert accepted.tolist() == list(range(L // 2 + 1)) and bonus == 1001
        # All accepted nodes already sit at their positions: nothing to move.
        plan = commit_plan(tree, accepted, bonus, 100)
        assert plan.src_slots.size == 0 and plan.new_prefix_len == 100 + L // 2 + 1


def test_workspace_reuse_between_build_and_chain():
    rng = np.random.default_rng(11)
    ws = DraftTree(40)
    for _ in range(50):
        if rng.random() < 0.5:
            tokens = rng.integers(0, 50, int(rng.integers(1, 41))).astype(np.int32)
            assert_same_tree(chain_tree(tokens, 2, out=ws), chain_tree_ref(tokens, 2))
        else:
            lp, ids = random_inputs(rng, 5, 8, ties=True)
            b = int(rng.integers(1, 41))
            assert build_tree(lp, ids, b, 2, out=ws) is ws
            assert_same_tree(ws, build_tree_ref(lp, ids, b, 2))


def test_views_are_read_only():
    lp, ids = random_inputs(np.random.default_rng(0), 3, 3)
    tree = build_tree(lp, ids, 5, 0)
    for name in FIELDS + ("first_child", "next_sibling"):
        with pytest.raises(ValueError):
            getattr(tree, name)[0] = 1


def verify_slots_by_definition(tree, T, W, start):
    """The verify bucket's inputs as numpy writes them: nodes, then padded slots (token 0 at `start`, self only)."""
    ids, pos, vis = np.zeros(T, np.int32), np.full(T, start, np.int32), np.zeros((T, W), np.uint32)
    rows, words = len(tree), tree.visibility.shape[1]
    ids[:rows], pos[:rows], vis[:rows, :words] = tree.tokens, tree.depths + start, tree.visibility
    for i in range(rows, T):
        vis[i, i // 32] = np.uint32(1) << np.uint32(i % 32)
    return ids, pos, vis


def test_fill_verify_slots_matches_the_definition():
    """The CUDA engine's verify inputs (runtime.tree.fill_verify_slots) over stale slots: full buckets, padded
    ones (chains shorter than the bucket, budgets below it), word counts below the bucket's, reuse."""
    rng = np.random.default_rng(21)
    ws = DraftTree(1024)
    for bucket, budget in ((16, 16), (16, 5), (64, 64), (64, 33), (128, 128), (128, 31), (1024, 1024), (256, 1)):
        T, W = bucket + 1, (bucket + 1 + 31) // 32
        for chain in (False, True):
            if chain:
                tree = chain_tree(rng.integers(0, 50, min(budget, 15)).astype(np.int32), 7, out=ws)
            else:
                lp, ids = random_inputs(rng, 15, max(2, -(-budget // 15) + 1))
                tree = build_tree(lp, ids, budget, 7, out=ws)
            got = (rng.integers(-5, 5, T).astype(np.int32), rng.integers(-5, 5, T).astype(np.int32),
                   rng.integers(0, 2 ** 32, (T, W), dtype=np.uint64).astype(np.uint32))   # stale contents
            start = int(rng.integers(0, 5000))
            fill_verify_slots(tree, *got, start)
            for g, w, name in zip(got, verify_slots_by_definition(tree, T, W, start), ("ids", "pos", "vis")):
                np.testing.assert_array_equal(g, w, err_msg=f"bucket {bucket} budget {budget} chain {chain}: {name}")


def test_fill_verify_slots_rejects_what_does_not_fit():
    tree = build_tree(*random_inputs(np.random.default_rng(2), 4, 8), 20, 1)
    ids, pos, vis = np.zeros(21, np.int32), np.zeros(21, np.int32), np.zeros((21, 1), np.uint32)
    fill_verify_slots(tree, ids, pos, vis, 0)
    with pytest.raises(ValueError, match="does not fit"):
        fill_verify_slots(tree, ids[:20], pos[:20], vis[:20], 0)            # fewer slots than rows
    with pytest.raises(ValueError, match="one row per slot"):
        fill_verify_slots(tree, ids, pos[:20], vis, 0)
    with pytest.raises(ValueError, match="does not fit"):
        fill_verify_slots(tree, np.zeros(40, np.int32), np.zeros(40, np.int32), np.zeros((40, 1), np.uint32), 0)
    with pytest.raises(ValueError):
        fill_verify_slots(tree, ids.astype(np.int64), pos, vis, 0)          # wrong dtype


def test_committed_tokens_and_draft_head_match_the_definition():
    """The CUDA engine's round helpers: committed_tokens against commit_plan's tokens and the first moved depth;
    fill_draft_head against the numpy writes it replaced, over stale views, with shrinking and growing commits."""
    rng = np.random.default_rng(5)
    block = 16
    views = [rng.integers(-9, 9, n).astype(np.int32) for n in (1, 2, block, block, block, block, block)]
    prev_m = block
    for trial in range(60):
        lp, ids = random_inputs(rng, 15, 4)
        tree = build_tree(lp, ids, int(rng.integers(1, 60)), 3)
        accepted, bonus = walk(tree, rng.integers(0, 8, tree.n + 1).astype(np.int32))
        if trial % 3 == 0:
            accepted = accepted.astype(np.int64)
        plan = commit_plan(tree, accepted, bonus, 100)
        tokens, first_moved = committed_tokens(tree, accepted, bonus)
        assert tokens == plan.tokens[1:].tolist()
        assert first_moved == next((k for k, a in enumerate(accepted.tolist()) if a != k), len(accepted))
        start, ctx_start = int(rng.integers(100, 9000)), int(rng.integers(0, 100))
        want = [v.copy() for v in views]
        m = len(accepted)
        want[0][0] = start
        want[1][:] = ctx_start, m
        want[2][:m] = accepted + ctx_start
        want[3][:m] = accepted
        want[3][m:prev_m] = 0
        want[4][:] = ctx_start + np.arange(block)
        want[5][0] = bonus
        want[6][:] = start + np.arange(block)
        fill_draft_head(*views, start, ctx_start, accepted, bonus, prev_m)
        for g, w, name in zip(views, want, ("start", "meta", "compact_src", "ctx_rows", "ctx_pos", "draft_ids",
                                            "draft_pos")):
            np.testing.assert_array_equal(g, w, err_msg=f"trial {trial}: {name}")
        prev_m = m
    with pytest.raises(ValueError, match="not a node"):
        committed_tokens(tree, np.array([0, tree.n + 1], np.int32), 1)
    with pytest.raises(ValueError, match="do not fit"):
        fill_draft_head(*views, 0, 0, np.arange(block + 1, dtype=np.int32), 1, 0)
    with pytest.raises(ValueError, match="int32"):
        fill_draft_head(views[0].astype(np.int64), *views[1:], 0, 0, accepted, 1, 0)


# ---------------------------------------------------------------- commit plan

def test_commit_plan_example():
    # Root 0 -> 1 (rank 0) -> ...; accept a path that leaves the index == depth diagonal at depth 2.
    lp = np.array([[-0.25, -0.5], [-3.0, -3.25], [-0.25, -0.5]], np.float32)  # exact in binary
    ids = np.array([[10, 11], [20, 21], [30, 31]], np.int32)
    tree = build_tree(lp, ids, 6, 5)
    # Pops: 1:(10) 2:(11) 3:(20 under 1) then three candidates tie at -3.5, popped in push order:
    # 4:(20 under 2, pushed by node 2) 5:(21 under 1, pushed by node 3) 6:(30 under 3, pushed by node 3).
    assert tree.tokens.tolist() == [5, 10, 11, 20, 20, 21, 30]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 1, 3]
    assert tree.scores.tolist() == [0.0, -0.25, -0.5, -3.25, -3.5, -3.5, -3.5]
    accepted, bonus = walk(tree, np.array([11, 0, 20, 0, 77, 0, 0], np.int32))
    assert accepted.tolist() == [0, 2, 4] and bonus == 77
    plan = commit_plan(tree, accepted, bonus, 1000)
    assert isinstance(plan, CommitPlan)
    assert plan.src_slots.tolist() == [1002, 1004]
    assert plan.dst_positions.tolist() == [1001, 1002]  # dst 1002 is the source of the earlier move
    assert plan.tokens.tolist() == [5, 11, 20, 77]
    assert plan.new_prefix_len == 1003
    assert plan.src_slots.dtype == plan.dst_positions.dtype == plan.tokens.dtype == np.int32


def test_commit_plan_random_against_definition():
    rng = np.random.default_rng(21)
    for _ in range(500):
        L, K = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        lp, ids = random_inputs(rng, L, K, ties=True)
        tree = build_tree(lp, ids, int(rng.integers(1, L * K + 1)), 4)
        accepted, bonus = walk(tree, matching_targets(rng, tree, int(ids.max()) + 1, 0.9))
        prefix = int(rng.integers(0, 50))
        plan = commit_plan(tree, accepted.astype(np.int64) if rng.random() < 0.5 else accepted, bonus, prefix)
        moved = [(prefix + int(a), prefix + k) for k, a in enumerate(accepted) if a != k]
        assert list(zip(plan.src_slots.tolist(), plan.dst_positions.tolist())) == moved
        assert plan.tokens.tolist() == [int(tree.tokens[a]) for a in accepted] + [bonus]
        assert plan.new_prefix_len == prefix + len(accepted)


# ---------------------------------------------------------------- validation

def _ok_inputs():
    lp, ids = random_inputs(np.random.default_rng(0), 3, 4)
    return lp, ids


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda lp, ids: (lp.astype(np.float64), ids, 4, 0), TypeError, "float32"),
    (lambda lp, ids: (lp.tolist(), ids, 4, 0), TypeError, "numpy array"),
    (lambda lp, ids: (lp, ids.astype(np.float32), 4, 0), TypeError, "int32 or int64"),
    (lambda lp, ids: (lp, ids.astype(np.int16), 4, 0), TypeError, "int32 or int64"),
    (lambda lp, ids: (lp[0], ids, 4, 0), ValueError, "2-D"),
    (lambda lp, ids: (lp, ids[:2], 4, 0), ValueError, "shape"),
    (lambda lp, ids: (lp[:, :0], ids[:, :0], 1, 0), ValueError, "at least one"),
    (lambda lp, ids: (lp[:, ::-1], ids, 4, 0), ValueError, "not sorted descending"),
    (lambda lp, ids: (_poke(lp, 1, 2, np.nan), ids, 4, 0), ValueError, "finite"),
    (lambda lp, ids: (_poke(lp, 2, 0, np.nan), ids, 4, 0), ValueError, "finite"),
    (lambda lp, ids: (_poke(lp, 0, 0, np.inf), ids, 4, 0), ValueError, "finite"),
    (lambda lp, ids: (_poke(lp, 0, 3, -np.inf), ids, 4, 0), ValueError, "finite"),
    (lambda lp, ids: (lp, ids, 0, 0), ValueError, "budget"),
    (lambda lp, ids: (lp, ids, 13, 0), ValueError, "budget"),
    (lambda lp, ids: (lp, ids, 4, -1), ValueError, "root_token"),
    (lambda lp, ids: (lp, ids, 4, "a"), TypeError, "root_token"),
    (lambda lp, ids: (lp.astype(">f4"), ids, 4, 0), ValueError, "byte order"),
])
def test_build_tree_rejects_bad_input(mutate, exc, match):
    lp, ids = _ok_inputs()
    with pytest.raises(exc, match=match):
        build_tree(*mutate(lp.copy(), ids.copy()))


def _poke(a, i, j, v):
    a[i, j] = v
    return a


def test_bad_token_id_leaves_workspace_consistent():
    lp, ids = _ok_inputs()
    ws = DraftTree(8)
    build_tree(lp, ids, 8, 3, out=ws)
    ids[0, 0] = -5
    with pytest.raises(ValueError, match="token id"):
        build_tree(lp, ids, 8, 3, out=ws)
    assert len(ws) == 1 and ws.tokens.tolist() == [3] and ws.first_child.tolist() == [-1]
    big = ids.astype(np.int64)
    big[0, 0] = 2**31
    with pytest.raises(ValueError, match="token id"):
        build_tree(lp, big, 8, 3, out=ws)
    with pytest.raises(ValueError, match="token id"):
        chain_tree(np.array([1, -2]), 3, out=ws)
    assert len(ws) == 1


def test_workspace_and_chain_errors():
    lp, ids = _ok_inputs()
    with pytest.raises(ValueError, match="capacity"):
        build_tree(lp, ids, 9, 0, out=DraftTree(8))
    with pytest.raises(ValueError, match="capacity"):
        DraftTree(0)
    with pytest.raises(ValueError, match="capacity"):
        chain_tree(np.arange(5), 0, out=DraftTree(4))
    with pytest.raises(ValueError, match="at least one"):
        chain_tree(np.zeros(0, np.int32), 0)
    with pytest.raises(TypeError, match="int32 or int64"):
        chain_tree(np.zeros(3, np.float32), 0)
    with pytest.raises(ValueError, match="1-D"):
        chain_tree(np.zeros((3, 1), np.int32), 0)


def test_walk_and_commit_reject_bad_input():
    lp, ids = _ok_inputs()
    tree = build_tree(lp, ids, 6, 0)
    with pytest.raises(ValueError, match="length 7"):
        walk(tree, np.zeros(6, np.int32))
    with pytest.raises(TypeError, match="int32 or int64"):
        walk(tree, np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        walk(tree, np.zeros((7, 1), np.int32))
    with pytest.raises(TypeError, match="numpy array"):
        walk(tree, [0] * 7)
    with pytest.raises(TypeError):
        walk(None, np.zeros(7, np.int32))
    accepted, bonus = walk(tree, np.zeros(7, np.int32))
    with pytest.raises(ValueError, match="root-anchored"):
        commit_plan(tree, np.array([1], np.int32), bonus, 0)
    with pytest.raises(ValueError, match="root-anchored"):
        commit_plan(tree, np.array([0, 7], np.int32), bonus, 0)
    leaf = next(i for i in range(1, 7) if tree.parents[i] != 0)
    with pytest.raises(ValueError, match="root-anchored"):
        commit_plan(tree, np.array([0, leaf], np.int32), bonus, 0)
    with pytest.raises(ValueError, match="start with the root"):
        commit_plan(tree, np.zeros(0, np.int32), bonus, 0)
    with pytest.raises(ValueError, match="prefix_len"):
        commit_plan(tree, accepted, bonus, -1)
    with pytest.raises(ValueError, match="bonus"):
        commit_plan(tree, accepted, -3, 0)


# ---------------------------------------------------------------- properties (hypothesis)

@st.composite
def tree_inputs(draw):
    L = draw(st.integers(1, 4))
    K = draw(st.integers(1, 4))
    values = st.sampled_from([0.0, -0.25, -0.5, -1.0, -1.5, -2.0, -3.75]) | st.floats(-8.0, 0.0, width=32)
    lp = np.array([sorted(draw(st.lists(values, min_size=K, max_size=K)), reverse=True) for _ in range(L)],
                  np.float32)
    vocab = K + draw(st.integers(0, 3))
    ids = np.array([draw(st.permutations(range(vocab)))[:K] for _ in range(L)], np.int32)
    budget = draw(st.integers(1, L * K))
    return lp, ids, budget


def _all_scores(lp):
    """Every node of the full tree (rank path -> float64 score, accumulated like the builder)."""
    L, K = lp.shape
    out, frontier = {}, {(): 0.0}
    for d in range(L):
        frontier = {path + (r,): s + float(lp[d, r]) for path, s in frontier.items() for r in range(K)}
        out.update(frontier)
    return out


@settings(max_examples=300, deadline=None)
@given(tree_inputs(), st.randoms(use_true_random=False))
def test_tree_properties(inputs, rnd):
    lp, ids, budget = inputs
    L, K = lp.shape
    tree = build_tree(lp, ids, budget, 0)
    n = len(tree) - 1
    assert n == min(budget, L * K)
    depths, parents, tokens = tree.depths, tree.parents, tree.tokens
    assert depths[0] == 0 and parents[0] == -1
    # Rank path of every node (ids are distinct per row); parent < child; depth = parent's + 1.
    rank_of = [{int(t): r for r, t in enumerate(row)} for row in ids]
    paths = [()]
    for i in range(1, n + 1):
        p = parents[i]
        assert 0 <= p < i and depths[i] == depths[p] + 1 and 1 <= depths[i] <= L
        paths.append(paths[p] + (rank_of[depths[i] - 1][int(tokens[i])],))
    assert len(set(paths)) == n + 1  # prefix-closed (parents exist) and no node twice
    # The popped set is a top-`budget` set of the full tree by score (log-probs <= 0 => monotone).
    scores = _all_scores(lp)
    popped = set(paths[1:])
    assert all(np.float32(scores[p]) == tree.scores[i] for i, p in enumerate(paths) if i)
    worst_in = min(scores[p] for p in popped)
    best_out = max((s for p, s in scores.items() if p not in popped), default=-np.inf)
    assert worst_in >= best_out
    # Visibility: row i = row of parent | bit i, and bits beyond the row's own ancestors are clear.
    vis = tree.visibility
    assert vis.shape == (n + 1, (n + 32) // 32) and vis.dtype == np.uint32
    bits = np.unpackbits(vis.view(np.uint8), axis=1, bitorder="little")[:, : n + 1]
    assert bits[0].tolist() == [1] + [0] * n
    for i in range(1, n + 1):
        expect = bits[parents[i]].copy()
        expect[i] = 1
        np.testing.assert_array_equal(bits[i], expect)
    # Walk: root-anchored path whose tokens are the target's, ending at the first miss.
    target = np.array([rnd.choice([int(tokens[c]) for c in tree.children(i)] + [rnd.randrange(8)])
                       for i in range(n + 1)], np.int32)
    accepted, bonus = walk(tree, target)
    assert accepted[0] == 0
    for k in range(1, len(accepted)):
        assert parents[accepted[k]] == accepted[k - 1] and depths[accepted[k]] == k
        assert tokens[accepted[k]] == target[accepted[k - 1]]
    assert bonus == target[accepted[-1]]
    assert bonus not in [int(tokens[c]) for c in tree.children(int(accepted[-1]))]


# ---------------------------------------------------------------- lossless end-to-end (toy)

class ToyTarget:
    """A fixed random next-token table on the last two tokens: deterministic 'greedy' target."""

    def __init__(self, rng, vocab):
        self.table = rng.integers(0, vocab, (vocab, vocab))

    def next(self, seq):
        return int(self.table[seq[-2], seq[-1]])

    def greedy(self, prompt, count):
        seq = list(prompt)
        for _ in range(count):
            seq.append(self.next(seq))
        return seq[len(prompt):]


@pytest.mark.parametrize("seed", range(4))
def test_lossless_toy_decode(seed):
    rng = np.random.default_rng(seed)
    vocab, steps = 12, 80
    target = ToyTarget(rng, vocab)
    prompt = [int(t) for t in rng.integers(0, vocab, 3)]
    want = target.greedy(prompt, steps)

    out = [target.next(prompt)]  # prefill: the first bonus token
    cache = np.full((len(prompt) + steps + 64, 2), -1, np.int64)  # per slot: (position, token)
    cache[: len(prompt)] = np.stack([np.arange(len(prompt)), prompt], 1)
    prefix_len = len(prompt)
    ws = DraftTree(20)
    rounds = 0
    while len(out) < steps:
        rounds += 1
        committed = prompt + out[:-1]  # tokens whose KV is in the cache
        assert prefix_len == len(committed)
        root = out[-1]
        # Drafter: per position a random top-K that contains the true continuation with prob 0.6.
        L, K = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        truth = target.greedy(committed + [root], L)
        lp, ids = random_inputs(rng, L, K, vocab=vocab, ties=bool(rng.random() < 0.5))
        for d in range(L):
            if rng.random() < 0.6 and truth[d] not in ids[d]:
                ids[d, rng.integers(K)] = truth[d]
        if rng.random() < 0.2:
            tree = chain_tree(ids[:, 0], root, out=ws)
        else:
            tree = build_tree(lp, ids, int(rng.integers(1, min(20, L * K) + 1)), root, out=ws)
        # Verify: node i at slot prefix_len + i, position prefix_len + depth; the target's token per node.
        n1 = len(tree)
        cache[prefix_len: prefix_len + n1] = np.stack([prefix_len + tree.depths, tree.tokens], 1)
        target_tokens = np.empty(n1, np.int32)
        for i in range(n1):
            path, j = [], i
            while j != -1:
                path.append(int(tree.tokens[j]))
                j = tree.parents[j]
            target_tokens[i] = target.next(committed + path[::-1])
        accepted, bonus = walk(tree, target_tokens)
        plan = commit_plan(tree, accepted, bonus, prefix_len)
        for s, d in zip(plan.src_slots, plan.dst_positions):  # in list order, as documented
            cache[d] = cache[s]
        assert plan.tokens[0] == root
        out.extend(int(t) for t in plan.tokens[1:])
        prefix_len = plan.new_prefix_len
        committed = prompt + out[:-1]
        np.testing.assert_array_equal(cache[:prefix_len], np.stack([np.arange(prefix_len), committed], 1))
    assert out[:steps] == want
    assert rounds < steps  # the drafts were accepted at least sometimes
