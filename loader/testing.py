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


class RandomWeights:
    """Random bf16 weights held in memory, for benchmarks at real model sizes: every tensor that
    expected_tensors(spec) requires (llama family incl. Qwen3's q_norm/k_norm and attention biases, DFlash
    drafters; not INT4) is a view of one shared pool at its own random offset, so the host side of a 16 GB
    model costs one pool as large as its largest tensor (plus slack), not 16 GB. Matrices and biases are
    ~normal(0, scale), norm weights ~1 + normal(0, 0.02). Tensors overlap in the pool (each is a shifted
    window of the same numbers): fine for timing and plumbing, not for tests that need independent tensors
    (write_tiny_model is for those). A source for runtime.models (Weights takes .names() / .tensor(name))."""

    BLOCK = 1 << 22          # distinct random values; the pool repeats them (a copy, not a new draw)
    SLACK = 1 << 20          # offsets are drawn from [0, SLACK)

    def __init__(self, spec_or_config, seed: int = 0, scale: float = 0.02):
        spec = spec_or_config if not isinstance(spec_or_config, dict) else load_config(spec_or_config)
        self.spec = spec
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, e in expected_tensors(spec).items():
            if e.optional:
                continue                 # a tied lm_head: the model reads the embedding
            if "BF16" not in e.dtypes:
                raise NotImplementedError(f"RandomWeights: {name} is not a bf16 tensor (INT4 is not covered)")
            self.shapes[name] = tuple(e.shape)
        rng = np.random.default_rng(seed)
        is_norm = {n: len(s) == 1 and n.endswith("norm.weight") for n, s in self.shapes.items()}
        largest = max((int(np.prod(s)) for n, s in self.shapes.items() if not is_norm[n]), default=1)
        largest_norm = max((int(np.prod(s)) for n, s in self.shapes.items() if is_norm[n]), default=1)
        base = to_bf16(rng.standard_normal(min(self.BLOCK, largest + self.SLACK), np.float32) * np.float32(scale))
        base[base == 0] = to_bf16(np.float32(scale))        # never an exact zero (as random_bf16)
        self._pool = np.empty(largest + self.SLACK, np.uint16)
        for i in range(0, self._pool.size, base.size):          # (np.resize is ~10x slower)
            self._pool[i:i + base.size] = base[:self._pool.size - i]
        self._norm_pool = to_bf16(1 + rng.standard_normal(largest_norm + self.SLACK, np.float32) * np.float32(0.02))
        self._at = {n: (is_norm[n], int(rng.integers(0, self.SLACK))) for n in self.shapes}

    def names(self) -> list[str]:
        return list(self.shapes)

    def __contains__(self, name) -> bool:
        return name in self.shapes

    def info(self, name) -> tuple[str, tuple[int, ...]]:
        return "BF16", self.shapes[name]

    def tensor(self, name: str) -> np.ndarray:
        """uint16 bf16 bits, a read-only view into the pool."""
        shape = self.shapes[name]
        norm, off = self._at[name]
        v = (self._norm_pool if norm else self._pool)[off:off + int(np.prod(shape))].reshape(shape)
        v.flags.writeable = False
        return v

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors as a checkpoint would hold them (not what the pool costs)."""
        return sum(int(np.prod(s)) * 2 for s in self.shapes.values())
