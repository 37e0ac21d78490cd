"""HF configs -> specs, and tiny checkpoints with the real naming schemes (Llama, Qwen3, Kimi K2.x with INT4
experts, DFlash drafter) loaded and compared array by array; bad configs and checkpoints -> LoadError."""
import copy
import json
import warnings

import numpy as np
import pytest

import loader
from loader import LoadError, load_config, load_model, open_checkpoint, save_safetensors
from loader.spec import DeepseekV3Spec, DFlashSpec, LlamaSpec
from loader.testing import (TINY_DFLASH_CONFIG, TINY_KIMI_CONFIG, TINY_LLAMA_CONFIG, TINY_QWEN3_CONFIG,
                            write_tiny_model)
from runtime.bf16 import from_bf16

ALL = {"llama": TINY_LLAMA_CONFIG, "qwen3": TINY_QWEN3_CONFIG, "kimi": TINY_KIMI_CONFIG,
       "dflash": TINY_DFLASH_CONFIG}


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("kind", list(ALL))
def test_tiny_checkpoint_every_array(tmp_path, kind, shards):
    written = write_tiny_model(tmp_path, ALL[kind], seed=11, shards=shards)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a complete checkpoint gives no "unused tensor" warning
        spec, ck = load_model(tmp_path)
    assert sorted(ck.names()) == sorted(written)
    for name, (dtype, arr) in written.items():
        assert ck.info(name) == (dtype, arr.shape), name
        assert np.array_equal(ck.tensor(name), arr), name
        if dtype == "BF16":
            assert np.array_equal(ck.float32(name), from_bf16(arr).reshape(arr.shape))
            assert np.all(arr != 0)


def test_llama_spec():
    s = load_config(TINY_LLAMA_CONFIG)
    assert isinstance(s, LlamaSpec)
    assert (s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (32, 4, 2, 8)
    assert not s.qk_norm and not s.tie_word_embeddings and s.eos_token_id == (2,) and s.bos_token_id == 1
    q = load_config(TINY_QWEN3_CONFIG)
    assert q.qk_norm and q.head_dim == 16 and q.tie_word_embeddings and q.eos_token_id == (2, 3)
    names = loader.expected_tensors(q)
    assert names["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    assert names["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)
    assert names["lm_head.weight"].optional


def test_kimi_spec_and_quantized_modules(tmp_path):
    s = load_config(TINY_KIMI_CONFIG)
    assert isinstance(s, DeepseekV3Spec)
    assert (s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim) == (48, 32, 16, 8, 16)
    assert (s.n_routed_experts, s.num_experts_per_tok, s.n_shared_experts, s.moe_intermediate_size) == (8, 2, 1, 32)
    assert (s.first_k_dense_replace, s.topk_method, s.n_group, s.topk_group) == (1, "noaux_tc", 2, 1)
    assert s.routed_scaling_factor == 2.827 and s.norm_topk_prob and s.scoring_func == "sigmoid"
    assert s.rope_scaling.type == "yarn" and s.rope_scaling.factor == 32.0
    assert s.rope_scaling.original_max_position_embeddings == 4096 and s.rope_scaling.mscale_all_dim == 1.0
    assert s.quant.group_size == 32 and s.quant.format == "pack-quantized"
    assert not s.is_moe_layer(0) and s.is_moe_layer(1) and s.is_moe_layer(2)
    names = loader.expected_tensors(s)
    # only routed experts are INT4; attention, shared experts, dense MLP, router, lm_head stay bf16
    packed = sorted(n for n in names if n.endswith(".weight_packed"))
    assert len(packed) == 2 * 8 * 3 and all(".mlp.experts." in n for n in packed)
    for n in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
              "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.2.mlp.gate.weight", "lm_head.weight",
              "model.layers.1.self_attn.q_a_layernorm.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"):
        assert n in names, n
    assert names["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (40, 64)
    assert names["model.layers.1.self_attn.kv_b_proj.weight"].shape == (4 * 32, 32)
    assert names["model.layers.1.mlp.experts.3.down_proj.weight_packed"].shape == (64, 4)
    assert names["model.layers.1.mlp.experts.3.down_proj.weight_scale"].shape == (64, 1)
    # the INT4 experts of a written checkpoint dequantize to codes * scale
    written = write_tiny_model(tmp_path, TINY_KIMI_CONFIG, seed=3)
    _, ck = load_model(tmp_path)
    m = "model.layers.2.mlp.experts.5.gate_proj"
    w = loader.unpack_int4(ck.tensor(m + ".weight_packed"), ck.tensor(m + ".weight_scale"), ck.tensor(m + ".weight_shape"))
    codes = loader.int4.unpack_int4_codes(written[m + ".weight_packed"][1], 64)
    scale = from_bf16(written[m + ".weight_scale"][1]).reshape(32, 2)
    assert np.array_equal(w, codes * np.repeat(scale, 32, axis=1))


def test_kimi_text_config_wrapper():
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": copy.deepcopy(TINY_KIMI_CONFIG),
           "vision_config": {"hidden_size": 8}}
    cfg["text_config"]["architectures"] = ["DeepseekV3ForCausalLM"]
    s = load_config(cfg)
    assert isinstance(s, DeepseekV3Spec) and s.n_routed_experts == 8 and s.quant is not None


def test_dflash_spec():
    s = load_config(TINY_DFLASH_CONFIG)
    assert isinstance(s, DFlashSpec)
    assert (s.block_size, s.num_target_layers, s.target_layer_ids, s.mask_token_id) == (16, 8, (1, 3, 6), 63)
    assert loader.expected_tensors(s)["fc.weight"].shape == (32, 3 * 32)


def test_dflash_default_tap_layers():
    cfg = copy.deepcopy(TINY_DFLASH_CONFIG)
    del cfg["dflash_config"]["target_layer_ids"]
    cfg.update(num_target_layers=36, num_hidden_layers=5)
    assert load_config(cfg).target_layer_ids == (1, 9, 17, 25, 33)    # Qwen3-8B-DFlash-b16's taps
    cfg["num_hidden_layers"] = 1
    assert load_config(cfg).target_layer_ids == (18,)


def test_yarn_original_context_defaults_to_the_model_context():
    cfg = copy.deepcopy(TINY_KIMI_CONFIG)
    del cfg["rope_scaling"]["original_max_position_embeddings"]     # transformers then uses max_position_embeddings
    assert load_config(cfg).rope_scaling.original_max_position_embeddings == cfg["max_position_embeddings"]


def test_config_from_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    assert load_config(tmp_path) == load_config(tmp_path / "config.json") == load_config(TINY_LLAMA_CONFIG)


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unknown architecture 'GPT2LMHeadModel'"),
    ({"architectures": []}, "no 'architectures'"),
    ({"hidden_size": "32"}, "should be an integer"),
    ({"num_hidden_layers": None}, "lacks required key 'num_hidden_layers'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs original_max_position_embeddings"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be a positive integer"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"hidden_size": 10 ** 30}, "'hidden_size' is out of range"),
    ({"rms_norm_eps": -1e-6}, "'rms_norm_eps' is out of range"),
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' should be a finite number"),
    ({"rope_theta": 0}, "'rope_theta' is out of range"),
    ({"max_position_embeddings": 0}, "'max_position_embeddings' is out of range"),
    ({"eos_token_id": "2"}, "'eos_token_id' should be token ids"),
    ({"eos_token_id": [2, 1.5]}, "'eos_token_id' should be token ids"),
    ({"eos_token_id": 10 ** 6}, "'eos_token_id' should be token ids in 0 .. vocab_size - 1"),
    ({"bos_token_id": -1}, "'bos_token_id' should be token ids"),
    ({"bos_token_id": [1, 2]}, "'bos_token_id' should be one token id"),
])
def test_bad_llama_config(tmp_path, change, match):
    cfg = {**TINY_LLAMA_CONFIG, **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=match) as e:
        load_config(tmp_path)
    assert e.value.path == str(tmp_path / "config.json")


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["quantization_config"].update(quant_method="gptq"), "unsupported quant_method"),
    (lambda c: c["quantization_config"].update(format="float-quantized"), "unsupported compressed-tensors format"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8), "need int4"),
    (lambda c: c.update(topk_method="bogus"), "unsupported topk_method"),
    (lambda c: c.update(n_group=3), "not divisible by n_group"),
    (lambda c: c.update(n_group=0), "'n_group' must be a positive integer"),
    (lambda c: c.update(topk_group=4), "topk_group 4 > n_group 2"),
])
def test_bad_kimi_config(edit, match):
    cfg = copy.deepcopy(TINY_KIMI_CONFIG)
    edit(cfg)
    with pytest.raises(LoadError, match=match):
        load_config(cfg)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), "out of range"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c.pop("block_size"), "block_size"),
])
def test_bad_dflash_config(edit, match):
    cfg = copy.deepcopy(TINY_DFLASH_CONFIG)
    edit(cfg)
    with pytest.raises(LoadError, match=match):
        load_config(cfg)


def _rewrite(folder, name, dtype, arr):
    """Replace one tensor of a single-file tiny checkpoint."""
    ck = open_checkpoint(folder / "model.safetensors")
    tensors = {n: (ck.info(n)[0], np.array(ck.tensor(n))) for n in ck.names()}
    ck.close()
    if dtype is None:
        del tensors[name]
    else:
        tensors[name] = (dtype, arr)
    save_safetensors(folder / "model.safetensors", tensors)


def test_missing_tensor(tmp_path):
    write_tiny_model(tmp_path, TINY_LLAMA_CONFIG)
    _rewrite(tmp_path, "model.layers.1.mlp.up_proj.weight", None, None)
    with pytest.raises(LoadError, match="missing tensor") as e:
        load_model(tmp_path)
    assert e.value.tensor == "model.layers.1.mlp.up_proj.weight"


def test_shape_mismatch(tmp_path):
    write_tiny_model(tmp_path, TINY_LLAMA_CONFIG)
    _rewrite(tmp_path, "model.layers.0.self_attn.k_proj.weight", "BF16", np.ones((32, 32), np.uint16))
    with pytest.raises(LoadError, match=r"shape \(32, 32\) does not match the config \(expected \(16, 32\)\)") as e:
        load_model(tmp_path)
    assert e.value.tensor == "model.layers.0.self_attn.k_proj.weight"
    assert e.value.path.endswith("model.safetensors")


def test_dtype_mismatch(tmp_path):
    write_tiny_model(tmp_path, TINY_DFLASH_CONFIG)
    _rewrite(tmp_path, "fc.weight", "I32", np.ones((32, 96), np.int32))
    with pytest.raises(LoadError, match="dtype I32 does not match") as e:
        load_model(tmp_path)
    assert e.value.tensor == "fc.weight"


def test_extra_tensor_warns(tmp_path):
    write_tiny_model(tmp_path, TINY_QWEN3_CONFIG)
    _rewrite(tmp_path, "model.layers.61.mtp.weight", "F32", np.ones(3, np.float32))
    with pytest.warns(UserWarning, match="model.layers.61.mtp.weight"):
        spec, ck = load_model(tmp_path)
    assert "model.layers.61.mtp.weight" in ck


def test_packed_int4_disagrees_with_weight_shape(tmp_path):
    write_tiny_model(tmp_path, TINY_KIMI_CONFIG)
    name = "model.layers.1.mlp.experts.2.up_proj.weight_shape"
    _rewrite(tmp_path, name, "I64", np.array([32, 128], np.int64))
    with pytest.raises(LoadError, match="weight_shape") as e:
        load_model(tmp_path)
    assert e.value.tensor == name
    # and a packed tensor of the wrong width
    write_tiny_model(tmp_path, TINY_KIMI_CONFIG)
    name = "model.layers.2.mlp.experts.0.down_proj.weight_packed"
    _rewrite(tmp_path, name, "I32", np.ones((64, 3), np.int32))
    with pytest.raises(LoadError, match="shape") as e:
        load_model(tmp_path)
    assert e.value.tensor == name


def test_unquantized_expert_where_int4_expected(tmp_path):
    write_tiny_model(tmp_path, TINY_KIMI_CONFIG)
    _rewrite(tmp_path, "model.layers.1.mlp.experts.0.gate_proj.weight_packed", None, None)
    with pytest.raises(LoadError, match="missing tensor") as e:
        load_model(tmp_path)
    assert e.value.tensor == "model.layers.1.mlp.experts.0.gate_proj.weight_packed"
