"""float32 numpy references for the Kimi K2.x kernels (runtime/kimi_kernels.py): noaux_tc routing, the
grouping of tokens by expert, the INT4 MoE layer and MLA absorbed attention with a tree mask or causal.
They define the semantics the GPU kernels are tested against, including tie-breaking (lower index wins)."""
from __future__ import annotations

import numpy as np

from .bf16 import round_bf16


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float32)))


def _argmax_lowest(v: np.ndarray) -> int:
    """Index of the maximum, the lowest index among ties (what the kernels do)."""
    return int(np.flatnonzero(v == v.max())[0])


def route(logits: np.ndarray, bias: np.ndarray, topk: int = 8, n_group: int = 1, topk_group: int = 1,
          norm_topk_prob: bool = True, routed_scaling_factor: float = 2.827):
    """DeepSeek-V3 noaux_tc: returns (ids int32 [T, topk] in pick order, weights float32 [T, topk])."""
    logits = np.asarray(logits, np.float32)
    t_count, e_count = logits.shape
    scores = sigmoid(logits)
    choice = scores + np.asarray(bias, np.float32)[None, :]
    ids = np.zeros((t_count, topk), np.int32)
    w = np.zeros((t_count, topk), np.float32)
    for t in range(t_count):
        c = choice[t].copy()
        if n_group > 1:
            gsize = e_count // n_group
            grp = c.reshape(n_group, gsize)
            top2 = np.sort(grp, axis=1)[:, -2:]
            gscore = top2[:, 0] + top2[:, 1]
            keep = np.zeros(n_group, bool)
            for _ in range(topk_group):
                v = np.where(keep, -np.inf, gscore)
                keep[_argmax_lowest(v)] = True
            c = np.where(np.repeat(keep, gsize), c, -np.inf).astype(np.float32)
        for r in range(topk):
            e = _argmax_lowest(c)
            ids[t, r] = e
            w[t, r] = scores[t, e]
            c[e] = -np.inf
    if norm_topk_prob:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    return ids, (w * routed_scaling_factor).astype(np.float32)


def group_by_expert(ids: np.ndarray, num_experts: int):
    """counts [E], offsets [E] (exclusive, by expert id), and the sorted order: for expert e its tokens in
    increasing order at offsets[e]...; assign_pos [T, topk] = position of (t, j) in that order."""
    ids = np.asarray(ids)
    counts = np.bincount(ids.ravel(), minlength=num_experts).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    order = np.argsort(ids.ravel(), kind="stable")           # assignment indices grouped by expert
    sorted_token = (order // ids.shape[1]).astype(np.int32)
    assign_pos = np.empty(ids.size, np.int32)
    assign_pos[order] = np.arange(ids.size, dtype=np.int32)
    return counts, offsets, sorted_token, assign_pos.reshape(ids.shape)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def moe(x: np.ndarray, ids: np.ndarray, w: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
        shared: np.ndarray | None = None, with_slack: bool = False):
    """Routed MoE in float32. x [T, K]; gate/up [E, I, K], down [E, K, I] float32 (dequantized); the
    intermediate h and each expert's output are rounded through bf16 as the kernels store them (as a bf16
    model's expert MLP returns them); the weighted sum over the picks is float32. Returns float32 [T, K].

    with_slack: also return, per output element, sum_j |w[t, j]| * ulp(expert output j): what the rounding
    of the expert outputs can move the result by when the kernel's float32 sum (another summation order)
    and this one fall on the two sides of a bf16 rounding boundary. Returns (y, slack)."""
    x = np.asarray(x, np.float32)
    y = np.zeros((x.shape[0], down.shape[1]), np.float32)
    slack = np.zeros_like(y)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = round_bf16(silu(gate[e] @ x[t]) * (up[e] @ x[t]))
            out = round_bf16(down[e] @ h)
            y[t] += w[t, j] * out
            slack[t] += abs(w[t, j]) * bf16_ulp(out)
    if shared is not None:
        y += shared
    return (y, slack) if with_slack else y


def shared_mlp(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """The shared expert's bf16 SwiGLU MLP in float32: gate_up [2 I, K] (gate rows, then up), down [K, I];
    gate / up, h and the output rounded through bf16 as the dense kernels store them. Returns float32 [T, K]."""
    x = np.asarray(x, np.float32)
    inter = down.shape[1]
    gu = round_bf16(x @ np.asarray(gate_up, np.float32).T)
    h = round_bf16(silu(gu[:, :inter]) * gu[:, inter:])
    return round_bf16(h @ np.asarray(down, np.float32).T)


def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """The spacing of bf16 values at |v| (8 significant bits; the smallest normal's spacing below it)."""
    e = np.floor(np.log2(np.maximum(np.abs(np.asarray(v, np.float64)), 2.0 ** -126)))
    return (2.0 ** (e - 7)).astype(np.float32)


def mla_attention(q: np.ndarray, kv: np.ndarray, prefix_len: int, softmax_scale: float,
                  mask: np.ndarray | None = None) -> np.ndarray:
    """q [Tq, H, 576], kv [prefix_len + Tq, 576] (latent 512 + rope 64). mask: uint32 [Tq, W] tree
    visibility rows (node j visible to query i iff bit j of row i) or None for causal. Returns the
    attention-weighted latent float32 [Tq, H, 512]."""
    q = np.asarray(q, np.float32)
    kv = np.asarray(kv, np.float32)
    tq, h, _ = q.shape
    s = np.einsum("thd,pd->thp", q, kv) * softmax_scale
    vis = np.ones((tq, kv.shape[0]), bool)
    nodes = np.arange(tq)
    if mask is None:
        vis[:, prefix_len:] = nodes[None, :] <= nodes[:, None]
    else:
        bits = (mask[:, nodes // 32] >> (nodes % 32).astype(np.uint32)) & 1
        vis[:, prefix_len:] = bits.astype(bool)
    s = np.where(vis[:, None, :], s, -np.inf)
    s = s - s.max(axis=2, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=2, keepdims=True)
    return np.einsum("thp,pd->thd", p, kv[:, :512])
