"""Llama family decoder (LlamaForCausalLM: Llama, SmolLM2; Qwen3ForCausalLM: per-head q_norm/k_norm; Qwen2:
attention bias), written against the backend interface.

q/k/v are fused into one [.., hidden] weight and gate/up into another at load: one linear each per layer,
fewer launches on CUDA and fewer BLAS calls on numpy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.spec import LlamaSpec
from .common import KVCache, Weights, build_kv_cache, rope_parameters


def _cat(arrays):
    if len({a.dtype for a in arrays}) > 1:                    # bf16 bits next to float32: widen all
        from .common import as_f32
        arrays = [as_f32(a) for a in arrays]
    return np.concatenate(arrays, axis=0)


@dataclass
class _Layer:
    input_norm: object
    qkv: object
    qkv_bias: object
    q_norm: object
    k_norm: object
    o: object
    post_norm: object
    gate_up: object
    down: object


class LlamaModel:
    """forward(cache, ids, positions, visibility, taps) -> (final-normed hidden [T, hidden], {layer: hidden}).
    The T tokens are written at cache slots cache.length.. (the caller decides what to commit)."""

    def __init__(self, spec: LlamaSpec, weights, backend):
        self.spec, self.backend = spec, backend
        w = Weights(weights)
        b = backend
        self.hidden_size, self.vocab_size = spec.hidden_size, spec.vocab_size
        self.num_layers = spec.num_hidden_layers
        self.n_heads, self.n_kv, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.embed_tokens = b.dense_weight(w.get("model.embed_tokens.weight"))
        self.lm_head = (self.embed_tokens if spec.tie_word_embeddings
                        else b.dense_weight(w.get("lm_head.weight")))
        self.norm = b.dense_weight(w.get("model.norm.weight"))
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = _cat([w.get(a + f"{n}_proj.weight") for n in "qkv"])
            bias = None
            if w.has(a + "q_proj.bias"):
                bias = b.dense_weight(_cat([w.get(a + f"{n}_proj.bias") for n in "qkv"]))
            self.layers.append(_Layer(
                input_norm=b.dense_weight(w.get(p + "input_layernorm.weight")),
                qkv=b.dense_weight(qkv), qkv_bias=bias,
                q_norm=b.dense_weight(w.get(a + "q_norm.weight")) if spec.qk_norm else None,
                k_norm=b.dense_weight(w.get(a + "k_norm.weight")) if spec.qk_norm else None,
                o=b.dense_weight(w.get(a + "o_proj.weight")),
                post_norm=b.dense_weight(w.get(p + "post_attention_layernorm.weight")),
                gate_up=b.dense_weight(_cat([w.get(p + "mlp.gate_proj.weight"), w.get(p + "mlp.up_proj.weight")])),
                down=b.dense_weight(w.get(p + "mlp.down_proj.weight"))))
        inv_freq, self.rope_scaling = rope_parameters(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.inv_freq = b.from_host(inv_freq)
        self.scale = spec.head_dim ** -0.5

    def new_cache(self, capacity: int) -> KVCache:
        shape = (self.n_kv, self.head_dim)
        return build_kv_cache(self.backend, self.num_layers, capacity, shape, shape)

    def embed(self, ids):
        return self.backend.embedding(self.embed_tokens, ids)

    def logits(self, hidden):
        return self.backend.linear(hidden, self.lm_head)

    def forward(self, cache: KVCache, ids, positions, visibility, taps=()):
        b, s = self.backend, self.spec
        x = self.embed(ids)
        t = x.shape[0]
        start = cache.length
        if start + t > cache.capacity:
            raise ValueError(f"KV cache overflow: {start} + {t} tokens > capacity {cache.capacity}")
        hq, hk, d = self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.head_dim
        tapped = {}
        for i, L in enumerate(self.layers):
            qkv = b.norm_linear(x, L.input_norm, s.rms_norm_eps, L.qkv, L.qkv_bias)
            q = qkv[:, :hq].reshape(t, self.n_heads, d)
            k = qkv[:, hq:hq + hk].reshape(t, self.n_kv, d)
            v = qkv[:, hq + hk:].reshape(t, self.n_kv, d)
            if s.qk_norm:
                q = b.rmsnorm(q, L.q_norm, s.rms_norm_eps)
                k = b.rmsnorm(k, L.k_norm, s.rms_norm_eps)
            q = b.rope_write_kv(q, k, v, positions, self.inv_freq, self.rope_scaling, False, cache.k[i],
                                cache.v[i], start)
            o = b.attention(q, cache.k[i], cache.v[i], start, visibility, self.scale)
            x = b.add(x, b.linear(o.reshape(t, hq), L.o))
            gu = b.norm_linear(x, L.post_norm, s.rms_norm_eps, L.gate_up)
            inter = gu.shape[1] // 2
            x = b.add(x, b.swiglu_linear(gu[:, :inter], gu[:, inter:], L.down))
            if i in taps:
                tapped[i] = x
        return b.rmsnorm(x, self.norm, s.rms_norm_eps), tapped
