"""The tensor naming scheme of each architecture (HF names) and the check of a checkpoint against a spec.

`expected_tensors(spec)` lists every tensor a model needs with its shape and allowed dtypes; the models read
weights by these names. `validate_checkpoint` turns a missing tensor or a dtype/shape disagreement into a
LoadError and returns the names it did not expect (the caller warns; real checkpoints carry extras such as
DeepSeek's MTP layer)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from .checkpoint import Checkpoint
from .errors import LoadError
from .int4 import GROUP_SIZE, is_quantized
from .spec import DeepseekV3Spec, DFlashSpec, LlamaSpec, ModelSpec

FLOAT = ("BF16", "F16", "F32")
INT = ("I32", "I64")


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    dtypes: tuple[str, ...] = FLOAT
    optional: bool = False


def _linear(out: dict, module: str, n: int, k: int, quantized: bool = False, group: int = GROUP_SIZE,
            bias: bool = False):
    if quantized:
        out[f"{module}.weight_packed"] = Expected((n, k // 8), ("I32",))
        out[f"{module}.weight_scale"] = Expected((n, -(-k // group)), FLOAT)
        out[f"{module}.weight_shape"] = Expected((2,), INT)
    else:
        out[f"{module}.weight"] = Expected((n, k))
    if bias:
        out[f"{module}.bias"] = Expected((n,))


def _decoder_layer(out: dict, p: str, s: LlamaSpec | DFlashSpec, qk_norm: bool, bias: bool = False):
    """One llama/Qwen decoder layer under prefix p: attention (q/k/v/o, optional q/k norm), SwiGLU MLP, norms."""
    h, hd, nh, nkv = s.hidden_size, s.head_dim, s.num_attention_heads, s.num_key_value_heads
    _linear(out, f"{p}.self_attn.q_proj", nh * hd, h, bias=bias)
    _linear(out, f"{p}.self_attn.k_proj", nkv * hd, h, bias=bias)
    _linear(out, f"{p}.self_attn.v_proj", nkv * hd, h, bias=bias)
    _linear(out, f"{p}.self_attn.o_proj", h, nh * hd)
    if qk_norm:
        out[f"{p}.self_attn.q_norm.weight"] = Expected((hd,))
        out[f"{p}.self_attn.k_norm.weight"] = Expected((hd,))
    _linear(out, f"{p}.mlp.gate_proj", s.intermediate_size, h)
    _linear(out, f"{p}.mlp.up_proj", s.intermediate_size, h)
    _linear(out, f"{p}.mlp.down_proj", h, s.intermediate_size)
    out[f"{p}.input_layernorm.weight"] = Expected((h,))
    out[f"{p}.post_attention_layernorm.weight"] = Expected((h,))


def _llama(s: LlamaSpec) -> dict[str, Expected]:
    h = s.hidden_size
    out = {"model.embed_tokens.weight": Expected((s.vocab_size, h)), "model.norm.weight": Expected((h,))}
    for i in range(s.num_hidden_layers):
        _decoder_layer(out, f"model.layers.{i}", s, qk_norm=s.qk_norm, bias=s.attention_bias)
    # Tied models may still ship lm_head.weight (a copy); untied ones must.
    out["lm_head.weight"] = Expected((s.vocab_size, h), optional=s.tie_word_embeddings)
    return out


def _deepseek(s: DeepseekV3Spec) -> dict[str, Expected]:
    h, nh = s.hidden_size, s.num_attention_heads
    q = s.quant
    out = {"model.embed_tokens.weight": Expected((s.vocab_size, h)), "model.norm.weight": Expected((h,))}

    def lin(module, n, k):
        _linear(out, module, n, k, quantized=is_quantized(q, module), group=q.group_size if q else GROUP_SIZE)

    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if s.q_lora_rank:
            lin(f"{a}.q_a_proj", s.q_lora_rank, h)
            out[f"{a}.q_a_layernorm.weight"] = Expected((s.q_lora_rank,))
            lin(f"{a}.q_b_proj", nh * s.qk_head_dim, s.q_lora_rank)
        else:
            lin(f"{a}.q_proj", nh * s.qk_head_dim, h)
        lin(f"{a}.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h)
        out[f"{a}.kv_a_layernorm.weight"] = Expected((s.kv_lora_rank,))
        lin(f"{a}.kv_b_proj", nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
        lin(f"{a}.o_proj", h, nh * s.v_head_dim)
        out[f"{p}.input_layernorm.weight"] = Expected((h,))
        out[f"{p}.post_attention_layernorm.weight"] = Expected((h,))
        m = f"{p}.mlp"
        if s.is_moe_layer(i):
            # The router is not an nn.Linear (MoEGate), so never quantized.
            out[f"{m}.gate.weight"] = Expected((s.n_routed_experts, h))
            if s.topk_method == "noaux_tc":
                out[f"{m}.gate.e_score_correction_bias"] = Expected((s.n_routed_experts,))
            mi = s.moe_intermediate_size
            for e in range(s.n_routed_experts):
                lin(f"{m}.experts.{e}.gate_proj", mi, h)
                lin(f"{m}.experts.{e}.up_proj", mi, h)
                lin(f"{m}.experts.{e}.down_proj", h, mi)
            if s.n_shared_experts:
                si = mi * s.n_shared_experts
                lin(f"{m}.shared_experts.gate_proj", si, h)
                lin(f"{m}.shared_experts.up_proj", si, h)
                lin(f"{m}.shared_experts.down_proj", h, si)
        else:
            lin(f"{m}.gate_proj", s.intermediate_size, h)
            lin(f"{m}.up_proj", s.intermediate_size, h)
            lin(f"{m}.down_proj", h, s.intermediate_size)
    if not is_quantized(q, "lm_head"):
        out["lm_head.weight"] = Expected((s.vocab_size, h), optional=s.tie_word_embeddings)
    else:
        _linear(out, "lm_head", s.vocab_size, h, quantized=True, group=q.group_size)
    return out


def _dflash(s: DFlashSpec) -> dict[str, Expected]:
    h = s.hidden_size
    out = {"fc.weight": Expected((h, len(s.target_layer_ids) * h)), "hidden_norm.weight": Expected((h,)),
           "norm.weight": Expected((h,))}
    for i in range(s.num_hidden_layers):
        _decoder_layer(out, f"layers.{i}", s, qk_norm=True)   # Qwen3-style layers, unprefixed names
    return out


def expected_tensors(spec: ModelSpec) -> dict[str, Expected]:
    if isinstance(spec, LlamaSpec):
        return _llama(spec)
    if isinstance(spec, DeepseekV3Spec):
        return _deepseek(spec)
    if isinstance(spec, DFlashSpec):
        return _dflash(spec)
    raise TypeError(f"not a model spec: {type(spec).__name__}")


def validate_checkpoint(spec: ModelSpec, ckpt: Checkpoint, warn: bool = True) -> list[str]:
    """LoadError for a missing tensor or a dtype/shape that disagrees with the spec; returns (and warns about)
    tensors the spec does not use."""
    expected = expected_tensors(spec)
    for name, e in expected.items():
        if name not in ckpt:
            if e.optional:
                continue
            raise LoadError(f"missing tensor required by {spec.architecture}", ckpt.source, name)
        dtype, shape = ckpt.info(name)
        if dtype not in e.dtypes:
            raise LoadError(f"dtype {dtype} does not match the config (expected one of {', '.join(e.dtypes)})",
                            ckpt.path_of(name), name)
        if tuple(shape) != e.shape:
            raise LoadError(f"shape {tuple(shape)} does not match the config (expected {e.shape})",
                            ckpt.path_of(name), name)
        if name.endswith(".weight_shape"):
            ws = ckpt.tensor(name)
            module = name[: -len(".weight_shape")]
            want = expected[f"{module}.weight_packed"].shape
            if (int(ws[0]), int(ws[1]) // 8) != want:
                raise LoadError(f"weight_shape {ws.tolist()} disagrees with the packed shape {want}",
                                ckpt.path_of(name), name)
    extra = [n for n in ckpt.names() if n not in expected]
    if extra and warn:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        warnings.warn(f"{ckpt.source}: {len(extra)} tensor(s) not used by {spec.architecture}: "
                      f"{', '.join(extra[:5])}{more}", stacklevel=2)
    return extra
