"""DeepSeek-V3 / Kimi K2.x decoder, written against the backend interface.

Attention is MLA in the weight-absorbed form for every call (prefill, decode, verify): the cache holds, per
token, the normalised compressed latent (kv_lora_rank, 512 on Kimi) followed by the rotated rope key
(qk_rope_head_dim, 64), as one [capacity, 1, 576] buffer; values are a view of its first 512 columns. Queries
are absorbed: q_nope @ W_uk (per head, [dn] -> [512]) next to q_rope, so attention is multi-query over
576-d keys and 512-d values; the output latent goes through W_uv (per head, [512] -> [dv]) then o_proj.
Mathematically equal to HF's expanded form (kv_b_proj applied to the cache) up to float rounding.

MoE layers (layer >= first_k_dense_replace, every moe_layer_freq): sigmoid router with
e_score_correction_bias, group-limited top-k (noaux_tc), normalised weights x routed_scaling_factor, plus
the shared expert(s). Routed experts may be compressed-tensors INT4 (weight_packed / weight_scale /
weight_shape) or dense.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.spec import DeepseekV3Spec
from .common import KVCache, Weights, as_f32, build_kv_cache, rope_parameters, yarn_mscale


def _linear_weight(backend, w: Weights, prefix: str):
    """A linear layer's weight, dense (`.weight`) or compressed-tensors INT4 (`.weight_packed`)."""
    if w.has(prefix + ".weight"):
        return backend.dense_weight(w.get(prefix + ".weight"))
    if w.has(prefix + ".weight_packed"):
        return backend.int4_weight(w.get(prefix + ".weight_packed"), w.get(prefix + ".weight_scale"),
                                   w.get(prefix + ".weight_shape"))
    raise KeyError(f"checkpoint has neither {prefix}.weight nor {prefix}.weight_packed")


@dataclass
class _Mlp:
    gate_up: object
    down: object


@dataclass
class _Moe:
    router: object          # [E, hidden] float32
    bias: object            # e_score_correction_bias [E] float32
    experts: object         # backend.stack_experts
    shared: _Mlp


@dataclass
class _Layer:
    input_norm: object
    q_proj: object          # q_lora_rank None
    q_a: object
    q_a_norm: object
    q_b: object
    kv_a: object
    kv_a_norm: object
    w_uk: object            # [H, dn, r]
    w_uv: object            # [H, r, dv]
    o: object
    post_norm: object
    mlp: object             # _Mlp or _Moe


class DeepseekV3Model:
    def __init__(self, spec: DeepseekV3Spec, weights, backend):
        if spec.scoring_func != "sigmoid" or spec.topk_method != "noaux_tc":
            raise NotImplementedError(f"routing {spec.scoring_func}/{spec.topk_method}: only sigmoid/noaux_tc")
        self.spec, self.backend = spec, backend
        w, b = Weights(weights), backend
        self.hidden_size, self.vocab_size, self.num_layers = spec.hidden_size, spec.vocab_size, spec.num_hidden_layers
        self.n_heads = spec.num_attention_heads
        self.dn, self.dr, self.dv, self.r = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
        self.embed_tokens = b.dense_weight(w.get("model.embed_tokens.weight"))
        self.lm_head = (self.embed_tokens if spec.tie_word_embeddings
                        else b.dense_weight(w.get("lm_head.weight")))
        self.norm = b.dense_weight(w.get("model.norm.weight"))
        self.layers = [self._load_layer(w, i) for i in range(self.num_layers)]
        inv_freq, self.rope_scaling = rope_parameters(self.dr, spec.rope_theta, spec.rope_scaling)
        self.inv_freq = b.from_host(inv_freq)
        self.scale = spec.qk_head_dim ** -0.5
        rs = spec.rope_scaling
        if rs.type != "default" and rs.mscale_all_dim:
            self.scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2

    def _mlp(self, w: Weights, p: str) -> _Mlp:
        b = self.backend
        gate, up = w.get(p + "gate_proj.weight"), w.get(p + "up_proj.weight")
        if gate.dtype != up.dtype:
            gate, up = as_f32(gate), as_f32(up)
        return _Mlp(gate_up=b.dense_weight(np.concatenate([gate, up])), down=b.dense_weight(w.get(p + "down_proj.weight")))

    def _load_layer(self, w: Weights, i: int) -> _Layer:
        s, b = self.spec, self.backend
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        kv_b = as_f32(w.get(a + "kv_b_proj.weight")).reshape(self.n_heads, self.dn + self.dv, self.r)
        if s.is_moe_layer(i):
            m = p + "mlp."
            e = s.n_routed_experts
            gates = [_linear_weight(b, w, f"{m}experts.{j}.gate_proj") for j in range(e)]
            ups = [_linear_weight(b, w, f"{m}experts.{j}.up_proj") for j in range(e)]
            downs = [_linear_weight(b, w, f"{m}experts.{j}.down_proj") for j in range(e)]
            bias_name = m + "gate.e_score_correction_bias"
            mlp = _Moe(router=b.dense_weight(as_f32(w.get(m + "gate.weight"))),
                       bias=b.dense_weight(as_f32(w.get(bias_name))) if w.has(bias_name) else None,
                       experts=b.stack_experts(gates, ups, downs), shared=self._mlp(w, m + "shared_experts."))
        else:
            mlp = self._mlp(w, p + "mlp.")
        lora = s.q_lora_rank is not None
        return _Layer(
            input_norm=b.dense_weight(w.get(p + "input_layernorm.weight")),
            q_proj=None if lora else b.dense_weight(w.get(a + "q_proj.weight")),
            q_a=b.dense_weight(w.get(a + "q_a_proj.weight")) if lora else None,
            q_a_norm=b.dense_weight(w.get(a + "q_a_layernorm.weight")) if lora else None,
            q_b=b.dense_weight(w.get(a + "q_b_proj.weight")) if lora else None,
            kv_a=b.dense_weight(w.get(a + "kv_a_proj_with_mqa.weight")),
            kv_a_norm=b.dense_weight(w.get(a + "kv_a_layernorm.weight")),
            w_uk=b.head_weight(np.ascontiguousarray(kv_b[:, :self.dn, :])),
            w_uv=b.head_weight(np.ascontiguousarray(kv_b[:, self.dn:, :].transpose(0, 2, 1))),
            o=b.dense_weight(w.get(a + "o_proj.weight")),
            post_norm=b.dense_weight(w.get(p + "post_attention_layernorm.weight")),
            mlp=mlp)

    def new_cache(self, capacity: int) -> KVCache:
        r = self.r
        return build_kv_cache(self.backend, self.num_layers, capacity, (1, r + self.dr), None,
                              v_from_k=lambda k: k[:, :, :r])

    def embed(self, ids):
        return self.backend.embedding(self.embed_tokens, ids)

    def logits(self, hidden):
        return self.backend.linear(hidden, self.lm_head)

    def _ffn(self, mlp, h):
        b = self.backend
        if isinstance(mlp, _Mlp):
            gu = b.linear(h, mlp.gate_up)
            inter = gu.shape[1] // 2
            return b.linear(b.swiglu(gu[:, :inter], gu[:, inter:]), mlp.down)
        s = self.spec
        ids, weights = b.moe_route(b.linear(h, mlp.router), mlp.bias, s.n_group, s.topk_group,
                                   s.num_experts_per_tok, s.norm_topk_prob, s.routed_scaling_factor)
        return b.add(b.moe_experts(h, ids, weights, mlp.experts), self._ffn(mlp.shared, h))

    def forward(self, cache: KVCache, ids, positions, visibility, taps=()):
        b, s = self.backend, self.spec
        x = self.embed(ids)
        t, start = x.shape[0], cache.length
        if start + t > cache.capacity:
            raise ValueError(f"KV cache overflow: {start} + {t} tokens > capacity {cache.capacity}")
        eps, H, r = s.rms_norm_eps, self.n_heads, self.r
        tapped = {}
        for i, L in enumerate(self.layers):
            h = b.rmsnorm(x, L.input_norm, eps)
            if L.q_proj is not None:
                q = b.linear(h, L.q_proj)
            else:
                q = b.linear(b.rmsnorm(b.linear(h, L.q_a), L.q_a_norm, eps), L.q_b)
            q = q.reshape(t, H, self.dn + self.dr)
            q_rope = b.rope(q[:, :, self.dn:], positions, self.inv_freq, self.rope_scaling, True)
            q_abs = b.concat([b.head_linear(q[:, :, :self.dn], L.w_uk), q_rope])          # [T, H, r + dr]
            ckv = b.linear(h, L.kv_a)
            latent = b.rmsnorm(ckv[:, :r], L.kv_a_norm, eps).reshape(t, 1, r)
            k_rope = b.rope(ckv[:, r:].reshape(t, 1, self.dr), positions, self.inv_freq, self.rope_scaling, True)
            b.kv_write(cache.k[i], start, b.concat([latent, k_rope]))
            o = b.attention(q_abs, cache.k[i], cache.v[i], start, visibility, self.scale)   # [T, H, r]
            o = b.head_linear(o, L.w_uv).reshape(t, H * self.dv)
            x = b.add(x, b.linear(o, L.o))
            x = b.add(x, self._ffn(L.mlp, b.rmsnorm(x, L.post_norm, eps)))
            if i in taps:
                tapped[i] = x
        return b.rmsnorm(x, self.norm, eps), tapped
