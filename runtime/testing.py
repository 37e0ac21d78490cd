"""Helpers shared by the kernel tests and the benchmarks (no GPU needed to import): random draft trees as
visibility bitmasks, the one numpy compare helper every kernel test uses (DESIGN.md: shape, dtype, then a
tolerance scaled to the dtype, printing the first mismatches; NaN and inf never pass), device buffers
for the GPU tests (bf16 uploads, NaN-poisoned outputs), and the greedy-split check of the lossless tests (where
AR and DDTree outputs differ, is it a bf16 near-tie of the float32 reference?)."""
from __future__ import annotations

import numpy as np

from runtime.bf16 import from_bf16

# ---------------------------------------------------------------- random trees


def random_parents(rng: np.random.Generator, n: int, window: int | None = None) -> np.ndarray:
    """Parents of a random tree over n nodes: node 0 is the root (-1), node i's parent is drawn uniformly from
    [0, i) (or from the `window` nodes just before i, which makes deeper trees). int64 [n]."""
    parents = [-1] + [int(rng.integers(0 if window is None else max(0, i - window), i)) for i in range(1, n)]
    return np.array(parents, np.int64)


def tree_visibility(parents) -> np.ndarray:
    """The ancestor bitmask of a tree given by its parents (parent index < node index), as runtime.tree builds
    it: uint32 [n, ceil(n/32)], bit j of row i set iff node j is node i or one of its ancestors."""
    parents = np.asarray(parents)
    n = parents.size
    vis = np.zeros((n, (n + 31) // 32), np.uint32)
    for i in range(n):
        p = int(parents[i])
        if p >= i:
            raise ValueError(f"parents[{i}] = {p}: a parent must come before its child")
        if p >= 0:
            vis[i] = vis[p]
        vis[i, i // 32] |= np.uint32(1 << (i % 32))
    return vis


def tree_depths(parents) -> np.ndarray:
    """Depth of every node (root 0), int32 [n]."""
    parents = np.asarray(parents)
    depths = np.zeros(parents.size, np.int32)
    for i in range(1, parents.size):
        depths[i] = depths[parents[i]] + 1
    return depths


def random_tree_visibility(rng: np.random.Generator, n: int, window: int | None = None) -> np.ndarray:
    """tree_visibility(random_parents(rng, n, window))."""
    return tree_visibility(random_parents(rng, n, window))


# ---------------------------------------------------------------- the compare helper

# Default relative tolerance per output dtype: one bf16 rounding of the output is 2^-8 relative, allow two.
RTOL = {"bf16": 2.0 ** -7, "fp32": 1e-5}
_STORAGE = {"bf16": np.dtype(np.uint16), "fp32": np.dtype(np.float32)}


def assert_close(got, want, what: str = "", *, dtype: str = "fp32", rtol: float | None = None,
                 atol: float = 0.0, scale: str | None = "max", slack=None, show: int = 5):
    """Assert got == want within tolerance, elementwise:

        |got - want| <= rtol * |want| + atol * S (+ slack),   S = max|want| (scale="max"), mean|want| ("mean"),
        1 (None); slack: an optional array of absolute per-element allowances broadcast to want's shape (what
        the reference knows an intermediate rounding can move each element by)

    In order: the shapes must match; `got` must be stored as `dtype` ("bf16": uint16 bit patterns, as a
    DeviceArray download gives them, converted exactly; "fp32": float32); `want` must be finite; every
    non-finite value in `got` fails, whatever the tolerance. rtol defaults to RTOL[dtype]. The message gives
    the mismatch count, the largest error and the first `show` mismatches with their values."""
    if dtype not in _STORAGE:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(_STORAGE)}")
    if scale not in ("max", "mean", None):
        raise ValueError(f"scale {scale!r}: 'max', 'mean' or None")
    got, want = np.asarray(got), np.asarray(want)
    where = f"{what}: " if what else ""
    assert got.shape == want.shape, f"{where}shape {got.shape} != expected {want.shape}"
    assert got.dtype == _STORAGE[dtype], f"{where}dtype {got.dtype}, expected {dtype} ({_STORAGE[dtype]})"
    got = (from_bf16(got).reshape(got.shape) if dtype == "bf16" else got).astype(np.float64)
    want = want.astype(np.float64)
    assert np.isfinite(want).all(), f"{where}the reference itself is not finite"
    rtol = RTOL[dtype] if rtol is None else rtol
    mag = np.abs(want)
    s = 1.0 if scale is None or want.size == 0 else float(mag.max() if scale == "max" else mag.mean())
    err = np.abs(got - want)
    bound = rtol * mag + atol * s
    if slack is not None:
        bound = bound + np.broadcast_to(np.asarray(slack, np.float64), want.shape)
    bad = ~np.isfinite(got) | ~(err <= bound)    # written so that a NaN error is bad
    if bad.any():
        idx = np.argwhere(bad)[:show]
        first = ", ".join(f"{tuple(int(v) for v in i)}: got {got[tuple(i)]:.6g} want {want[tuple(i)]:.6g}"
                          for i in idx)
        nonfinite = int((~np.isfinite(got)).sum())
        plus = " + slack" if slack is not None else ""
        raise AssertionError(f"{where}{int(bad.sum())} of {bad.size} elements differ ({nonfinite} not finite; rtol "
                             f"{rtol:g}, atol {atol:g} x {scale or 'abs'} {s:.3g}{plus}; largest finite error "
                             f"{np.max(np.where(np.isfinite(err), err, 0)):.3g}); first: {first}")


# ---------------------------------------------------------------- device buffers (GPU tests)


def dev_bf16(host_f32):
    """A float32 host array rounded to bf16 on the device."""
    from runtime.bf16 import to_bf16
    from runtime.cuda import to_device
    return to_device(to_bf16(host_f32))


def poisoned(shape, dtype=np.uint16):
    """An output buffer with every byte 0xFF (bf16 and float32 NaN, int32 -1): a skipped element fails."""
    from runtime.cuda import empty
    return empty(shape, dtype).fill_bytes(0xFF)


def recorded_graph(stream, record):
    """record(): launches on `stream`. Runs it once eagerly (modules loaded, workspaces sized outside the
    capture), then captures it: the instantiated graph."""
    from runtime.cuda import capture
    record()
    stream.synchronize()
    with capture(stream) as g:
        record()
    return g.instantiate()


# ---------------------------------------------------------------- greedy splits (lossless checks)
# The engine's AR step and its tree verify run different kernels (one-row gemv and decode attention vs many-row
# GEMMs), which round differently in bf16, so greedy AR and DDTree outputs may split where the target's two best
# logits are nearly equal. A split is such a near-tie when the float32 reference (numpy backend, same weights)
# has a top-2 gap below NEAR_TIE x its logits' std there and both split tokens are its top two. On the real
# SmolLM2 weights (H200, tools/logit_error.py, docs/PERF.md session 16) each GPU path's largest logit error per
# position is 0.06-0.24 std (median 0.11 prefill / verify, 0.13 AR); 0.05 failed there at a 0.074 gap.
NEAR_TIE = 0.15


def first_divergence(a, b) -> int | None:
    """The first index where token lists a and b differ (None if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def forward_logits(model, seq, chunks) -> np.ndarray:
    """Logits [len(seq), vocab] (float32, host) of `model` over the token sequence `seq` from position 0, fed as
    forwards of the given chunk lengths into one KV cache (each chunk's rows see the cache and, causally, each
    other): [len(seq)] is one prefill, [n, 1, 1, ...] AR steps after an n-token prompt."""
    from runtime.backends.base import causal_visibility
    b = model.backend
    cache = model.new_cache(len(seq) + 1)
    out, p = [], 0
    for n in chunks:
        h, _ = model.forward(cache, b.from_host(np.asarray(seq[p:p + n], np.int32)),
                             b.from_host(np.arange(p, p + n, dtype=np.int32)), b.from_host(causal_visibility(n)))
        cache.length += n
        out.append(np.asarray(b.to_host(model.logits(h)), np.float32))
        p += n
    return np.concatenate(out)


def reference_logits(ref_model, seq) -> tuple[np.ndarray, int]:
    """The reference model's logits after the token sequence `seq` (prefilled from position 0) on the host, and
    the position of its last token (what a sample of the next token is keyed by)."""
    return forward_logits(ref_model, seq, [len(seq)])[-1], len(seq) - 1


def greedy_split(ref_model, prompt, a_tokens, b_tokens) -> dict | None:
    """Where greedy outputs a and b (continuations of `prompt`) first differ, what the reference says there:
    {index, a, b, gap (its top-2 gap), gap_std (over its logits' std), top2 (both tokens are its two best),
    tie (top2 and gap_std < NEAR_TIE)}; None where they do not differ."""
    i = first_divergence(a_tokens, b_tokens)
    if i is None:
        return None
    z, _ = reference_logits(ref_model, list(prompt) + list(a_tokens[:i]))
    order = np.argsort(z)
    gap = float(z[order[-1]] - z[order[-2]])
    top2 = {int(a_tokens[i]), int(b_tokens[i])} <= {int(order[-1]), int(order[-2])}
    gap_std = gap / float(z.std())
    return dict(index=i, a=int(a_tokens[i]), b=int(b_tokens[i]), gap=gap, gap_std=gap_std, top2=top2,
                tie=top2 and gap_std < NEAR_TIE)
