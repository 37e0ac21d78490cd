"""compressed-tensors INT4: unpack against an independent per-element reference, packing round trip,
shape validation, ignore-list matching, and the repack hook's disk cache."""
import numpy as np
import pytest

from loader import LoadError
from loader import int4
from loader.spec import QuantSpec
from loader.testing import random_int4
from runtime.bf16 import from_bf16


def _reference_dequant(packed, scale_bits, n, k):
    """Element by element, straight from the format text: element 8p+i at bits 4i of word p, stored q+8."""
    out = np.empty((n, k), np.float32)
    scale = from_bf16(scale_bits).reshape(scale_bits.shape)
    for r in range(n):
        for c in range(k):
            word = int(packed[r, c // 8]) & 0xFFFFFFFF
            q = ((word >> (4 * (c % 8))) & 0xF) - 8
            out[r, c] = np.float32(q) * scale[r, c // 32]
    return out


@pytest.mark.parametrize("n,k", [(3, 64), (5, 96), (2, 40)])
def test_unpack_matches_reference(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    packed, scale, shape, codes = random_int4(rng, n, k)
    got = int4.unpack_int4(packed, scale, shape)
    assert got.dtype == np.float32 and got.shape == (n, k)
    assert np.array_equal(got, _reference_dequant(packed, scale, n, k))
    assert np.array_equal(int4.unpack_int4_codes(packed, k), codes)
    assert len(np.unique(codes)) == 16      # every nibble value exercised


def test_matches_compressed_tensors_unpack_with_torch():
    """Same bits as compressed-tensors' unpack (shift-and-mask per nibble, minus 8), written with torch."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    packed, scale, shape, _ = random_int4(rng, 4, 64)
    t = torch.from_numpy(packed.copy())
    nib = torch.stack([(t >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(4, 64).to(torch.int8) - 8
    want = nib.float() * torch.from_numpy(from_bf16(scale).reshape(4, 2)).repeat_interleave(32, dim=1)
    assert np.array_equal(int4.unpack_int4(packed, scale, shape), want.numpy())


def test_scale_dtype_decides_bits_or_values():
    """A float scale (a checkpoint converted to f16/f32) is used as values, never read as bf16 bits."""
    rng = np.random.default_rng(3)
    packed, scale, shape, _ = random_int4(rng, 4, 64)
    want = int4.unpack_int4(packed, scale, shape)
    as_float = from_bf16(scale).reshape(scale.shape)
    assert np.array_equal(int4.unpack_int4(packed, as_float, shape), want)
    assert np.array_equal(int4.unpack_int4(packed, as_float.astype(np.float16), shape), want)
    with pytest.raises(LoadError, match="weight_scale should be bf16 bits"):
        int4.unpack_int4(packed, scale.astype(np.int32), shape)


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError):
        int4.pack_int4(np.full((1, 8), 8))


def test_shape_mismatch_is_load_error():
    rng = np.random.default_rng(8)
    packed, scale, shape, _ = random_int4(rng, 4, 64)
    with pytest.raises(LoadError, match="weight_packed shape"):
        int4.unpack_int4(packed, scale, [4, 128])
    with pytest.raises(LoadError, match="weight_packed shape"):
        int4.unpack_int4(packed[:3], scale, shape)
    with pytest.raises(LoadError, match="weight_scale shape"):
        int4.unpack_int4(packed, scale[:, :1], shape)
    with pytest.raises(LoadError, match="multiple of 8"):
        int4.unpack_int4(packed, scale, [4, 60])
    with pytest.raises(LoadError, match="int32"):
        int4.unpack_int4(packed.astype(np.int64), scale, shape)


def test_is_quantized_ignore_list():
    q = QuantSpec(ignore=("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                          r"re:.*mlp\.(gate|up|down)_proj.*"))
    assert int4.is_quantized(q, "model.layers.3.mlp.experts.17.down_proj")
    assert not int4.is_quantized(q, "model.layers.3.mlp.shared_experts.down_proj")
    assert not int4.is_quantized(q, "model.layers.0.mlp.gate_proj")
    assert not int4.is_quantized(q, "model.layers.3.self_attn.kv_b_proj")
    assert not int4.is_quantized(q, "lm_head")
    assert not int4.is_quantized(None, "model.layers.3.mlp.experts.17.down_proj")


def test_repack_hook_and_cache(tmp_path, monkeypatch):
    rng = np.random.default_rng(9)
    packed, scale, shape, codes = random_int4(rng, 8, 64)
    monkeypatch.setattr(int4, "_REPACKER", None)
    with pytest.raises(LoadError, match="no INT4 repacker"):
        int4.repack_int4_for_kernel(packed, scale, shape, cache_dir=tmp_path)
    calls = []

    def transpose_repack(p, s, nk):   # a stand-in layout: codes transposed, scales as-is
        calls.append(nk)
        return {"codes_t": np.ascontiguousarray(int4.unpack_int4_codes(p, nk[1]).T), "scale": s}

    int4.register_int4_repacker(transpose_repack, name="test", version="1")
    a = int4.repack_int4_for_kernel(packed, scale, shape, cache_dir=tmp_path)
    b = int4.repack_int4_for_kernel(packed, scale, shape, cache_dir=tmp_path)
    assert calls == [(8, 64)]                          # second call served from disk
    for r in (a, b):
        assert np.array_equal(r["codes_t"], codes.T) and np.array_equal(r["scale"], scale)
    assert len(list(tmp_path.glob("test-1/*.safetensors"))) == 1
    int4.register_int4_repacker(transpose_repack, name="test", version="2")   # new layout version -> rebuilt
    int4.repack_int4_for_kernel(packed, scale, shape, cache_dir=tmp_path, cache_key="k")
    assert len(calls) == 2
    # a damaged cache entry is rebuilt, not trusted
    entry = next(tmp_path.glob("test-2/*.safetensors"))
    entry.write_bytes(b"garbage")
    c = int4.repack_int4_for_kernel(packed, scale, shape, cache_dir=tmp_path, cache_key="k")
    assert len(calls) == 3 and np.array_equal(c["codes_t"], codes.T)
    with pytest.raises(LoadError, match="weight_packed shape"):
        int4.repack_int4_for_kernel(packed, scale, [8, 128], cache_dir=tmp_path)


def test_repack_and_dequant_from_checkpoint(tmp_path, monkeypatch):
    from loader import load_model
    from loader.testing import TINY_KIMI_CONFIG, write_tiny_model

    written = write_tiny_model(tmp_path / "m", TINY_KIMI_CONFIG, seed=4)
    _, ck = load_model(tmp_path / "m")
    module = "model.layers.1.mlp.experts.6.down_proj"
    codes = int4.unpack_int4_codes(written[module + ".weight_packed"][1], 32)
    w = int4.dequant_module(ck, module)
    assert np.array_equal(w, codes * np.repeat(from_bf16(written[module + ".weight_scale"][1]).reshape(64, 1), 32, 1))
    calls = []
    monkeypatch.setattr(int4, "_REPACKER", None)
    int4.register_int4_repacker(lambda p, s, nk: calls.append(nk) or {"p": p.copy()}, name="ck", version="1")
    a = int4.repack_module(ck, module, cache_dir=tmp_path / "cache")
    b = int4.repack_module(ck, module, cache_dir=tmp_path / "cache")
    assert calls == [(64, 32)] and np.array_equal(a["p"], b["p"])
    with pytest.raises(LoadError, match="missing INT4 tensor") as e:
        int4.read_module(ck, "model.layers.0.mlp.gate_proj")      # a dense (bf16) module
    assert e.value.tensor == "model.layers.0.mlp.gate_proj.weight_packed"
