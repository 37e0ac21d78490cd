"""safetensors reading: every dtype, single/dir/sharded, cross-checked with the safetensors package, and a
LoadError naming file and tensor for each kind of bad file."""
import json
import struct

import numpy as np
import pytest

import loader
from loader import LoadError, open_checkpoint, save_safetensors
from runtime.bf16 import from_bf16, to_bf16


def _all_dtypes(rng):
    return {
        "bf16": ("BF16", to_bf16(rng.standard_normal((3, 5)).astype(np.float32))),
        "f16": rng.standard_normal((4, 2)).astype(np.float16),
        "f32": rng.standard_normal((7,)).astype(np.float32),
        "f64": rng.standard_normal((2, 2)).astype(np.float64),
        "i32": rng.integers(-1000, 1000, (3, 3)).astype(np.int32),
        "i64": rng.integers(-10**12, 10**12, (5,)).astype(np.int64),
        "u8": rng.integers(0, 256, (9,)).astype(np.uint8),
        "i8": rng.integers(-128, 128, (2, 3, 4)).astype(np.int8),
        "fp8": ("F8_E4M3", rng.integers(0, 256, (16,)).astype(np.uint8)),
        "fp8b": ("F8_E5M2", rng.integers(0, 256, (16,)).astype(np.uint8)),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def test_roundtrip_every_dtype_zero_copy(tmp_path):
    rng = np.random.default_rng(1)
    tensors = _all_dtypes(rng)
    save_safetensors(tmp_path / "m.safetensors", tensors, metadata={"format": "pt"})
    ck = open_checkpoint(tmp_path / "m.safetensors")
    assert sorted(ck.names()) == sorted(tensors)
    for name, v in tensors.items():
        dtype, arr = v if isinstance(v, tuple) else (None, v)
        got = ck.tensor(name)
        assert got.shape == arr.shape and got.dtype.itemsize == arr.dtype.itemsize
        assert np.array_equal(got.view(arr.dtype), arr), name
        assert not got.flags.writeable        # a view of the read-only mmap, not a copy
        if dtype:
            assert ck.info(name) == (dtype, arr.shape)
    assert "bf16" in ck and "nope" not in ck
    assert np.array_equal(ck.float32("bf16"), from_bf16(tensors["bf16"][1]).reshape(3, 5))
    assert np.array_equal(ck.float32("f16"), tensors["f16"].astype(np.float32))


def test_matches_safetensors_package(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(2)
    ref = {"a": torch.randn(17, 9).to(torch.bfloat16), "b": torch.randn(4, 4, dtype=torch.float16),
           "c": torch.randint(-5, 5, (6,), dtype=torch.int64), "d": torch.randn(8).to(torch.float8_e4m3fn),
           "e": torch.randn(8).to(torch.float8_e5m2), "f": torch.randn(3, 3)}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    ck = open_checkpoint(tmp_path / "ref.safetensors")
    for name, t in ref.items():
        assert np.array_equal(ck.float32(name), t.float().numpy()), name   # randn: no NaN expected
    assert np.array_equal(ck.tensor("a"), ref["a"].view(torch.int16).numpy().view(np.uint16))
    # and the package reads what we write
    save_safetensors(tmp_path / "ours.safetensors",
                     {"x": ("BF16", to_bf16(rng.standard_normal((5, 3)).astype(np.float32))),
                      "y": np.arange(6, dtype=np.int32).reshape(2, 3)})
    back = load_file(str(tmp_path / "ours.safetensors"))
    assert np.array_equal(back["x"].float().numpy(), open_checkpoint(tmp_path / "ours.safetensors").float32("x"))
    assert np.array_equal(back["y"].numpy(), np.arange(6, dtype=np.int32).reshape(2, 3))


def test_fp8_decode_all_patterns():
    torch = pytest.importorskip("torch")
    bits = np.arange(256, dtype=np.uint8)
    for dt, tdt in (("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2)):
        want = torch.from_numpy(bits).view(tdt).float().numpy()
        assert np.isnan(want).sum() == (2 if dt == "F8_E4M3" else 6)   # NaN only where the format has it
        assert np.array_equal(loader.to_float32(bits, dt), want, equal_nan=True)


def _sharded(tmp_path, rng):
    tensors = {f"w{i}": rng.standard_normal((i + 1, 3)).astype(np.float32) for i in range(6)}
    wm = {}
    for s, names in enumerate((["w0", "w1"], ["w2", "w3", "w4"], ["w5"])):
        fname = f"model-{s + 1:05d}-of-00003.safetensors"
        save_safetensors(tmp_path / fname, {n: tensors[n] for n in names})
        wm.update({n: fname for n in names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tensors, wm


def test_sharded_and_directory(tmp_path):
    rng = np.random.default_rng(3)
    tensors, _ = _sharded(tmp_path, rng)
    for src in (tmp_path, tmp_path / "model.safetensors.index.json"):
        ck = open_checkpoint(src)
        assert len(ck.files) == 3 and sorted(ck.names()) == sorted(tensors)
        for n, a in tensors.items():
            assert np.array_equal(ck.tensor(n), a)
    single = tmp_path / "single"
    single.mkdir()
    save_safetensors(single / "model.safetensors", {"z": tensors["w3"]})
    assert np.array_equal(open_checkpoint(single).tensor("z"), tensors["w3"])


def test_missing_shard(tmp_path):
    _, wm = _sharded(tmp_path, np.random.default_rng(4))
    (tmp_path / wm["w2"]).unlink()
    with pytest.raises(LoadError, match="missing shard") as e:
        open_checkpoint(tmp_path)
    assert e.value.path.endswith("model.safetensors.index.json") and e.value.tensor in ("w2", "w3", "w4")


def test_index_names_tensor_the_shard_lacks(tmp_path):
    _, wm = _sharded(tmp_path, np.random.default_rng(5))
    wm["ghost"] = wm["w0"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(LoadError, match="lacks it") as e:
        open_checkpoint(tmp_path)
    assert e.value.tensor == "ghost"


def test_missing_tensor_lookup(tmp_path):
    save_safetensors(tmp_path / "m.safetensors", {"a": np.ones(3, np.float32)})
    with pytest.raises(LoadError, match="not in checkpoint") as e:
        open_checkpoint(tmp_path / "m.safetensors").tensor("b")
    assert e.value.tensor == "b"


# ---- bad files: each one a LoadError naming the file (and the tensor where there is one)

def _write_raw(path, header: dict | bytes, data: bytes, header_len=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def _bad(path, match, tensor=None):
    with pytest.raises(LoadError, match=match) as e:
        open_checkpoint(path)
    assert e.value.path == str(path)
    assert str(path) in str(e.value)
    if tensor:
        assert e.value.tensor == tensor and repr(tensor) in str(e.value)


def test_truncated_file(tmp_path):
    p = tmp_path / "m.safetensors"
    save_safetensors(p, {"a": np.arange(100, dtype=np.float32), "b": np.arange(50, dtype=np.float32)})
    p.write_bytes(p.read_bytes()[:-40])
    _bad(p, "past the end", "b")
    p.write_bytes(b"\x10\x00\x00")
    _bad(p, "too short")


def test_header_length_larger_than_file(tmp_path):
    p = _write_raw(tmp_path / "m.safetensors", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                   b"\0" * 4, header_len=10**9)
    _bad(p, "larger than the file")


def test_header_not_json(tmp_path):
    _bad(_write_raw(tmp_path / "m.safetensors", b"{not json" + b" " * 7, b""), "not valid JSON")
    _bad(_write_raw(tmp_path / "n.safetensors", b"\xff\xfe[]", b""), "not valid JSON")
    _bad(_write_raw(tmp_path / "o.safetensors", b"[1, 2]", b""), "not a JSON object")


def test_duplicate_tensor_in_header(tmp_path):
    raw = (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
           b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    _bad(_write_raw(tmp_path / "m.safetensors", raw, b"\0" * 8), "twice", "a")


def test_overlapping_offsets(tmp_path):
    h = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
         "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    _bad(_write_raw(tmp_path / "m.safetensors", h, b"\0" * 24), "overlaps", "b")


def test_out_of_range_offsets(tmp_path):
    h = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
         "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    _bad(_write_raw(tmp_path / "m.safetensors", h, b"\0" * 20), "past the end", "b")
    h = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]}}
    _bad(_write_raw(tmp_path / "n.safetensors", h, b"\0" * 20), "bad data_offsets", "a")


def test_offsets_disagree_with_shape_or_dtype(tmp_path):
    h = {"a": {"dtype": "BF16", "shape": [4, 2], "data_offsets": [0, 32]}}
    _bad(_write_raw(tmp_path / "m.safetensors", h, b"\0" * 32), "needs 16", "a")
    h = {"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}
    _bad(_write_raw(tmp_path / "n.safetensors", h, b"\0" * 2), "unsupported dtype", "a")
    h = {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}
    _bad(_write_raw(tmp_path / "o.safetensors", h, b"\0" * 4), "bad shape", "a")
    h = {"a": {"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}   # 2**64 wraps int64 to 0
    _bad(_write_raw(tmp_path / "q.safetensors", h, b""), "needs 18446744073709551616", "a")
    h = {"a": {"dtype": "F32", "shape": [1]}}
    _bad(_write_raw(tmp_path / "p.safetensors", h, b"\0" * 4), "lacks", "a")


def test_not_a_checkpoint_path(tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        open_checkpoint(tmp_path / "nothing")
    with pytest.raises(LoadError, match="no .safetensors"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{]")
    with pytest.raises(LoadError, match="bad safetensors index"):
        open_checkpoint(tmp_path)


def test_no_pickle_anywhere():
    import pathlib
    src = pathlib.Path(loader.__file__).parent
    for f in src.glob("*.py"):
        text = f.read_text()
        assert "import pickle" not in text and "allow_pickle=True" not in text and "torch.load" not in text, f


def test_corrupted_header_never_crashes(tmp_path):
    """Random byte damage to a header: a LoadError or a file whose every tensor reads back, nothing else."""
    good = tmp_path / "good.safetensors"
    save_safetensors(good, _all_dtypes(np.random.default_rng(0)))
    data = good.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    rng = np.random.default_rng(1)
    errors = 0
    for i in range(200):
        b = bytearray(data)
        for pos in rng.integers(0, header_end, size=int(rng.integers(1, 4))):
            b[pos] = int(rng.integers(0, 256))
        p = tmp_path / f"bad{i}.safetensors"
        p.write_bytes(bytes(b) if i % 5 else bytes(b[: int(rng.integers(0, len(b)))]))
        try:
            ck = open_checkpoint(p)
            for n in ck.names():
                ck.float32(n)
        except LoadError:
            errors += 1
    assert errors > 100
