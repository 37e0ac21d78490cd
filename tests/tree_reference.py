"""Pure-Python oracle for runtime.tree / runtime.accept (heapq), written straight from DESIGN.md.

Kept deliberately naive: Python floats (float64) for scores, visibility from explicit ancestor chains
rather than from the parent's row, children found by scanning the parent array.
"""
import heapq

import numpy as np


def build_tree_ref(top_logp, top_ids, budget, root_token):
    """Returns dict of numpy arrays: tokens, depths, parents, scores (float32), visibility."""
    L, K = top_logp.shape
    lp = [[float(x) for x in row] for row in top_logp]
    tokens, depths, parents, scores = [int(root_token)], [0], [-1], [0.0]
    counter = 0
    heap = [(-lp[0][0], counter, 0, 1, 0)]  # (-score, push order, parent, depth, rank)
    while len(tokens) - 1 < budget and heap:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        node = len(tokens)
        tokens.append(int(top_ids[depth - 1, rank]))
        depths.append(depth)
        parents.append(parent)
        scores.append(score)
        if rank + 1 < K:
            counter += 1
            heapq.heappush(heap, (-(scores[parent] + lp[depth - 1][rank + 1]), counter, parent, depth, rank + 1))
        if depth < L:
            counter += 1
            heapq.heappush(heap, (-(score + lp[depth][0]), counter, node, depth + 1, 0))
    return _finish(tokens, depths, parents, scores)


def chain_tree_ref(tokens, root_token):
    n = len(tokens)
    return _finish([int(root_token)] + [int(t) for t in tokens], list(range(n + 1)),
                   list(range(-1, n)), [0.0] * (n + 1))


def _finish(tokens, depths, parents, scores):
    rows = len(tokens)
    words = (rows + 31) // 32
    vis = np.zeros((rows, words), np.uint32)
    for i in range(rows):
        j = i
        while j != -1:
            vis[i, j // 32] |= np.uint32(1 << (j % 32))
            j = parents[j]
    return {
        "tokens": np.array(tokens, np.int32),
        "depths": np.array(depths, np.int32),
        "parents": np.array(parents, np.int32),
        "scores": np.array(scores, np.float64).astype(np.float32),
        "visibility": vis,
    }


def walk_ref(tokens, parents, target_tokens):
    """Root-anchored greedy match; children scanned in node-index order (= rank order)."""
    accepted = [0]
    node = 0
    while True:
        want = int(target_tokens[node])
        nxt = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == want), None)
        if nxt is None:
            return np.array(accepted, np.int32), want
        accepted.append(nxt)
        node = nxt
