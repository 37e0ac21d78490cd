"""CUDA implementation of the backend interface (runtime/backends/base.py) for the llama family (Llama, SmolLM2,
Qwen3) and the DFlash drafter: bf16 activations and weights, fp32 accumulation, the kernels of
runtime/dense_kernels.py. The models run on it unchanged.

Arrays are `CudaArray`s: a DeviceArray whose rows (axis 0) are `ld` elements apart, the rest of each row
contiguous, so the models' slices of fused outputs (`qkv[:, :hq]`, `gu[:, inter:]`, `h[1:]`) are views that
the kernels read through their row-stride arguments, never copies.

Two fusions are done lazily, without the models knowing:
- `add(a, b)` returns a pending sum; an `rmsnorm` of it runs one kernel that writes both the sum (the
  residual stream) and the normed rows. Anything else that reads it materialises it with the add kernel.
- `rmsnorm` of a per-head [T, H, D] view (Qwen3 q_norm/k_norm, the drafter) returns a pending norm that the
  following `rope` applies inside the rope kernel.

Graph capture (runtime/cuda_engine.py drives it): inside `recording(alloc, ws)` every op output comes from
`alloc` (a bump region that lives as long as the graph), split-K/split-KV scratch from `ws`, and host inputs
are refused. Inside `bind_start(caches, scalar)` the KV caches take their write offset and attention prefix
from the int32 device scalar instead of the host `start` the model passes, so a captured forward replays at
any prefix length.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager

import numpy as np

from runtime import dense_kernels as dk
from runtime.bf16 import from_bf16, to_bf16
from runtime.cuda import DeviceArray, OutOfMemoryError, Stream, empty, get_device, get_kernel
from runtime.cuda.memory import Arena
from .base import Backend

BF16 = np.dtype(np.uint16)
ALIGN = 256


class CudaArray(DeviceArray):
    """A device array whose axis-0 rows are `ld` elements apart (inner axes contiguous).
    `pending`: ("add", a, b) or ("norm", src, weight, eps) not computed yet (ptr is 0 until then).
    `bound_start`: for a KV cache inside CudaBackend.bind_start, the int32 device scalar of its prefix."""

    def __init__(self, ptr, shape, dtype, ld=None, owner=None, pending=None):
        super().__init__(ptr, shape, dtype, owner=owner)
        self.row_elems = math.prod(self.shape[1:])
        self.ld = self.row_elems if ld is None else int(ld)
        self.pending = pending
        self.bound_start = None

    @property
    def contiguous(self) -> bool:
        return self.ld == self.row_elems

    def _need_ready(self, what):
        if self.pending is not None:
            raise RuntimeError(f"CudaArray.{what} on a pending {self.pending[0]}: pass it through the backend")

    def __getitem__(self, key):
        """Row slices a[r0:r1] and, on 2-D arrays, column slices a[:, c0:c1] (views, step 1)."""
        self._need_ready("slicing")
        key = key if isinstance(key, tuple) else (key,)
        if not all(isinstance(k, slice) and k.step in (None, 1) for k in key) or len(key) > 2:
            raise TypeError(f"CudaArray supports a[r0:r1] and a[:, c0:c1] views, got {key!r}")
        r0, r1, _ = key[0].indices(self.shape[0])
        ptr, shape, isz = self.ptr, list(self.shape), self.dtype.itemsize
        ptr += r0 * self.ld * isz
        shape[0] = max(0, r1 - r0)
        if len(key) == 2:
            if len(self.shape) != 2:
                raise TypeError(f"column slices need a 2-D array, got shape {self.shape}")
            c0, c1, _ = key[1].indices(self.shape[1])
            ptr += c0 * isz
            shape[1] = max(0, c1 - c0)
        return CudaArray(ptr, tuple(shape), self.dtype, ld=self.ld, owner=self.owner or self)

    def reshape(self, *shape):
        """Keeps axis 0 (and the row stride) unless the array is contiguous."""
        self._need_ready("reshape")
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        if shape[0] == self.shape[0]:
            return CudaArray(self.ptr, shape, self.dtype, ld=self.ld, owner=self.owner or self)
        if not self.contiguous:
            raise ValueError(f"reshape {self.shape} -> {shape} changes axis 0 of a strided view")
        return CudaArray(self.ptr, shape, self.dtype, owner=self.owner or self)

    @property
    def ndim(self):
        return len(self.shape)


class _WeightPool:
    """Weights in a few large arenas (one cuMemAlloc per 256 MiB, not one per tensor)."""
    CHUNK = 256 << 20

    def __init__(self):
        self.arenas: list[Arena] = []
        self.count = 0

    def alloc(self, shape, dtype) -> CudaArray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        self.count += 1
        name = f"w{self.count}"
        if self.arenas:
            try:
                a = self.arenas[-1].alloc(name, shape, dtype)
                return CudaArray(a.ptr, shape, dtype, owner=self.arenas[-1])
            except OutOfMemoryError as e:
                if e.name != "ARENA_OUT_OF_MEMORY":
                    raise
        self.arenas.append(Arena(max(self.CHUNK, nbytes + ALIGN), name=f"weights{len(self.arenas)}"))
        a = self.arenas[-1].alloc(name, shape, dtype)
        return CudaArray(a.ptr, shape, dtype, owner=self.arenas[-1])

    @property
    def nbytes(self) -> int:
        return sum(a.used for a in self.arenas)


class Region:
    """Bump allocation over one device buffer: a captured graph's activations (alive as long as the graph)."""

    def __init__(self, nbytes: int):
        self.buf = empty((max(int(nbytes), ALIGN),), np.uint8)
        self.offset = 0

    def alloc(self, shape, dtype) -> CudaArray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        off = -(-self.offset // ALIGN) * ALIGN
        if off + nbytes > self.buf.nbytes:
            raise RuntimeError(f"graph region overflow: {off + nbytes} > {self.buf.nbytes} bytes (the recorded "
                               f"work allocated more than its measuring run)")
        self.offset = off + nbytes
        return CudaArray(self.buf.ptr + off, shape, dtype, owner=self.buf)


class Meter:
    """Standalone allocations that also add up what a Region for the same work needs."""

    def __init__(self):
        self.nbytes = 0

    def alloc(self, shape, dtype) -> CudaArray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        self.nbytes = -(-self.nbytes // ALIGN) * ALIGN + nbytes
        a = empty(shape, dtype)
        return CudaArray(a.ptr, shape, dtype, owner=a.owner)


class _Eager:
    def alloc(self, shape, dtype) -> CudaArray:
        a = empty(shape, dtype)
        return CudaArray(a.ptr, shape, dtype, owner=a.owner)


def _plain(a: CudaArray, shape=None) -> DeviceArray:
    """A plain DeviceArray over the same memory (for dense_kernels' shape checks)."""
    return DeviceArray(a.ptr, shape or a.shape, a.dtype, owner=a.owner or a)


class CudaBackend(Backend):
    """graphs: let runtime.engine.Engine decode through captured CUDA graphs (runtime/cuda_engine.py);
    DDTREE_CUDA_GRAPHS=0 turns that off (every op then runs eagerly through the generic engine loop)."""
    name = "cuda"

    def __init__(self, graphs: bool | None = None):
        self.device = get_device()
        self.stream = Stream()
        self.graphs = (os.environ.get("DDTREE_CUDA_GRAPHS", "1") != "0") if graphs is None else bool(graphs)
        # DDTREE_FUSE=0: norm_linear / swiglu_linear / rope_write_kv run as their unfused ops (A/B timing)
        self.fuse = os.environ.get("DDTREE_FUSE", "1") != "0"
        self.weights = _WeightPool()
        self._eager = _Eager()
        self._eager_ws = dk.Workspace()
        self._alloc, self._ws, self.recording_now = self._eager, self._eager_ws, False

    # ---- recording and binding (runtime/cuda_engine.py) ---------------------------------------------------
    @contextmanager
    def recording(self, alloc, ws):
        """Outputs from `alloc`, scratch from `ws`, host inputs refused (the body may be graph-captured)."""
        prev = self._alloc, self._ws, self.recording_now
        self._alloc, self._ws, self.recording_now = alloc, ws, True
        try:
            yield
        finally:
            self._alloc, self._ws, self.recording_now = prev

    @contextmanager
    def bind_start(self, caches, scalar: DeviceArray):
        """KV caches write at / attend over the prefix length held in `scalar` (int32 device [1])."""
        for c in caches:
            c.bound_start = scalar
        try:
            yield
        finally:
            for c in caches:
                c.bound_start = None

    def materialize(self, x: CudaArray) -> CudaArray:
        """x computed and contiguous (a graph output another graph reads)."""
        return self._contiguous(self._ready(x))

    # ---- helpers ------------------------------------------------------------------------------------------
    def _new(self, shape, dtype=BF16, pad_to: int = 1) -> CudaArray:
        """A fresh output. pad_to: round the row stride up (16-byte rows for the logits readers)."""
        shape = tuple(int(s) for s in shape)
        inner = math.prod(shape[1:])
        ld = -(-inner // pad_to) * pad_to
        if ld == inner:
            return self._alloc.alloc(shape, dtype)
        a = self._alloc.alloc((shape[0], ld), dtype)
        return CudaArray(a.ptr, shape, dtype, ld=ld, owner=a.owner)

    def _copy_rows(self, dst_ptr, ldd, src_ptr, lds, rows, row_elems, itemsize, row0=0, row_offset=None):
        row_bytes = row_elems * itemsize
        if row_bytes % 16 or (ldd * itemsize) % 16 or (lds * itemsize) % 16 or dst_ptr % 16 or src_ptr % 16:
            raise ValueError(f"copy_rows: rows of {row_bytes} bytes, strides {ldd * itemsize}/{lds * itemsize} "
                             f"bytes must be 16-byte multiples on 16-byte aligned buffers")
        if rows == 0 or row_bytes == 0:
            return
        vecs = row_bytes // 16
        threads = min(256, -(-vecs // 32) * 32)
        get_kernel("engine_ops", "copy_rows_kernel").launch(
            (-(-vecs // threads), rows), threads,
            [np.uint64(dst_ptr), np.int64(ldd * itemsize), np.uint64(src_ptr), np.int64(lds * itemsize),
             np.int32(rows), np.int32(row_bytes), np.int32(row0),
             row_offset if row_offset is not None else np.uint64(0)], stream=self.stream)

    def _contiguous(self, x: CudaArray) -> CudaArray:
        if x.contiguous:
            return x
        out = self._new(x.shape, x.dtype)
        self._copy_rows(out.ptr, out.ld, x.ptr, x.ld, x.shape[0], x.row_elems, x.dtype.itemsize)
        return out

    def _ready(self, x) -> CudaArray:
        """Run a pending add / norm (in place: x then holds the result)."""
        if not isinstance(x, CudaArray):
            raise TypeError(f"CUDA backend op got {type(x).__name__}; use backend.from_host for host arrays")
        if x.pending is None:
            return x
        kind = x.pending[0]
        if kind == "add":
            a, b = (self._contiguous(self._ready(t)) for t in x.pending[1:])
            out = self._new(a.shape)
            dk.add(a, b, out, stream=self.stream)
        else:
            src, w, eps = x.pending[1:]
            src = self._contiguous(src)
            d = src.shape[-1]
            out = self._new(src.shape)
            dk.rmsnorm(_plain(src, (src.size // d, d)), w, _plain(out, (src.size // d, d)), eps, stream=self.stream)
        self._adopt(x, out)
        return x

    @staticmethod
    def _adopt(x: CudaArray, result: CudaArray):
        x.ptr, x.ld, x.owner, x.pending = result.ptr, result.ld, result.owner, None

    def _index(self, x, dtype=np.int32) -> CudaArray:
        """An index/mask input on the device (host arrays uploaded; refused while recording)."""
        if isinstance(x, CudaArray):
            if x.dtype != np.dtype(dtype):
                raise TypeError(f"expected {np.dtype(dtype)} on the device, got {x.dtype}")
            return x
        return self.from_host(np.asarray(x).astype(dtype, copy=False))

    # ---- memory -------------------------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32):
        """Float buffers (KV caches, scratch) are bf16 on the GPU; standalone, alive while referenced."""
        dtype = BF16 if np.dtype(dtype).kind == "f" else np.dtype(dtype)
        return self._eager.alloc(tuple(int(s) for s in shape), dtype)

    def from_host(self, x):
        if self.recording_now:
            raise RuntimeError("from_host while recording a graph: inputs must live in device buffers")
        x = np.asarray(x)
        if x.dtype.kind == "f":
            x = x.astype(np.float32)
        elif x.dtype.kind in "iub" and x.dtype not in (np.uint32, np.uint16):
            x = x.astype(np.int32)
        x = np.ascontiguousarray(x)
        out = self._eager.alloc(x.shape if x.ndim else (1,), x.dtype)
        _plain(out).upload(x.reshape(out.shape), stream=self.stream)
        return out

    def to_host(self, x):
        x = self._ready(x)
        rows = x.shape[0]
        if x.contiguous or rows == 0:
            host = _plain(x).download(stream=self.stream)
        else:       # strided rows: read the span they cover (no 16-byte rule, unlike a device copy) and pick
            span = _plain(x, ((rows - 1) * x.ld + x.row_elems,)).download(stream=self.stream)
            host = np.lib.stride_tricks.as_strided(span, (rows, x.row_elems), (x.ld * x.dtype.itemsize,
                                                                                x.dtype.itemsize))
            host = np.ascontiguousarray(host).reshape(x.shape)
        return from_bf16(host).reshape(host.shape) if host.dtype == BF16 else host

    # ---- weights ------------------------------------------------------------------------------------------
    def dense_weight(self, w):
        w = np.asarray(w)
        bits = w if w.dtype == np.uint16 else to_bf16(np.asarray(w, np.float32)).reshape(w.shape)
        out = self.weights.alloc(bits.shape, BF16)
        _plain(out).upload(np.ascontiguousarray(bits), stream=self.stream)
        return out

    def _unsupported(self, what):
        raise NotImplementedError(f"CUDA backend: {what} is not implemented (it covers the llama family and the "
                                  f"DFlash drafter; run DeepSeek-V3 / Kimi models with --backend numpy)")

    def int4_weight(self, weight_packed, weight_scale, weight_shape):
        self._unsupported("INT4 linear weights")

    def stack_experts(self, gate, up, down):
        self._unsupported("MoE experts")

    def head_weight(self, w):
        self._unsupported("per-head weights (MLA)")

    def head_linear(self, x, w):
        self._unsupported("head_linear (MLA)")

    def moe_route(self, *args, **kwargs):
        self._unsupported("MoE routing")

    def moe_experts(self, *args, **kwargs):
        self._unsupported("MoE experts")

    # ---- ops ----------------------------------------------------------------------------------------------
    def embedding(self, table, ids):
        table = self._contiguous(self._ready(table))
        ids = self._index(ids)
        out = self._new((ids.size, table.shape[-1]))
        dk.embedding(_plain(table, (table.shape[0], table.row_elems)), ids, out, stream=self.stream)
        return out

    def rmsnorm(self, x, weight, eps):
        if x.pending is not None and x.pending[0] == "add" and len(x.shape) == 2:
            a, b = (self._ready(t) for t in x.pending[1:])
            b = self._contiguous(b)                 # the kernel reads the residual with stride H
            total, out = self._new(a.shape), self._new(a.shape)
            dk.rmsnorm(a, weight, out, eps, residual=b, residual_out=total, ldx=a.ld, stream=self.stream)
            self._adopt(x, total)
            return out
        x = self._ready(x)
        if len(x.shape) == 3 and weight.size == x.shape[-1]:     # per-head: applied by the next rope
            return CudaArray(0, x.shape, BF16, pending=("norm", x, weight, float(eps)))
        if len(x.shape) != 2:
            x = self._contiguous(x).reshape(-1, x.shape[-1])
        out = self._new(x.shape)
        dk.rmsnorm(x, weight, out, eps, ldx=x.ld, stream=self.stream)
        return out

    def linear(self, x, w, bias=None):
        if bias is not None:
            self._unsupported("linear bias (Qwen2 attention)")
        x = self._ready(x)
        if x.ld % 8 or x.ptr % 16:
            x = self._contiguous(x)
        out = self._new((x.shape[0], w.shape[0]), pad_to=8)
        dk.linear(x, w, out, ldx=x.ld, ldo=out.ld, ws=self._ws, stream=self.stream)
        return out

    def _fuses(self, M: int, w, prologue: str) -> bool:
        """Whether `prologue` goes into the x load of the linear by w at M rows (dk.prologue_fuses; DDTREE_FUSE=0:
        never)."""
        N, K = w.shape
        return self.fuse and dk.prologue_fuses(M, N, K, prologue)

    def norm_linear(self, x, weight, eps, w, bias=None):
        """One launch at decode sizes: the linear's x load does the rmsnorm (and the pending residual add,
        whose sum it also writes); otherwise (see _fuses) rmsnorm then linear."""
        M = x.shape[0]
        if bias is not None or len(x.shape) != 2 or not self._fuses(M, w, "rmsnorm"):
            return self.linear(self.rmsnorm(x, weight, eps), w, bias)
        total = x2 = None
        if x.pending is not None and x.pending[0] == "add":
            a, x2 = (self._ready(t) for t in x.pending[1:])
            total = self._new(a.shape)
        else:
            a = self._ready(x)
        if a.ld % 8 or a.ptr % 16 or (x2 is not None and (x2.ld % 8 or x2.ptr % 16)):
            return self.linear(self.rmsnorm(x, weight, eps), w, bias)
        out = self._new((M, w.shape[0]), pad_to=8)
        dk.linear(a, w, out, ldx=a.ld, ldo=out.ld, ws=self._ws, stream=self.stream, prologue="rmsnorm",
                  x2=x2, ldx2=x2.ld if x2 is not None else None, norm_weight=weight, eps=eps, sum_out=total)
        if total is not None:
            self._adopt(x, total)
        return out

    def swiglu_linear(self, gate, up, w):
        """One launch at decode sizes: the linear's x load computes silu(gate) * up (see _fuses)."""
        gate, up = self._ready(gate), self._ready(up)
        M = gate.shape[0]
        if not self._fuses(M, w, "swiglu") or gate.ld % 8 or up.ld % 8 or gate.ptr % 16 or up.ptr % 16:
            return self.linear(self.swiglu(gate, up), w)
        out = self._new((M, w.shape[0]), pad_to=8)
        dk.linear(gate, w, out, ldx=gate.ld, ldo=out.ld, ws=self._ws, stream=self.stream, prologue="swiglu",
                  x2=up, ldx2=up.ld)
        return out

    def rope_write_kv(self, q, k, v, positions, inv_freq, attention_scaling, interleaved, k_cache, v_cache,
                      start):
        """RoPE of q and k (with their pending per-head norms), k and v into the caches: one launch."""
        if not self.fuse:
            return super().rope_write_kv(q, k, v, positions, inv_freq, attention_scaling, interleaved, k_cache,
                                         v_cache, start)
        norms, eps = [], 1e-6
        srcs = []
        for t in (q, k):
            if t.pending is not None and t.pending[0] == "norm":
                src, wt, eps = t.pending[1:]
                srcs.append(self._ready(src))
                norms.append(wt)
            else:
                srcs.append(self._ready(t))
                norms.append(None)
        (q, k), v = srcs, self._ready(v)
        if (len(q.shape) != 3 or len(k.shape) != 3 or not k_cache.contiguous or not v_cache.contiguous
                or v.ld % 8 or v.ptr % 16 or q.shape[-1] % 8):
            return super().rope_write_kv(*(self._renorm(t, n, eps) for t, n in ((q, norms[0]), (k, norms[1]))),
                                         v, positions, inv_freq, attention_scaling, interleaved, k_cache,
                                         v_cache, start)
        T, H, D = q.shape
        if k_cache.bound_start is not None:
            row0, offset = 0, k_cache.bound_start
        else:
            row0, offset = int(start), None
        out = self._new((T, H, D))
        dk.rope_qkv_cache(q, k, v, self._index(positions), self._index(inv_freq, np.float32), out, k_cache, v_cache,
                          n_heads=H, n_kv_heads=k.shape[1], head_dim=D, row0=row0, row_offset=offset,
                          attention_scaling=float(attention_scaling), interleaved=bool(interleaved),
                          q_norm=norms[0], k_norm=norms[1], eps=eps, ldq=q.ld, ldk=k.ld, ldv=v.ld, ldqo=out.ld,
                          stream=self.stream)
        return out

    @staticmethod
    def _renorm(x, weight, eps):
        """x again as a pending per-head norm (undoing rope_write_kv's unpacking for the fallback)."""
        return x if weight is None else CudaArray(0, x.shape, BF16, pending=("norm", x, weight, float(eps)))

    def add(self, a, b):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"add: shapes {a.shape} and {b.shape} differ")
        return CudaArray(0, a.shape, BF16, pending=("add", a, b))

    def concat(self, parts, axis=-1):
        parts = [self._ready(p) for p in parts]
        if any(len(p.shape) != 2 for p in parts) or axis not in (-1, 1):
            self._unsupported("concat of non-2-D arrays")
        rows = parts[0].shape[0]
        out = self._new((rows, sum(p.shape[1] for p in parts)), parts[0].dtype)
        col = 0
        for p in parts:
            self._copy_rows(out.ptr + col * out.dtype.itemsize, out.ld, p.ptr, p.ld, rows, p.shape[1],
                            p.dtype.itemsize)
            col += p.shape[1]
        return out

    def swiglu(self, gate, up):
        gate, up = self._ready(gate), self._ready(up)
        T, I = gate.shape
        out = self._new((T, I))
        dk.swiglu(gate, up, out, T=T, I=I, ldg=gate.ld, ldu=up.ld, stream=self.stream)
        return out

    def rope(self, x, positions, inv_freq, attention_scaling, interleaved):
        norm, eps = None, 1e-6
        if x.pending is not None and x.pending[0] == "norm":
            x, norm, eps = x.pending[1:]
        x = self._ready(x)
        T, H, D = x.shape
        out = self._new((T, H, D))
        dk.rope(x, self._index(positions), self._index(inv_freq, np.float32), out, n_heads=H, head_dim=D,
                attention_scaling=float(attention_scaling), interleaved=bool(interleaved), norm_weight=norm,
                eps=eps, ldx=x.ld, stream=self.stream)
        return out

    def kv_write(self, cache, start, values):
        values = self._ready(values)
        T = values.shape[0]
        if values.row_elems != cache.row_elems:
            raise ValueError(f"kv_write: rows of {values.shape} do not fit cache {cache.shape}")
        if cache.bound_start is not None:
            row0, offset = 0, cache.bound_start
        else:
            row0, offset = int(start), None
            if row0 < 0 or row0 + T > cache.shape[0]:
                raise ValueError(f"kv_write: slots {row0}..{row0 + T} outside the cache capacity {cache.shape[0]}")
        self._copy_rows(cache.ptr, cache.ld, values.ptr, values.ld, T, values.row_elems, cache.dtype.itemsize,
                        row0, offset)

    def attention(self, q, k_cache, v_cache, n_prefix, visibility, scale):
        q = self._ready(q)
        T, Hq, _ = q.shape
        out = self._new((T, Hq, v_cache.shape[-1]))
        if k_cache.bound_start is not None:
            n_prefix, max_keys = k_cache.bound_start, k_cache.shape[0]
        else:
            n_prefix, max_keys = int(n_prefix), None
        dk.attention(q, k_cache, v_cache, n_prefix, self._index(visibility, np.uint32), float(scale), out, T=T,
                     max_keys=max_keys, ldq=q.ld, ldk=k_cache.ld, ldv=v_cache.ld, ws=self._ws, stream=self.stream)
        return out

    def kv_compact(self, cache, src_slots, dst_start):
        planes = dk.KVPlanes([_plain(cache)])
        dk.kv_compact(planes, np.asarray(self.to_host(src_slots) if isinstance(src_slots, CudaArray) else src_slots),
                      int(dst_start), stream=self.stream)
        self.stream.synchronize()           # the eager path's temporary slot buffers are freed on return

    def log_softmax_topk(self, logits, k):
        logits = self._ready(logits)
        L = logits.shape[0]
        logp, ids = self._new((L, k), np.float32), self._new((L, k), np.int32)
        dk.log_softmax_topk(logits, int(k), logp, ids, V=logits.shape[1], ld=logits.ld, stream=self.stream)
        return logp, ids

    def argmax(self, logits):
        logits = self._ready(logits)
        out = self._new((logits.shape[0],), np.int32)
        dk.argmax(logits, out, V=logits.shape[1], ld=logits.ld, ws=self._ws, stream=self.stream)
        return out

    def sample(self, logits, temperature, positions, key):
        logits = self._ready(logits)
        out = self._new((logits.shape[0],), np.int32)
        dk.sample(logits, float(temperature), self._index(positions, np.int32), self._index(key, np.uint32), out,
                  V=logits.shape[1], ld=logits.ld, stream=self.stream)
        return out
