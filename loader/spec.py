"""Typed model specs: the contract between the loader (HF config / GGUF metadata -> spec) and the models.

One dataclass per architecture family. Field names follow the HF config keys where one exists, so a reader
can grep a config.json and find the field. `loader.config` builds these; `runtime.models` consumes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class RopeScaling:
    """rope_scaling block of an HF config. type 'default' = plain RoPE; 'yarn' = DeepSeek/Kimi YaRN;
    'llama3' = Llama 3.1 frequency scaling."""
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    low_freq_factor: float = 1.0   # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclass(frozen=True)
class LlamaSpec:
    """Llama / SmolLM2 (LlamaForCausalLM) and Qwen3 (Qwen3ForCausalLM: qk_norm=True, explicit head_dim)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool = False              # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: Optional[int] = None
    eos_token_id: tuple[int, ...] = ()


@dataclass(frozen=True)
class QuantSpec:
    """compressed-tensors quantization of a checkpoint (Kimi K2.x: pack-quantized INT4, group 32, symmetric,
    routed experts only). `ignore` lists module names (or 're:' patterns) kept in bf16."""
    format: str = "pack-quantized"
    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeepseekV3Spec:
    """DeepSeek-V3 / Kimi K2.x (DeepseekV3ForCausalLM, KimiK2ForCausalLM...): MLA attention, MoE with
    shared experts, sigmoid routing with e_score_correction_bias (topk_method 'noaux_tc')."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int            # dense layers' MLP width
    moe_intermediate_size: int        # each routed/shared expert's width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: Optional[int]        # None -> q_proj is a plain linear
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scoring_func: str
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    quant: Optional[QuantSpec] = None
    bos_token_id: Optional[int] = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


@dataclass(frozen=True)
class DFlashSpec:
    """DFlash block-diffusion drafter (DFlashDraftModel): Qwen3-style layers over [context KV | block],
    context = fc(concat of target hidden states at target_layer_ids) -> hidden_norm. No embedding and no
    lm_head of its own: both are the target's."""
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int = 0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)


ModelSpec = LlamaSpec | DeepseekV3Spec | DFlashSpec
