"""DFlash block-diffusion drafter (DFlashDraftModel), written against the backend interface.

Context: the target's residual stream after each tap layer (target_layer_ids), concatenated on the feature
axis -> fc -> hidden_norm. Every drafter layer projects that same context with its own k_proj (+ k_norm,
RoPE at the context tokens' positions) and v_proj, and keeps the result in its KV cache for good: context
is "injected" as KV, never run through the layers.
Block: [bonus, MASK x (block-1)], embedded with the TARGET's embedding, at positions start..start+block-1;
Qwen3-style layers attend non-causally over all context KV plus the block; `norm`; the TARGET's lm_head
turns block positions 1.. into draft logits. Block KV is scratch: written after the committed context and
overwritten by the next draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.spec import DFlashSpec
from runtime.backends.base import full_visibility
from .common import KVCache, Weights, as_f32, build_kv_cache, rope_parameters


@dataclass
class _Layer:
    input_norm: object
    q: object
    k: object
    v: object
    q_norm: object
    k_norm: object
    o: object
    post_norm: object
    gate_up: object
    down: object


class DFlashDrafter:
    def __init__(self, spec: DFlashSpec, weights, backend):
        self.spec, self.backend = spec, backend
        w, b = Weights(weights), backend
        self.block_size, self.mask_token_id = spec.block_size, spec.mask_token_id
        self.target_layer_ids = tuple(spec.target_layer_ids)
        self.n_heads, self.n_kv, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.fc = b.dense_weight(w.get("fc.weight"))
        self.hidden_norm = b.dense_weight(w.get("hidden_norm.weight"))
        self.norm = b.dense_weight(w.get("norm.weight"))
        self.layers = []
        for i in range(spec.num_hidden_layers):
            p, a = f"layers.{i}.", f"layers.{i}.self_attn."
            gate, up = as_f32(w.get(p + "mlp.gate_proj.weight")), as_f32(w.get(p + "mlp.up_proj.weight"))
            self.layers.append(_Layer(
                input_norm=b.dense_weight(w.get(p + "input_layernorm.weight")),
                q=b.dense_weight(w.get(a + "q_proj.weight")), k=b.dense_weight(w.get(a + "k_proj.weight")),
                v=b.dense_weight(w.get(a + "v_proj.weight")),
                q_norm=b.dense_weight(w.get(a + "q_norm.weight")), k_norm=b.dense_weight(w.get(a + "k_norm.weight")),
                o=b.dense_weight(w.get(a + "o_proj.weight")),
                post_norm=b.dense_weight(w.get(p + "post_attention_layernorm.weight")),
                gate_up=b.dense_weight(np.concatenate([gate, up])), down=b.dense_weight(w.get(p + "mlp.down_proj.weight"))))
        inv_freq, self.rope_scaling = rope_parameters(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.inv_freq = b.from_host(inv_freq)
        self.scale = spec.head_dim ** -0.5
        self.block_visibility = b.from_host(full_visibility(spec.block_size))

    def new_cache(self, capacity: int) -> KVCache:
        shape = (self.n_kv, self.head_dim)
        return build_kv_cache(self.backend, len(self.layers), capacity, shape, shape)

    def add_context(self, cache: KVCache, tap_hidden, positions) -> None:
        """Append context for tokens at `positions` [C]: tap_hidden [C, n_taps * hidden] (the target's tap
        layers concatenated in target_layer_ids order). Committed: advances cache.length by C."""
        b, s = self.backend, self.spec
        c = tap_hidden.shape[0]
        if cache.length + c + self.block_size > cache.capacity:
            raise ValueError(f"drafter KV cache overflow: {cache.length} + {c} + block > {cache.capacity}")
        ctx = b.rmsnorm(b.linear(tap_hidden, self.fc), self.hidden_norm, s.rms_norm_eps)
        for i, L in enumerate(self.layers):
            k = b.rmsnorm(b.linear(ctx, L.k).reshape(c, self.n_kv, self.head_dim), L.k_norm, s.rms_norm_eps)
            b.kv_write(cache.k[i], cache.length, b.rope(k, positions, self.inv_freq, self.rope_scaling, False))
            b.kv_write(cache.v[i], cache.length, b.linear(ctx, L.v).reshape(c, self.n_kv, self.head_dim))
        cache.length += c

    def draft(self, cache: KVCache, block_embeds, positions):
        """block_embeds [block, hidden] (target embedding of [bonus, MASK...]) at `positions` -> the drafter's
        final-normed hidden [block, hidden]. Feed rows 1.. to the target's lm_head."""
        b, s = self.backend, self.spec
        x = block_embeds
        t, start = x.shape[0], cache.length
        hq, d = self.n_heads * self.head_dim, self.head_dim
        for i, L in enumerate(self.layers):
            h = b.rmsnorm(x, L.input_norm, s.rms_norm_eps)
            q = b.rmsnorm(b.linear(h, L.q).reshape(t, self.n_heads, d), L.q_norm, s.rms_norm_eps)
            k = b.rmsnorm(b.linear(h, L.k).reshape(t, self.n_kv, d), L.k_norm, s.rms_norm_eps)
            q = b.rope(q, positions, self.inv_freq, self.rope_scaling, False)
            b.kv_write(cache.k[i], start, b.rope(k, positions, self.inv_freq, self.rope_scaling, False))
            b.kv_write(cache.v[i], start, b.linear(h, L.v).reshape(t, self.n_kv, d))
            o = b.attention(q, cache.k[i], cache.v[i], start, self.block_visibility, self.scale)
            x = b.add(x, b.linear(o.reshape(t, hq), L.o))
            h = b.rmsnorm(x, L.post_norm, s.rms_norm_eps)
            gu = b.linear(h, L.gate_up)
            inter = gu.shape[1] // 2
            x = b.add(x, b.linear(b.swiglu(gu[:, :inter], gu[:, inter:]), L.down))
        return b.rmsnorm(x, self.norm, s.rms_norm_eps)


def random_checkpoint(hidden_size: int, num_target_layers: int, vocab_size: int, taps=(0,), seed: int = 0,
                      block_size: int = 8, layers: int = 1, out_scale: float = 1.0):
    """(config dict, float32 weights) of a random-weight DFlash drafter for a target of the given shape: for
    tests and benchmarks (losslessness does not depend on the drafter; no trained drafter ships for the
    default model). Small heads (4 x 16, 2 KV heads). out_scale multiplies the final norm: a small value
    flattens the draft distributions, so best-first trees grow wide instead of deep."""
    h = hidden_size
    config = {"architectures": ["DFlashDraftModel"], "hidden_size": h, "intermediate_size": 64,
              "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "block_size": block_size, "num_target_layers": num_target_layers, "vocab_size": vocab_size,
              "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": vocab_size - 1}}
    rng = np.random.default_rng(seed)
    w = {"fc.weight": rng.normal(0, 0.1, (h, h * len(taps))), "hidden_norm.weight": 1 + rng.normal(0, .1, h),
         "norm.weight": out_scale * (1 + rng.normal(0, .1, h))}
    for i in range(layers):
        p = f"layers.{i}."
        for n, shape in [("self_attn.q_proj", (64, h)), ("self_attn.k_proj", (32, h)), ("self_attn.v_proj", (32, h)),
                         ("self_attn.o_proj", (h, 64)), ("mlp.gate_proj", (64, h)), ("mlp.up_proj", (64, h)),
                         ("mlp.down_proj", (h, 64))]:
            w[p + n + ".weight"] = rng.normal(0, 0.2, shape)
        for n, size in [("self_attn.q_norm", 16), ("self_attn.k_norm", 16), ("input_layernorm", h),
                        ("post_attention_layernorm", h)]:
            w[p + n + ".weight"] = 1 + rng.normal(0, 0.1, size)
    return config, {k: np.asarray(v, np.float32) for k, v in w.items()}
