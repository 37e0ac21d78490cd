"""Tiny random checkpoints with the real naming schemes, for tests (ours and the models'): each writer puts
config.json + safetensors in a directory and returns {name: (safetensors dtype, array as stored)} so a test
can compare every loaded array exactly. Values are random bf16 (never zeros)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from runtime.bf16 import to_bf16
from .checkpoint import save_safetensors
from .config import load_config
from .int4 import pack_int4
from .names import expected_tensors

TINY_LLAMA_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

TINY_QWEN3_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=[2, 3])

# Kimi K2.x shape family at toy size: MLA with q_lora, 1 dense layer then MoE layers, INT4 routed experts.
TINY_KIMI_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=64, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, routed_scaling_factor=2.827, topk_method="noaux_tc", n_group=2, topk_group=1,
    norm_topk_prob=True, scoring_func="sigmoid", rms_norm_eps=1e-6, rope_theta=50000.0,
    max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    quantization_config=dict(
        quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
        config_groups=dict(group_0=dict(
            targets=["Linear"], input_activations=None, output_activations=None,
            weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
                         dynamic=False, actorder=None, observer="minmax"))),
        ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]))

TINY_DFLASH_CONFIG = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=128, vocab_size=64, block_size=16, num_target_layers=8,
    dflash_config=dict(target_layer_ids=[1, 3, 6], mask_token_id=63))


def random_bf16(rng: np.random.Generator, shape, scale: float = 0.5) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = scale          # never an exact zero: a zero-filled load would otherwise pass
    return to_bf16(x).reshape(shape)


def random_int4(rng: np.random.Generator, n: int, k: int, group: int = 32):
    """(weight_packed, weight_scale bf16 bits, weight_shape int64, codes int8)."""
    codes = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
    scale = to_bf16(rng.uniform(0.01, 0.1, size=(n, -(-k // group))).astype(np.float32))
    return pack_int4(codes), scale, np.array([n, k], np.int64), codes


def write_tiny_model(folder: os.PathLike | str, config: dict, seed: int = 0, shards: int = 1) -> dict:
    """config.json + random weights for every tensor expected_tensors(spec) lists; INT4 where the config's
    quantization says so. shards > 1 writes model-0000k-of-0000n.safetensors + model.safetensors.index.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    spec = load_config(config)
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for name, e in expected_tensors(spec).items():
        if name.endswith(".weight_shape") or name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            n, k = e.shape[0], e.shape[1] * 8
            packed, scale, shape, _ = random_int4(rng, n, k)
            tensors[f"{module}.weight_packed"] = ("I32", packed)
            tensors[f"{module}.weight_scale"] = ("BF16", scale)
            tensors[f"{module}.weight_shape"] = ("I64", shape)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = ("F32", rng.standard_normal(e.shape).astype(np.float32))   # as DeepSeek ships it
        else:
            tensors[name] = ("BF16", random_bf16(rng, e.shape))
    names = list(tensors)
    if shards <= 1:
        save_safetensors(folder / "model.safetensors", {n: tensors[n] for n in names}, metadata={"format": "pt"})
    else:
        weight_map = {}
        for s, part in enumerate(np.array_split(np.arange(len(names)), shards)):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_safetensors(folder / fname, {names[i]: tensors[names[i]] for i in part}, metadata={"format": "pt"})
            weight_map.update({names[i]: fname for i in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors
