"""transformers peer for our llama-family models (torch is imported here, in tools/tests only, never by the
runtime): an HF LlamaForCausalLM holding exactly the weights our loader read from a GGUF."""
from __future__ import annotations


def llama_from_gguf(g):
    """float32 CPU LlamaForCausalLM from a loader.GGUFModel (its spec and its dequantized HF-named tensors).
    Raises when a tensor is unexpected, or missing other than a tied lm_head."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    from runtime.models.common import as_f32
    s = g.spec
    cfg = transformers.LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps,
        rope_theta=s.rope_theta, max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings)
    with no_init_weights():                                  # every weight is loaded below
        hf = transformers.LlamaForCausalLM(cfg).eval()
    state = {k: torch.from_numpy(as_f32(v).copy()) for k, v in g.tensors.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"GGUF tensors do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf
