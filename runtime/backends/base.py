"""The backend interface: every op a model forward and the engine need, and nothing else.

Models (runtime/models) are written once against this class; the numpy backend (float32 reference, the
oracle) and the CUDA backend implement it. The interface is buffer-oriented so that a CUDA backend can
capture a whole forward in a graph:
- KV caches are static buffers with a capacity, allocated once (`empty`); ops write into them at a slot
  offset (`kv_write`) and never resize them.
- Positions are arrays (the tree verify uses start + depth, not a range).
- Attention always reads the cache slots [0, n_prefix + T): the first n_prefix slots are visible to every
  query, the last T (the tokens of this call) through a visibility bitmask. A causal prefill passes the
  lower-triangular mask, a tree verify the tree's ancestor mask, the DFlash block an all-ones mask.
- KV compaction after the accept walk is an op (`kv_compact`), so accepted tree nodes move inside the cache.

Arrays: `Array` is the backend's device array type (numpy.ndarray for the numpy backend). Models may use
`.shape`, `.reshape`, and basic slicing views on it (`x[:, :n]`, `cache[:, :, :512]`), nothing else; every
computation goes through a method here. Host arrays (numpy) go in through `from_host` / the weight methods
and come out through `to_host`.

Shapes use T = tokens in this call, H = heads, D = head dim, E = experts, V = vocab. Index arrays (ids,
positions, slots) are int32/int64 host-or-device arrays of length T.

Bitmask: `visibility` is uint32 [T, ceil(T / 32)]; bit (j % 32) of word j // 32 in row i is set iff new
token i may attend to new token j (DESIGN.md, "Contract: the tree").
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

Array = Any      # the backend's array type
Weight = Any     # a backend weight handle (dense bf16/fp32, INT4, stacked experts, per-head)


class Backend(ABC):
    name: str = "abstract"

    # ---- memory -------------------------------------------------------------------------------------------
    @abstractmethod
    def empty(self, shape: Sequence[int], dtype=np.float32) -> Array:
        """An uninitialised buffer (KV caches, scratch). Contents are undefined until written."""

    @abstractmethod
    def from_host(self, x: np.ndarray) -> Array:
        """Copy a host array to the backend (activations, ids, positions, bitmasks)."""

    @abstractmethod
    def to_host(self, x: Array) -> np.ndarray:
        """Copy to a host numpy array (float32 for activations)."""

    # ---- weights (called once at load) --------------------------------------------------------------------
    @abstractmethod
    def dense_weight(self, w: np.ndarray) -> Weight:
        """A dense weight from host: float32, or uint16 bf16 bits. Linear weights are [out, in] (HF layout);
        norms and biases are 1-D; an embedding table is [V, hidden]."""

    @abstractmethod
    def int4_weight(self, weight_packed: np.ndarray, weight_scale: np.ndarray, weight_shape) -> Weight:
        """A compressed-tensors pack-quantized INT4 linear weight (DESIGN.md, Formats), usable by `linear`."""

    @abstractmethod
    def stack_experts(self, gate: Sequence[Weight], up: Sequence[Weight], down: Sequence[Weight]) -> Weight:
        """The routed experts of one MoE layer (E of each; gate/up [I, hidden], down [hidden, I]), each dense
        or INT4, stacked into whatever layout `moe_experts` wants."""

    @abstractmethod
    def head_weight(self, w: np.ndarray) -> Weight:
        """A per-head weight [H, a, b] (float32 or bf16 bits) for `head_linear` (MLA weight absorption)."""

    # ---- ops ----------------------------------------------------------------------------------------------
    @abstractmethod
    def embedding(self, table: Weight, ids: Array) -> Array:
        """table[ids] -> [T, hidden] float. Also the row gather of activations (`table` an Array): the engine
        picks the accepted nodes' tap hidden states with it."""

    @abstractmethod
    def rmsnorm(self, x: Array, weight: Weight, eps: float) -> Array:
        """x / sqrt(mean(x^2, -1) + eps) * weight over the last axis (any leading shape)."""

    @abstractmethod
    def linear(self, x: Array, w: Weight, bias: Weight | None = None) -> Array:
        """x [T, in] @ w.T (+ bias) -> [T, out]. `w` dense or INT4."""

    @abstractmethod
    def head_linear(self, x: Array, w: Weight) -> Array:
        """Per-head matmul: x [T, H, a], w [H, a, b] -> [T, H, b]."""

    @abstractmethod
    def add(self, a: Array, b: Array) -> Array:
        """a + b (residual stream)."""

    @abstractmethod
    def concat(self, parts: Sequence[Array], axis: int = -1) -> Array:
        """Concatenate along `axis` (MLA: [latent | rope key] cache entries, absorbed queries)."""

    @abstractmethod
    def swiglu(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up."""

    @abstractmethod
    def rope(self, x: Array, positions: Array, inv_freq: Array, attention_scaling: float,
             interleaved: bool) -> Array:
        """Rotary embedding of x [T, H, D] at `positions` [T]: angle = float32(position) * inv_freq [D/2],
        cos/sin multiplied by `attention_scaling` (YaRN's mscale; 1 otherwise). interleaved=False pairs
        dims (i, i + D/2) (Llama/Qwen); interleaved=True pairs (2i, 2i + 1) (DeepSeek), and returns the
        rotated pairs de-interleaved [evens | odds] like HF: q and k get the same permutation, so q.k holds."""

    @abstractmethod
    def kv_write(self, cache: Array, start: int, values: Array) -> None:
        """cache[start:start + T] = values (cache [capacity, ...], values [T, ...])."""

    # ---- fused compositions: defaults run the ops above; a backend may do each in fewer kernels ------------
    def norm_linear(self, x: Array, weight: Weight, eps: float, w: Weight, bias: Weight | None = None) -> Array:
        """linear(rmsnorm(x, weight, eps), w, bias)."""
        return self.linear(self.rmsnorm(x, weight, eps), w, bias)

    def swiglu_linear(self, gate: Array, up: Array, w: Weight) -> Array:
        """linear(swiglu(gate, up), w)."""
        return self.linear(self.swiglu(gate, up), w)

    def rope_write_kv(self, q: Array, k: Array, v: Array, positions: Array, inv_freq: Array,
                      attention_scaling: float, interleaved: bool, k_cache: Array, v_cache: Array,
                      start: int) -> Array:
        """RoPE on q [T, Hq, D] and k [T, Hkv, D]; rotated k and v written at cache slots start..start+T-1;
        returns rotated q. q and k may be the results of a per-head rmsnorm (Qwen3 q_norm/k_norm)."""
        q = self.rope(q, positions, inv_freq, attention_scaling, interleaved)
        k = self.rope(k, positions, inv_freq, attention_scaling, interleaved)
        self.kv_write(k_cache, start, k)
        self.kv_write(v_cache, start, v)
        return q

    @abstractmethod
    def attention(self, q: Array, k_cache: Array, v_cache: Array, n_prefix: int, visibility: Array,
                  scale: float) -> Array:
        """Softmax attention of q [T, H, Dk] over cache slots [0, n_prefix + T) of k_cache [cap, Hkv, Dk],
        v_cache [cap, Hkv, Dv] (H % Hkv == 0; query head h reads kv head h // (H / Hkv)). Slots below
        n_prefix are visible to every query; new slot n_prefix + j is visible to query i iff bit j of
        visibility row i is set. `v_cache` may be a view of `k_cache` (MLA: values = the latent part of the
        key). Returns [T, H, Dv]."""

    @abstractmethod
    def kv_compact(self, cache: Array, src_slots: Array, dst_start: int) -> None:
        """cache[dst_start + i] = cache[src_slots[i]] for all i, reading every source before writing
        (src_slots ascending and >= dst_start + i, as after an accept walk)."""

    @abstractmethod
    def moe_route(self, router_logits: Array, bias: Weight | None, n_group: int, topk_group: int, top_k: int,
                  norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[Array, Array]:
        """DeepSeek-V3 noaux_tc routing over router_logits [T, E] (float32): s = sigmoid(logits); choice =
        s + bias; group score = sum of the top 2 choices per group; keep the best topk_group groups; top_k
        experts by choice among them; weights = s at those experts (/ their sum if norm_topk_prob) *
        routed_scaling_factor. Returns (expert ids int32 [T, k], weights float32 [T, k])."""

    @abstractmethod
    def moe_experts(self, x: Array, expert_ids: Array, expert_weights: Array, experts: Weight) -> Array:
        """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = expert_ids[t, j]."""

    @abstractmethod
    def log_softmax_topk(self, logits: Array, k: int) -> tuple[Array, Array]:
        """Per row of logits [L, V], in float32: the k largest log_softmax values, sorted descending, and
        their token ids (ties: lower id first). Returns (float32 [L, k], int32 [L, k])."""

    @abstractmethod
    def argmax(self, logits: Array) -> Array:
        """Per row of [T, V]: the index of the largest logit (ties: lowest index). int32 [T]."""

    @abstractmethod
    def sample(self, logits: Array, temperature: float, positions: Array, key: Array) -> Array:
        """Per row of [T, V]: a sample of softmax(logits / temperature) by inverse CDF, int32 [T]: the first
        index whose cumulative mass exceeds u * total (sums in index order). u is Philox4x32-10 of counter
        (positions[row], 0, 0, 0) under key (uint32 [2] = the seed's lo, hi words), first output word's top 24
        bits * 2^-24 (runtime/philox.py). positions int32 [T] = each row's absolute sequence position (the
        position of the token whose next token is drawn), so the token after position p depends only on
        (seed, p, logits): AR and every tree node at p draw alike, on every backend. `key` is an array (on
        the device for CUDA) so a captured graph takes a new seed without re-capture."""


def causal_visibility(t: int) -> np.ndarray:
    """The visibility bitmask [t, ceil(t/32)] of a causal block: token i sees tokens 0..i."""
    words = (t + 31) // 32
    dense = np.tril(np.ones((t, words * 32), dtype=bool))
    return _pack_rows(dense)


def full_visibility(t: int) -> np.ndarray:
    """The visibility bitmask of a non-causal block (every token sees every token of the block)."""
    words = (t + 31) // 32
    dense = np.zeros((t, words * 32), dtype=bool)
    dense[:, :t] = True
    return _pack_rows(dense)


def _pack_rows(dense: np.ndarray) -> np.ndarray:
    packed = np.packbits(dense, axis=1, bitorder="little")     # bit j of byte j//8, little-endian words
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def unpack_visibility(visibility: np.ndarray, t: int) -> np.ndarray:
    """bool [t, t] from a visibility bitmask [t, words]."""
    v = np.ascontiguousarray(visibility, dtype="<u4")
    return np.unpackbits(v.view(np.uint8), axis=1, bitorder="little")[:, :t].astype(bool)
