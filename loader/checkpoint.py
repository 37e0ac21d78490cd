"""safetensors checkpoints: single file, directory, or sharded with model.safetensors.index.json.

Parsed here (not through the safetensors package) so that every header field is validated before any byte
is trusted, and so that tensors come back as read-only numpy views of one mmap per shard: nothing is copied
to host memory until a consumer asks for float32. bf16 (and fp8) have no numpy dtype: bf16 comes back as
uint16 bit patterns (runtime.bf16), fp8 as uint8 bytes; `Checkpoint.float32` converts either.

File layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the data region; offsets are relative to the start of the data region.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from runtime.bf16 import from_bf16
from .errors import LoadError

# safetensors dtype string -> numpy storage dtype (bf16 as uint16 bits, fp8 as uint8 bytes).
STORAGE_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"), "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")
MAX_HEADER_BYTES = 100 * 1024 * 1024   # the safetensors reference implementation's limit


def _fp8_table(exp_bits: int, man_bits: int, bias: int, e4m3fn: bool) -> np.ndarray:
    """float32 value of each of the 256 fp8 bit patterns (E4M3FN: no inf, 0x7f/0xff NaN; E5M2: IEEE-like)."""
    out = np.empty(256, np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if e4m3fn and e == 15 and m == 7:
            v = float("nan")
        elif not e4m3fn and e == 31:
            v = float("inf") if m == 0 else float("nan")
        elif e == 0:
            v = m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        out[b] = sign * v
    return out


_FP8_TO_F32 = {"F8_E4M3": _fp8_table(4, 3, 7, True), "F8_E5M2": _fp8_table(5, 2, 15, False)}


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor in safetensors dtype `dtype` (storage as returned by Checkpoint.tensor) -> float32 copy."""
    if dtype == "BF16":
        return from_bf16(array).reshape(array.shape)
    if dtype in _FP8_TO_F32:
        return _FP8_TO_F32[dtype][array]
    return np.asarray(array, dtype=np.float32).copy()


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str                 # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    start: int                 # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One .safetensors file: validated header, one read-only mmap, zero-copy tensor views."""

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        try:
            self.size = self.path.stat().st_size
        except OSError as e:
            raise LoadError(f"cannot open safetensors file: {e.strerror}", self.path) from None
        if self.size < 8:
            raise LoadError(f"file too short for a safetensors header ({self.size} bytes)", self.path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > self.size - 8:
                raise LoadError(f"header length {header_len} is larger than the file ({self.size} bytes): "
                                "truncated or not a safetensors file", self.path)
            if header_len > MAX_HEADER_BYTES:
                raise LoadError(f"header length {header_len} exceeds {MAX_HEADER_BYTES} bytes", self.path)
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LoadError(f"header is not valid JSON: {e}", self.path) from None
        except _DuplicateKey as e:
            raise LoadError("header lists the tensor twice", self.path, e.args[0]) from None
        if not isinstance(header, dict):
            raise LoadError("header is not a JSON object", self.path)
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.infos: dict[str, TensorInfo] = self._validate(header)
        self._mmap = None

    def _validate(self, header: dict) -> dict[str, TensorInfo]:
        data_len = self.size - self.data_start
        infos = {}
        spans = []
        for name, entry in header.items():
            if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
                raise LoadError("header entry lacks dtype/shape/data_offsets", self.path, name)
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if dtype not in STORAGE_DTYPES:
                raise LoadError(f"unsupported dtype {dtype!r}", self.path, name)
            if (not isinstance(shape, list) or
                    not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise LoadError(f"bad shape {shape!r}", self.path, name)
            if (not isinstance(offsets, list) or len(offsets) != 2 or
                    not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
                raise LoadError(f"bad data_offsets {offsets!r}", self.path, name)
            begin, end = offsets
            nbytes = math.prod(shape) * STORAGE_DTYPES[dtype].itemsize   # exact: no int64 wraparound
            if not 0 <= begin <= end:
                raise LoadError(f"bad data_offsets {offsets}", self.path, name)
            if end > data_len:
                raise LoadError(f"data_offsets {offsets} run past the end of the data ({data_len} bytes): "
                                "file truncated or offsets out of range", self.path, name)
            if end - begin != nbytes:
                raise LoadError(f"data_offsets {offsets} span {end - begin} bytes but dtype {dtype} shape "
                                f"{shape} needs {nbytes}", self.path, name)
            infos[name] = TensorInfo(name, dtype, tuple(shape), self.data_start + begin, nbytes)
            spans.append((begin, end, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise LoadError(f"tensor data overlaps {n0!r} ([{b0}, {e0}) vs [{b1}, {e1}))", self.path, n1)
        return infos

    def _map(self) -> mmap.mmap:
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if len(self._mmap) != self.size:
                raise LoadError("file changed size while being opened", self.path)
        return self._mmap

    def advise_sequential(self):
        """Tell the kernel the whole file will be read front to back (aggressive readahead): a cold full
        load runs several times faster. A hint only; ignored where madvise is missing."""
        if hasattr(mmap, "MADV_SEQUENTIAL") and self.size:
            self._map().madvise(mmap.MADV_SEQUENTIAL)

    def tensor(self, name: str) -> np.ndarray:
        info = self.infos[name]
        self._map()
        dt = STORAGE_DTYPES[info.dtype]
        count = info.nbytes // dt.itemsize
        return np.frombuffer(self._mmap, dtype=dt, count=count, offset=info.start).reshape(info.shape)

    def close(self):
        # numpy views keep the buffer alive; mmap.close() would fail while they exist, so just drop ours.
        self._mmap = None


class Checkpoint:
    """Named tensors from one or more safetensors files. Lazy: nothing is read until `tensor()`."""

    def __init__(self, files: list[SafetensorsFile], source: Path, weight_map: Mapping[str, SafetensorsFile]):
        self.files = files
        self.source = source
        self._where = dict(weight_map)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise LoadError("tensor not in checkpoint", self.source, name) from None

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape)."""
        i = self._file(name).infos[name]
        return i.dtype, i.shape

    def nbytes(self, name: str) -> int:
        return self._file(name).infos[name].nbytes

    def path_of(self, name: str) -> Path:
        return self._file(name).path

    def tensor(self, name: str) -> np.ndarray:
        """Read-only zero-copy view (bf16 -> uint16 bits, fp8 -> uint8 bytes)."""
        return self._file(name).tensor(name)

    def float32(self, name: str) -> np.ndarray:
        """A float32 copy of a float (or integer) tensor."""
        dtype, _ = self.info(name)
        return to_float32(self.tensor(name), dtype)

    def fingerprint(self, name: str) -> str:
        """Identifies one tensor's bytes without reading them (file path, size, mtime, offsets): a cache key."""
        f = self._file(name)
        st = f.path.stat()
        i = f.infos[name]
        key = f"{f.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{name}|{i.dtype}|{i.shape}|{i.start}"
        return hashlib.sha256(key.encode()).hexdigest()

    def advise_sequential(self):
        """Readahead hint for a full front-to-back pass (upload, conversion); see SafetensorsFile."""
        for f in self.files:
            f.advise_sequential()

    def total_bytes(self, names: Iterable[str] | None = None) -> int:
        return sum(self.nbytes(n) for n in (self.names() if names is None else names))

    def close(self):
        for f in self.files:
            f.close()

    def __repr__(self):
        return f"Checkpoint({self.source}, {len(self.files)} file(s), {len(self)} tensors)"


INDEX_NAME = "model.safetensors.index.json"


def open_checkpoint(path: os.PathLike | str) -> Checkpoint:
    """A .safetensors file, a directory holding one (or several, no index), or a sharded directory with
    model.safetensors.index.json (or the index file itself)."""
    path = Path(path)
    if path.is_dir() and (path / INDEX_NAME).is_file():
        return _open_index(path / INDEX_NAME)
    if path.is_file() and path.name.endswith(".index.json"):
        return _open_index(path)
    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise LoadError("no .safetensors files in directory", path)
    elif path.is_file():
        shards = [path]
    else:
        raise LoadError("checkpoint path does not exist", path)
    files = [SafetensorsFile(p) for p in shards]
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        for name in f.infos:
            if name in where:
                raise LoadError(f"tensor appears in two files ({where[name].path.name} and {f.path.name})",
                                f.path, name)
            where[name] = f
    return Checkpoint(files, path, where)


def _open_index(index_path: Path) -> Checkpoint:
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise LoadError(f"bad safetensors index: {e}", index_path) from None
    files: dict[str, SafetensorsFile] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise LoadError(f"index names a bad shard {shard!r}", index_path, name)
        if shard not in files:
            shard_path = index_path.parent / shard
            if not shard_path.is_file():
                raise LoadError(f"index points to missing shard {shard}", index_path, name)
            files[shard] = SafetensorsFile(shard_path)
    where = {}
    for name, shard in weight_map.items():
        f = files[shard]
        if name not in f.infos:
            raise LoadError(f"index says the tensor is in {shard}, but that shard lacks it", index_path, name)
        where[name] = f
    for f in files.values():
        for name in f.infos:
            if name not in where:
                raise LoadError("shard holds a tensor the index does not list", f.path, name)
    return Checkpoint(list(files.values()), index_path.parent, where)


# ---------------------------------------------------------------------------------------------------------
# Writing (tests, converters, caches). Tensors are (safetensors dtype, array in its storage dtype).

def _as_storage(name: str, value) -> tuple[str, np.ndarray]:
    if isinstance(value, tuple):
        dtype, arr = value
    else:
        arr = np.asarray(value)
        dtype = {np.dtype(v).str: k for k, v in STORAGE_DTYPES.items()
                 if k not in ("BF16", "F8_E4M3", "F8_E5M2")}.get(arr.dtype.str)
        if dtype is None:
            raise ValueError(f"{name}: no safetensors dtype for numpy {arr.dtype}; pass (dtype, array)")
    arr = np.asarray(arr)
    arr = arr if arr.flags.c_contiguous else arr.copy(order="C")   # (ascontiguousarray makes 0-d 1-d)
    if dtype not in STORAGE_DTYPES or arr.dtype.itemsize != STORAGE_DTYPES[dtype].itemsize:
        raise ValueError(f"{name}: array of {arr.dtype} cannot be stored as {dtype}")
    return dtype, arr


def save_safetensors(path: os.PathLike | str, tensors: Mapping[str, object],
                     metadata: Mapping[str, str] | None = None, align: int = 8) -> None:
    """Write a safetensors file. Values: a numpy array (dtype inferred) or (dtype string, array) for
    BF16 (uint16 bits) / fp8 (uint8). Written to a temp file then renamed, so readers never see half a file."""
    path = Path(path)
    items = [(name, *_as_storage(name, v)) for name, v in tensors.items()]
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, arr in items:
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)   # data region aligned, as the reference writer does
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, arr in items:
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)
