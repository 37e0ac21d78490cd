"""Models on the numpy backend vs HF transformers (torch CPU), on tiny random configs; KV-cache consistency
(prefill + step decode == one forward); tree verify == plain forward over each node's root-to-node path.

Also the tiny-model factories the engine tests import (tiny_target, tiny_drafter)."""
import numpy as np
import pytest

from loader import load_config, open_checkpoint
from runtime.backends.base import causal_visibility, full_visibility, unpack_visibility
from runtime.backends.numpy_backend import NumpyBackend
from runtime.models import build_model
from runtime.models.dflash import DFlashDrafter, random_checkpoint
from runtime.testing import assert_close, random_parents, tree_depths, tree_visibility

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97


def _hf_config(kind):
    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    if kind == "qwen3":
        return transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=512, tie_word_embeddings=True)
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})


def hf_tiny(kind, tmp_path, seed=0, std=0.2):
    """A tiny HF model with bf16-representable random weights (so our float32-from-bf16 weights are the same
    numbers), saved with save_pretrained; returns (hf_model, our_model)."""
    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "deepseek": transformers.DeepseekV3ForCausalLM}[kind]
    m = cls(_hf_config(kind)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_((torch.randn_like(p) * (std if p.dim() > 1 else 0.1) + base).bfloat16().float())
        for name, buf in m.named_buffers():
            if "e_score_correction_bias" in name:
                buf.copy_(torch.randn_like(buf) * 0.1)
    d = tmp_path / kind
    m.save_pretrained(d, safe_serialization=True)
    ours = build_model(load_config(d), open_checkpoint(d), NumpyBackend())
    return m, ours


def tiny_target(tmp_path, kind="llama", seed=0):
    return hf_tiny(kind, tmp_path, seed)[1]


def tiny_drafter_checkpoint(target, seed=1, block_size=8, layers=1, taps=(0, 2), out_scale=1.0):
    """(config dict, float32 weights) of a random-weight DFlash drafter for `target`."""
    return random_checkpoint(target.hidden_size, target.num_layers, target.vocab_size, taps=taps, seed=seed,
                             block_size=block_size, layers=layers, out_scale=out_scale)


def tiny_drafter(target, **kwargs):
    """A random-weight DFlashDrafter for `target` (see tiny_drafter_checkpoint)."""
    config, weights = tiny_drafter_checkpoint(target, **kwargs)
    return DFlashDrafter(load_config(config), weights, target.backend)


def forward_logits(model, ids, positions=None, visibility=None, cache=None):
    ids = np.asarray(ids, np.int32)
    cache = cache if cache is not None else model.new_cache(256)
    positions = np.arange(cache.length, cache.length + len(ids)) if positions is None else positions
    visibility = causal_visibility(len(ids)) if visibility is None else visibility
    h, _ = model.forward(cache, ids, np.asarray(positions, np.int32), visibility)
    return model.logits(h)


# Model outputs against their references: every element within TOL x the largest reference value.
TOL = 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek"])
def test_forward_matches_transformers(kind, tmp_path):
    hf, ours = hf_tiny(kind, tmp_path)
    ids = np.random.default_rng(1).integers(0, VOCAB, 37)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    assert_close(forward_logits(ours, ids), ref, f"{kind} logits vs transformers", rtol=0, atol=TOL)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek"])
def test_prefill_then_decode_matches_forward(kind, tmp_path):
    _, ours = hf_tiny(kind, tmp_path)
    ids = np.random.default_rng(2).integers(0, VOCAB, 24)
    full = forward_logits(ours, ids)
    cache = ours.new_cache(64)
    got = [forward_logits(ours, ids[:10], cache=cache)]
    cache.length = 10
    for i in range(10, 24):
        got.append(forward_logits(ours, ids[i:i + 1], cache=cache))
        cache.length += 1
    assert_close(np.concatenate(got), full, f"{kind} prefill + decode vs forward", rtol=0, atol=TOL)


def _random_tree(rng, n, vocab):
    """parents (parent index < node index), depths, tokens and the ancestor visibility bitmask of a random tree."""
    parents = random_parents(rng, n)
    return parents, tree_depths(parents), rng.integers(0, vocab, n).astype(np.int32), tree_visibility(parents)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_tree_verify_matches_path_forward(kind, tmp_path):
    _, ours = hf_tiny(kind, tmp_path)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, VOCAB, 11)
    parents, depths, tokens, vis = _random_tree(rng, 40, VOCAB)
    cache = ours.new_cache(128)
    forward_logits(ours, prefix, cache=cache)
    cache.length = len(prefix)
    tree_logits = forward_logits(ours, tokens, positions=len(prefix) + depths, visibility=vis, cache=cache)
    dense = unpack_visibility(vis, len(tokens))
    for node in [0, 1, 5, 17, 39]:
        path = np.nonzero(dense[node])[0]                  # ancestors in index order = root-to-node order
        ref = forward_logits(ours, np.concatenate([prefix, tokens[path]]))[-1]
        assert_close(tree_logits[node], ref, f"{kind} tree node {node}", rtol=0, atol=TOL)


def test_visibility_helpers():
    assert (unpack_visibility(causal_visibility(40), 40) == np.tril(np.ones((40, 40), bool))).all()
    assert unpack_visibility(full_visibility(33), 33).all()


def test_drafter_context_is_incremental(tmp_path):
    """Adding context in two pieces gives the same draft as adding it at once (the engine's commit path)."""
    target = tiny_target(tmp_path)
    d = tiny_drafter(target)
    rng = np.random.default_rng(4)
    ctx = rng.normal(0, 1, (9, 2 * target.hidden_size)).astype(np.float32)
    emb = target.embed(np.array([5] + [VOCAB - 1] * 7, np.int32))
    pos = np.arange(9, 17, dtype=np.int32)
    a = d.new_cache(64)
    d.add_context(a, ctx, np.arange(9, dtype=np.int32))
    b = d.new_cache(64)
    d.add_context(b, ctx[:4], np.arange(4, dtype=np.int32))
    d.add_context(b, ctx[4:], np.arange(4, 9, dtype=np.int32))
    assert_close(d.draft(b, emb, pos), d.draft(a, emb, pos), "incremental drafter context", rtol=0, atol=1e-5)


def test_deepseek_int4_experts_match_transformers(tmp_path):
    """Routed experts as compressed-tensors INT4 (weight_packed / weight_scale / weight_shape, group 32); HF
    gets the dequantised values, so both compute with the same numbers."""
    from loader.int4 import pack_int4
    from runtime.bf16 import from_bf16, to_bf16
    hf, _ = hf_tiny("deepseek", tmp_path)
    d = tmp_path / "deepseek"
    ckpt = open_checkpoint(d)
    tensors = {n: ckpt.tensor(n) for n in ckpt.names()}
    spec = load_config(d)
    inter = spec.moe_intermediate_size
    for layer in range(spec.first_k_dense_replace, spec.num_hidden_layers):
        experts = hf.model.layers[layer].mlp.experts
        for e in range(spec.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                w = np.asarray(tensors.pop(name + ".weight"), np.float32)
                n, k = w.shape
                groups = w.reshape(n, k // 32, 32)
                scale_bits = to_bf16(np.abs(groups).max(-1) / 7 + 1e-8)
                scale = from_bf16(scale_bits).reshape(n, k // 32)
                codes = np.clip(np.rint(groups / scale[..., None]), -8, 7).astype(np.int8).reshape(n, k)
                tensors[name + ".weight_packed"] = pack_int4(codes)
                tensors[name + ".weight_scale"] = scale_bits
                tensors[name + ".weight_shape"] = np.array([n, k], np.int32)
                deq = torch.from_numpy((codes.astype(np.float32).reshape(n, k // 32, 32) * scale[..., None]).reshape(n, k))
                with torch.no_grad():
                    if proj == "down_proj":
                        experts.down_proj[e].copy_(deq)
                    else:
                        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                        experts.gate_up_proj[e][rows].copy_(deq)
    ours = build_model(spec, tensors, NumpyBackend())
    ids = np.random.default_rng(5).integers(0, VOCAB, 29)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    assert_close(forward_logits(ours, ids), ref, "deepseek INT4 experts vs transformers", rtol=0, atol=TOL)


def _torch_dflash(cfg, w, ctx, noise, positions):
    """An independent torch transcription of DFlashDraftModel.forward (z-lab/dflash): per layer, K/V over
    [fc'd context ; block], q_norm/k_norm before RoPE, non-causal attention, target hidden shared by layers."""
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):                      # x [S, H, D], HF rotate_half convention
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)[:, None, :]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()

    pos = torch.from_numpy(positions)
    target = norm(torch.from_numpy(ctx) @ t["fc.weight"].T, t["hidden_norm.weight"])
    x = torch.from_numpy(noise)
    c, b = target.shape[0], x.shape[0]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        a = p + "self_attn."
        h = norm(x, t[p + "input_layernorm.weight"])
        q = norm((h @ t[a + "q_proj.weight"].T).view(b, nh, hd), t[a + "q_norm.weight"])
        k = norm((torch.cat([target, h]) @ t[a + "k_proj.weight"].T).view(c + b, nkv, hd), t[a + "k_norm.weight"])
        v = (torch.cat([target, h]) @ t[a + "v_proj.weight"].T).view(c + b, nkv, hd)
        q, k = rope(q, pos[c:]), rope(k, pos)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(b, nh * hd)
        x = x + o @ t[a + "o_proj.weight"].T
        h = norm(x, t[p + "post_attention_layernorm.weight"])
        g, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ t[p + "mlp.down_proj.weight"].T
    return norm(x, t["norm.weight"]).numpy()


def test_drafter_matches_torch_transcription(tmp_path):
    target = tiny_target(tmp_path)
    cfg, w = tiny_drafter_checkpoint(target, layers=2, taps=(0, 1, 2))
    drafter = DFlashDrafter(load_config(cfg), w, target.backend)
    rng = np.random.default_rng(6)
    ctx = rng.normal(0, 1, (13, 3 * target.hidden_size)).astype(np.float32)
    noise = target.embed(np.array([7] + [VOCAB - 1] * 7, np.int32))
    positions = np.arange(21, dtype=np.int32)
    cache = drafter.new_cache(64)
    drafter.add_context(cache, ctx, positions[:13])
    ours = drafter.draft(cache, noise, positions[13:])
    assert_close(ours, _torch_dflash(cfg, w, ctx, noise, positions), "drafter vs torch transcription", rtol=0, atol=TOL)
