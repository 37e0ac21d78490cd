"""A numpy transcription of the block routing of cutlass_kernels/moe_routing.cu (route_tokens_block: the
order-preserving 64-bit keys, each warp's ranks, the candidates' ranks) and of group_picks_warp (one warp grouping up
to 32 picks by __match_any), step for step with the kernels' thread roles, against runtime.kimi_reference on random
logits with exact ties. This checks the algorithm on the CPU; the GPU tests check the kernels' bits against
moe_topk + moe_group (test_kimi_kernels.py test_routing_same_bits_as_two_kernels)."""
import numpy as np
import pytest

from runtime import kimi_reference as ref


def route_keys(choice: np.ndarray, width: int) -> np.ndarray:
    """route_key for experts 0..E-1, then the keys of the padding threads E..width-1 (high word 0)."""
    u = (np.asarray(choice, np.float32) + np.float32(0.0)).view(np.uint32)   # -0 + +0 = +0
    u = np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint64)
    e = np.arange(width, dtype=np.uint64)
    keys = np.uint64(0xFFFFFFFF) - e
    keys[:len(u)] |= u << np.uint64(32)
    return keys


def route_token_block(logit, bias, topk, n_group, topk_group, rsf=2.827):
    """One token as route_tokens_block routes it: (picks in pick order, weights)."""
    E = len(logit)
    width = 32 * -(-E // 32)
    score = ref.sigmoid(logit)
    choice = (score + bias).astype(np.float32)
    if n_group > 1:
        gsize = E // n_group
        sums = []
        for g in range(n_group):   # thread (t, g): the group's two best by a running scan
            b1 = b2 = np.float32(-np.inf)
            for v in choice[g * gsize:(g + 1) * gsize]:
                if v > b1:
                    b1, b2 = v, b1
                elif v > b2:
                    b2 = v
            sums.append(np.float32(b1 + b2))
        keep = [sum(o > s or (o == s and h < g) for h, o in enumerate(sums)) < topk_group
                for g, s in enumerate(sums)]
        choice = np.where(np.repeat(keep, gsize), choice, np.float32(-np.inf)).astype(np.float32)
    keys = route_keys(choice, width)
    cands = np.zeros(width // 32 * topk, np.uint64)
    for w in range(width // 32):   # phase 1: each warp ranks its 32 keys
        mine = keys[32 * w:32 * (w + 1)]
        for lane in range(32):
            r = int(np.sum(mine > mine[lane]))
            if r < topk:
                cands[w * topk + r] = mine[lane]
    picks = np.zeros(topk, np.int64)
    for c in range(len(cands)):   # phase 2: each candidate's rank among the candidates
        r = int(np.sum(cands > cands[c]))
        if r < topk:
            picks[r] = 0xFFFFFFFF - int(cands[c] & np.uint64(0xFFFFFFFF))
    w = score[picks]
    wsum = np.float32(0)
    for v in w:   # in pick order, as the kernel's lane loop
        wsum = np.float32(wsum + v)
    return picks, (w * np.float32(np.float32(rsf) / np.float32(wsum + np.float32(1e-20)))).astype(np.float32)


def group_picks_warp(ids: np.ndarray, E: int):
    """group_picks_warp's outputs for ids [T, topk] (T * topk <= 32): lane a holds pick a."""
    topk = ids.shape[1]
    P = ids.size
    lane_id = np.array([ids.ravel()[a] if a < P else -1 - a for a in range(32)])
    count = np.zeros(E, np.int32)
    num_slots = min(E, P)
    slot_expert, slot_offset, slot_count = (np.full(num_slots, -1, np.int32), np.zeros(num_slots, np.int32),
                                            np.zeros(num_slots, np.int32))
    sorted_token, assign_pos = np.full(P, -1, np.int32), np.full(P, -1, np.int32)
    same = [lane_id == lane_id[a] for a in range(32)]            # __match_any_sync
    cnt = np.array([int(same[a].sum()) for a in range(32)])
    before = np.array([int(same[a][:a].sum()) for a in range(32)])
    first = np.array([a < P and before[a] == 0 for a in range(32)])
    for a in range(P):
        off = int(np.sum(lane_id[:P] < lane_id[a]))
        slot = int(sum(first[b] and (cnt[b] > cnt[a] or (cnt[b] == cnt[a] and lane_id[b] < lane_id[a]))
                       for b in range(P)))
        sorted_token[off + before[a]] = a // topk
        assign_pos[a] = off + before[a]
        if first[a]:
            count[lane_id[a]] = cnt[a]
            slot_expert[slot], slot_offset[slot], slot_count[slot] = lane_id[a], off, cnt[a]
    return count, slot_expert, slot_offset, slot_count, sorted_token, assign_pos.reshape(ids.shape)


@pytest.mark.parametrize("T,E,topk,n_group,topk_group", [
    (1, 384, 8, 1, 1), (2, 384, 8, 1, 1), (4, 384, 8, 8, 4), (3, 300, 6, 1, 1), (2, 64, 16, 4, 2),
    (3, 64, 8, 32, 8), (4, 256, 8, 8, 4)])
def test_block_routing_and_warp_grouping_match_the_reference(T, E, topk, n_group, topk_group):
    rng = np.random.default_rng(T * 1000 + E + topk)
    for trial in range(4):
        logits = rng.standard_normal((T, E)).astype(np.float32)
        bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
        if trial % 2:   # exact ties in the choice values: the lower expert must win
            logits[:, 5] = logits[:, 9]
            bias[9] = bias[5]
        if trial == 3:   # and many skewed picks: tokens sharing experts
            logits[:, :topk] += 4.0
        ids_ref, w_ref = ref.route(logits, bias, topk, n_group, topk_group)
        ids = np.zeros((T, topk), np.int64)
        for t in range(T):
            ids[t], w = route_token_block(logits[t], bias, topk, n_group, topk_group)
            np.testing.assert_allclose(w, w_ref[t], rtol=2e-6, err_msg=f"weights, token {t}")
        np.testing.assert_array_equal(ids, ids_ref)
        count, se, so, sc, st, pos = group_picks_warp(ids, E)
        counts, offsets, sorted_token, assign_pos = ref.group_by_expert(ids_ref, E)
        np.testing.assert_array_equal(count, counts)
        np.testing.assert_array_equal(st, sorted_token)
        np.testing.assert_array_equal(pos, assign_pos)
        order = sorted(np.flatnonzero(counts), key=lambda e: (-counts[e], e))
        np.testing.assert_array_equal(se[:len(order)], order)
        assert (se[len(order):] == -1).all()
        np.testing.assert_array_equal(so[:len(order)], offsets[order])
        np.testing.assert_array_equal(sc[:len(order)], counts[order])


def test_keys_order_as_the_values_then_the_lower_index():
    v = np.array([0.5, -1.0, 0.5, -np.inf, 2.0, -0.0, 0.0], np.float32)
    keys = route_keys(v, 32)
    order = sorted(range(len(v)), key=lambda e: -int(keys[e]))
    assert order == [4, 0, 2, 5, 6, 1, 3]         # ties (0.5, +-0) to the lower index; -0 equals +0
    assert keys[len(v):].max() < keys[:len(v)].min()   # padding below every expert, even -inf
