"""HF config.json -> typed model spec (loader.spec). One builder per architecture family; an architecture
name we do not know is an error, never a guess."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from .errors import LoadError
from .spec import DeepseekV3Spec, DFlashSpec, LlamaSpec, ModelSpec, QuantSpec, RopeScaling

LLAMA_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
DEEPSEEK_ARCHS = ("DeepseekV3ForCausalLM", "KimiK2ForCausalLM")
# Multimodal Kimi wrappers keep the language model's config under "text_config".
TEXT_CONFIG_ARCHS = ("KimiK25ForConditionalGeneration", "KimiVLForConditionalGeneration")
DFLASH_ARCHS = ("DFlashDraftModel",)


INT_LIMIT = 2 ** 31


class _Cfg:
    """A config dict with key lookups that fail as LoadError naming the file and key."""

    def __init__(self, d: Mapping[str, Any], path):
        self.d, self.path = d, path

    def req(self, key: str):
        if key not in self.d or self.d[key] is None:
            raise LoadError(f"config lacks required key {key!r}", self.path, key)
        return self.d[key]

    def int(self, key: str, default=None) -> int:
        v = self.req(key) if default is None else self.d.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, int) or isinstance(v, bool):
            raise LoadError(f"config key {key!r} should be an integer, got {v!r}", self.path, key)
        if not -INT_LIMIT < v < INT_LIMIT:   # sizes, ids and counts index int32 device arrays
            raise LoadError(f"config key {key!r} is out of range: {v}", self.path, key)
        return v

    def float(self, key: str, default=None) -> float:
        v = self.req(key) if default is None else self.d.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise LoadError(f"config key {key!r} should be a finite number, got {v!r}", self.path, key)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key, default)
        if not isinstance(v, bool):
            raise LoadError(f"config key {key!r} should be true/false, got {v!r}", self.path, key)
        return v

    def get(self, key, default=None):
        v = self.d.get(key, default)
        return default if v is None else v


def read_config_dict(path_or_dir_or_dict) -> tuple[dict, str | None]:
    """(config dict, file path or None) from a config.json path, a model directory or a dict."""
    if isinstance(path_or_dir_or_dict, Mapping):
        return dict(path_or_dir_or_dict), None
    p = Path(path_or_dir_or_dict)
    if p.is_dir():
        p = p / "config.json"
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise LoadError("config.json not found", p) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"config is not valid JSON: {e}", p) from None
    if not isinstance(d, dict):
        raise LoadError("config is not a JSON object", p)
    return d, str(p)


def load_config(path_or_dir_or_dict: os.PathLike | str | Mapping) -> ModelSpec:
    d, path = read_config_dict(path_or_dir_or_dict)
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise LoadError("config has no 'architectures' list", path, "architectures")
    arch = archs[0]
    return _check_numbers(_build_spec(d, path, arch), path)


def _build_spec(d: dict, path, arch) -> ModelSpec:
    if arch in TEXT_CONFIG_ARCHS:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise LoadError(f"{arch} config lacks text_config", path, "text_config")
        merged = dict(text)
        merged.setdefault("quantization_config", d.get("quantization_config"))
        merged.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
        return _deepseek(_Cfg(merged, path), arch)
    if arch in LLAMA_ARCHS:
        return _llama(_Cfg(d, path), arch)
    if arch in DEEPSEEK_ARCHS:
        return _deepseek(_Cfg(d, path), arch)
    if arch in DFLASH_ARCHS:
        return _dflash(_Cfg(d, path), arch)
    known = LLAMA_ARCHS + DEEPSEEK_ARCHS + TEXT_CONFIG_ARCHS + DFLASH_ARCHS
    raise LoadError(f"unknown architecture {arch!r}; supported: {', '.join(known)}", path, "architectures")


def _rope_scaling(c: _Cfg) -> RopeScaling:
    rs = c.d.get("rope_scaling") or c.d.get("rope_parameters")
    if not rs:
        return RopeScaling()
    if not isinstance(rs, dict):
        raise LoadError(f"rope_scaling should be an object, got {rs!r}", c.path, "rope_scaling")
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ("default", "yarn", "llama3", "linear"):
        raise LoadError(f"unsupported rope_scaling type {kind!r}", c.path, "rope_scaling")
    r = _Cfg(rs, c.path)
    base = RopeScaling()
    # YaRN and llama3 scale relative to the original context. As in transformers, YaRN's defaults to the
    # model's max_position_embeddings and llama3 must name it (a 0 would end in a math domain error).
    original = r.int("original_max_position_embeddings", 0)
    if kind == "yarn" and not original:
        original = c.int("max_position_embeddings", 0)
    if kind in ("yarn", "llama3") and original <= 0:
        raise LoadError(f"{kind} rope scaling needs original_max_position_embeddings", c.path, "rope_scaling")
    return RopeScaling(
        type=kind, factor=r.float("factor", 1.0),
        original_max_position_embeddings=original,
        beta_fast=r.float("beta_fast", base.beta_fast), beta_slow=r.float("beta_slow", base.beta_slow),
        mscale=r.float("mscale", base.mscale), mscale_all_dim=r.float("mscale_all_dim", base.mscale_all_dim),
        low_freq_factor=r.float("low_freq_factor", base.low_freq_factor),
        high_freq_factor=r.float("high_freq_factor", base.high_freq_factor))


def _rope_theta(c: _Cfg) -> float:
    if "rope_theta" in c.d:
        return c.float("rope_theta")
    rp = c.d.get("rope_parameters")   # transformers 5 moves rope_theta here
    if isinstance(rp, dict) and "rope_theta" in rp:
        return _Cfg(rp, c.path).float("rope_theta")
    return 10000.0


def _token_ids(c: _Cfg, key: str) -> tuple[int, ...]:
    """A token-id key (eos_token_id: one id or a list of them) as a tuple of ids in 0 .. vocab_size - 1."""
    v = c.d.get(key)
    ids = [] if v is None else v if isinstance(v, list) else [v]
    vocab = c.d.get("vocab_size")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (isinstance(vocab, int) and t >= vocab):
            raise LoadError(f"config key {key!r} should be token ids in 0 .. vocab_size - 1, got {v!r}", c.path,
                            key)
    return tuple(ids)


def _eos(c: _Cfg) -> tuple[int, ...]:
    return _token_ids(c, "eos_token_id")


def _bos(c: _Cfg) -> int | None:
    if isinstance(c.d.get("bos_token_id"), list):
        raise LoadError(f"config key 'bos_token_id' should be one token id, got {c.d['bos_token_id']!r}", c.path,
                        "bos_token_id")
    ids = _token_ids(c, "bos_token_id")
    return ids[0] if ids else None


def _check_numbers(spec: ModelSpec, path) -> ModelSpec:
    """What every spec needs of its float keys and context length: a negative norm epsilon or a non-positive RoPE
    base would give NaNs in the first layer, a context of 0 nothing at all."""
    for key, ok in (("rms_norm_eps", spec.rms_norm_eps >= 0), ("rope_theta", spec.rope_theta > 0),
                    ("max_position_embeddings", spec.max_position_embeddings >= 1)):
        if not ok:
            raise LoadError(f"config key {key!r} is out of range: {getattr(spec, key)!r}", path, key)
    return spec


def _positive(c: _Cfg, *keys: str):
    """Sizes that divide or count must be >= 1: a 0 would surface later as a ZeroDivisionError or an empty model."""
    for key in keys:
        if key in c.d and c.d[key] is not None and c.int(key) < 1:
            raise LoadError(f"config key {key!r} must be a positive integer, got {c.d[key]!r}", c.path, key)


def _heads(c: _Cfg) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads), the query heads a whole number of groups per KV head."""
    heads = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    if heads % kv:
        raise LoadError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}", c.path,
                        "num_key_value_heads")
    return heads, kv


def _llama(c: _Cfg, arch: str) -> LlamaSpec:
    _positive(c, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim")
    hidden, (heads, kv) = c.int("hidden_size"), _heads(c)
    if hidden % heads and "head_dim" not in c.d:
        raise LoadError(f"hidden_size {hidden} not divisible by num_attention_heads {heads}", c.path, "head_dim")
    return LlamaSpec(
        architecture=arch, vocab_size=c.int("vocab_size"), hidden_size=hidden,
        intermediate_size=c.int("intermediate_size"), num_hidden_layers=c.int("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=c.int("head_dim", hidden // heads), rms_norm_eps=c.float("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(c), max_position_embeddings=c.int("max_position_embeddings", 2048),
        tie_word_embeddings=c.bool("tie_word_embeddings", False), qk_norm=arch == "Qwen3ForCausalLM",
        attention_bias=c.bool("attention_bias", arch == "Qwen2ForCausalLM"), rope_scaling=_rope_scaling(c),
        bos_token_id=_bos(c), eos_token_id=_eos(c))


def _quant(c: _Cfg) -> QuantSpec | None:
    q = c.d.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise LoadError(f"unsupported quant_method {method!r} (only compressed-tensors INT4)", c.path,
                        "quantization_config")
    fmt = q.get("format")
    if fmt != "pack-quantized":
        raise LoadError(f"unsupported compressed-tensors format {fmt!r} (only pack-quantized)", c.path,
                        "quantization_config.format")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise LoadError(f"expected one config group, found {len(groups)}", c.path, "quantization_config")
    (group,) = groups.values()
    w = group.get("weights") or {}
    if w.get("type", "int") != "int" or w.get("strategy", "group") != "group" or w.get("num_bits") != 4:
        raise LoadError(f"unsupported weight quantization {w!r} (need int4, strategy group)", c.path,
                        "quantization_config.weights")
    if group.get("input_activations"):
        raise LoadError("activation quantization is not supported (W4A16 only)", c.path,
                        "quantization_config.input_activations")
    return QuantSpec(format=fmt, num_bits=4, group_size=int(w.get("group_size", 32)),
                     symmetric=bool(w.get("symmetric", True)), targets=tuple(group.get("targets", ("Linear",))),
                     ignore=tuple(q.get("ignore") or ()))


def _deepseek(c: _Cfg, arch: str) -> DeepseekV3Spec:
    _positive(c, "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
              "n_routed_experts", "num_experts_per_tok", "moe_layer_freq", "n_group", "topk_group")
    spec = DeepseekV3Spec(
        architecture=arch, vocab_size=c.int("vocab_size"), hidden_size=c.int("hidden_size"),
        intermediate_size=c.int("intermediate_size"), moe_intermediate_size=c.int("moe_intermediate_size"),
        num_hidden_layers=c.int("num_hidden_layers"), num_attention_heads=c.int("num_attention_heads"),
        num_key_value_heads=c.int("num_key_value_heads", c.int("num_attention_heads")),
        q_lora_rank=c.d.get("q_lora_rank"), kv_lora_rank=c.int("kv_lora_rank"),
        qk_nope_head_dim=c.int("qk_nope_head_dim"), qk_rope_head_dim=c.int("qk_rope_head_dim"),
        v_head_dim=c.int("v_head_dim"), n_routed_experts=c.int("n_routed_experts"),
        num_experts_per_tok=c.int("num_experts_per_tok"), n_shared_experts=c.int("n_shared_experts", 0),
        first_k_dense_replace=c.int("first_k_dense_replace", 0), moe_layer_freq=c.int("moe_layer_freq", 1),
        routed_scaling_factor=c.float("routed_scaling_factor", 1.0),
        topk_method=c.get("topk_method", "noaux_tc"), n_group=c.int("n_group", 1),
        topk_group=c.int("topk_group", 1), norm_topk_prob=c.bool("norm_topk_prob", True),
        scoring_func=c.get("scoring_func", "sigmoid"), rms_norm_eps=c.float("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(c), max_position_embeddings=c.int("max_position_embeddings", 4096),
        tie_word_embeddings=c.bool("tie_word_embeddings", False), rope_scaling=_rope_scaling(c),
        quant=_quant(c), bos_token_id=_bos(c), eos_token_id=_eos(c))
    if spec.q_lora_rank is not None and (not isinstance(spec.q_lora_rank, int) or spec.q_lora_rank <= 0):
        raise LoadError(f"bad q_lora_rank {spec.q_lora_rank!r}", c.path, "q_lora_rank")
    if spec.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise LoadError(f"unsupported topk_method {spec.topk_method!r}", c.path, "topk_method")
    if spec.scoring_func not in ("sigmoid", "softmax"):
        raise LoadError(f"unsupported scoring_func {spec.scoring_func!r}", c.path, "scoring_func")
    if spec.n_routed_experts % spec.n_group:
        raise LoadError(f"n_routed_experts {spec.n_routed_experts} not divisible by n_group {spec.n_group}",
                        c.path, "n_group")
    if spec.topk_group > spec.n_group or spec.num_experts_per_tok > spec.n_routed_experts:
        raise LoadError(f"topk_group {spec.topk_group} > n_group {spec.n_group} or num_experts_per_tok "
                        f"{spec.num_experts_per_tok} > n_routed_experts {spec.n_routed_experts}", c.path, "topk_group")
    return spec


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's rule when a config names no tap layers: one per drafter layer, spread evenly over target
    layers 1 .. num_target_layers-3 (rounded half-to-even, as Python's round), or the middle layer for a
    one-layer drafter."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _dflash(c: _Cfg, arch: str) -> DFlashSpec:
    dc = c.d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise LoadError("dflash_config should be an object", c.path, "dflash_config")
    ids = dc.get("target_layer_ids", c.d.get("target_layer_ids"))
    if ids is None:
        ids = default_target_layer_ids(c.int("num_target_layers"), c.int("num_hidden_layers"))
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise LoadError(f"dflash_config.target_layer_ids should be a non-empty list of ints, got {ids!r}",
                        c.path, "dflash_config.target_layer_ids")
    mask = dc.get("mask_token_id", c.d.get("mask_token_id"))
    if not isinstance(mask, int):
        raise LoadError(f"dflash_config.mask_token_id should be an int, got {mask!r}", c.path,
                        "dflash_config.mask_token_id")
    _positive(c, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "block_size", "num_target_layers")
    hidden, (heads, kv) = c.int("hidden_size"), _heads(c)
    n_target = c.int("num_target_layers")
    if any(i < 0 or i >= n_target for i in ids):
        raise LoadError(f"target_layer_ids {ids} out of range for num_target_layers {n_target}", c.path,
                        "dflash_config.target_layer_ids")
    return DFlashSpec(
        architecture=arch, hidden_size=hidden, intermediate_size=c.int("intermediate_size"),
        num_hidden_layers=c.int("num_hidden_layers"), num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=c.int("head_dim", hidden // heads),
        rms_norm_eps=c.float("rms_norm_eps", 1e-6), rope_theta=_rope_theta(c),
        max_position_embeddings=c.int("max_position_embeddings", 4096), block_size=c.int("block_size"),
        num_target_layers=n_target, target_layer_ids=tuple(ids), mask_token_id=mask,
        vocab_size=c.int("vocab_size", 0), rope_scaling=_rope_scaling(c))
