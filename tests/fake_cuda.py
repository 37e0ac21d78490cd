"""A CPU stand-in for the GPU, so the CUDA backend's and graph engine's own logic (views and row strides, lazy
fusions, the device state block, bound prefixes, capture and replay, commit plans) runs in CPU CI.

Device memory is one host numpy buffer (device pointers are real host addresses into it); driver copies are
memmoves; each dense kernel entry point (runtime.dense_kernels) is replaced by a numpy version that reads and
writes that memory through the same pointers, row strides and device scalars the real kernel gets, with bf16
rounding on every store. Graph capture records the kernel closures; a replay runs them again, so values read
from device memory (prefix length, commit plan) are read at replay time, as on the GPU.
This checks plumbing, not kernels: tests/test_dense_kernels.py checks those on the GPU."""
from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

from runtime.backends.numpy_backend import NumpyBackend
from runtime.bf16 import from_bf16, to_bf16

HEAP_BYTES = 1 << 30
_ref = NumpyBackend(blas_threads=None)


@functools.lru_cache(maxsize=None)
def _compiled(family: str, arch: str):
    from runtime.cuda.nvrtc import compile_family
    return compile_family(family, arch, progress=False)


def ptx_param_sizes(family: str, entry: str, arch: str = "90a") -> tuple[int, ...]:
    """An entry's parameter sizes in bytes from the PTX of its build (cached): what a Launch checks its arguments
    against (runtime.cuda.kernel.check_arguments)."""
    sizes = _compiled(family, arch).entry_param_sizes(entry)
    assert sizes is not None, f"{family}:{entry}: no signature in the PTX"
    return sizes


class FakeDevice:
    def __init__(self):
        self.heap = np.zeros(HEAP_BYTES, np.uint8)
        self.base = self.heap.ctypes.data
        self.top = 0
        self.capturing: list | None = None
        self.host_blocks: dict = {}
        self.device = SimpleNamespace(name="fake", cc=(9, 0), arch="90a", sm_count=132, ordinal=0,
                                      smem_optin_bytes=232448, mem_peak_bytes_per_s=0.0, synchronize=lambda: None)

    # ---- memory ---------------------------------------------------------------------------------------------
    def alloc(self, nbytes):
        off = -(-self.top // 256) * 256
        if off + nbytes > HEAP_BYTES:
            raise MemoryError("fake device heap exhausted")
        self.top = off + max(int(nbytes), 1)
        return self.base + off

    def view(self, ptr, shape, dtype, strides=None):
        dtype = np.dtype(dtype)
        off = int(ptr) - self.base
        assert 0 <= off < HEAP_BYTES, f"pointer {ptr:#x} outside the fake heap"
        return np.ndarray(shape, dtype, buffer=self.heap, offset=off, strides=strides)

    def rows(self, ptr, rows, cols, ld, dtype=np.uint16):
        dtype = np.dtype(dtype)
        return self.view(ptr, (rows, cols), dtype, (ld * dtype.itemsize, dtype.itemsize))

    def read(self, ptr, rows, cols, ld):
        return from_bf16(np.ascontiguousarray(self.rows(ptr, rows, cols, ld))).reshape(rows, cols)

    def write(self, ptr, rows, cols, ld, values):
        self.rows(ptr, rows, cols, ld)[...] = to_bf16(np.asarray(values, np.float32)).reshape(rows, cols)

    def scalar(self, arg):
        return int(self.view(arg.ptr, (1,), np.int32)[0]) if hasattr(arg, "ptr") else int(arg)

    def emit(self, fn):
        if self.capturing is not None:
            self.capturing.append(fn)
        else:
            fn()

    # ---- driver -----------------------------------------------------------------------------------------------
    def driver(self):
        dev = self

        class Drv:
            CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
            CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)

            def cuMemAlloc(self, n):
                return (0, dev.alloc(n))

            def cuMemFree(self, p):
                # the real driver invalidates a stream capture that a cuMemFree falls into
                assert dev.capturing is None, "cuMemFree inside a stream capture (the driver invalidates it)"
                return (0,)

            def cuMemGetInfo(self):
                return (0, HEAP_BYTES - dev.top, HEAP_BYTES)

            def cuMemHostAlloc(self, n, flags):
                buf = ctypes.create_string_buffer(max(int(n), 1))
                dev.host_blocks[ctypes.addressof(buf)] = buf
                return (0, ctypes.addressof(buf))

            def cuMemFreeHost(self, p):
                dev.host_blocks.pop(int(p), None)
                return (0,)

            def _copy(self, dst, src, n):
                # inside a capture the copy becomes a node of the graph (runs at each replay)
                dst, src, n = int(dst), int(src), int(n)
                dev.emit(lambda: ctypes.memmove(dst, src, n))
                return (0,)

            def cuMemcpyHtoDAsync(self, dst, src, n, s):
                return self._copy(dst, src, n)

            def cuMemcpyDtoHAsync(self, dst, src, n, s):
                return self._copy(dst, src, n)

            def cuMemcpyDtoDAsync(self, dst, src, n, s):
                return self._copy(dst, src, n)

            def cuMemsetD8Async(self, ptr, v, n, s):
                dev.view(ptr, (int(n),), np.uint8)[:] = v
                return (0,)

            def cuStreamCreateWithPriority(self, flags, priority):
                return (0, 1)

            def cuCtxGetStreamPriorityRange(self):
                return (0, 0, -5)

            def cuStreamSynchronize(self, s):
                return (0,)

            def cuStreamDestroy(self, s):
                return (0,)

        return Drv()


# ---------------------------------------------------------------- kernels (runtime.dense_kernels signatures)
def install(monkeypatch) -> FakeDevice:
    """Point runtime.cuda, runtime.dense_kernels, the CUDA backend and the graph engine at a fake device."""
    import runtime.backends.cuda_backend as cb
    import runtime.cuda.device as device
    import runtime.cuda.memory as memory
    import runtime.cuda.stream as stream
    import runtime.cuda_engine as ce
    import runtime.dense_gmma as dg
    import runtime.dense_kernels as dk

    dev = FakeDevice()
    drv = dev.driver()
    for mod in (device, memory, stream, ce):
        monkeypatch.setattr(mod, "driver", lambda: drv)
    for mod in (device, memory, stream, dk, dg, cb):
        monkeypatch.setattr(mod, "get_device", lambda ordinal=0: dev.device)
    monkeypatch.setattr(stream, "_default", None)
    monkeypatch.setattr(dk, "_default_ws", None)

    def linear(x, w, out, residual=None, *, ldx=None, ldo=None, ldr=None, ws=None, splits=None, kernel="auto",
               stages=None, rt=1, stream=None, prologue="none", x2=None, ldx2=None, norm_weight=None, eps=1e-6,
               sum_out=None, ldsum=None):
        N, K = w.shape
        M = x.shape[0]
        assert x.shape[-1] == K and out.shape[0] == M and out.shape[-1] == N, (x.shape, w.shape, out.shape)
        assert (ldx or K) % 8 == 0 and K % 8 == 0

        def run():
            xv = dev.read(x.ptr, M, K, ldx or K)
            if prologue == "rmsnorm":
                if x2 is not None:
                    xv = from_bf16(to_bf16(xv + dev.read(x2.ptr, M, K, ldx2 or K))).reshape(M, K)
                    if sum_out is not None:
                        dev.write(sum_out.ptr, M, K, ldsum or K, xv)
                xv = from_bf16(to_bf16(_ref.rmsnorm(xv, dev.read(norm_weight.ptr, 1, K, K)[0], eps))).reshape(M, K)
            elif prologue == "swiglu":
                xv = from_bf16(to_bf16(_ref.swiglu(xv, dev.read(x2.ptr, M, K, ldx2 or K)))).reshape(M, K)
            dev.write(out.ptr, M, N, ldo or N, xv @ dev.read(w.ptr, N, K, K).T)
        dev.emit(run)
        return out

    def embedding(table, ids, out, *, stream=None):
        V, H = table.shape
        T = ids.size
        assert out.shape == (T, H) and ids.dtype == np.int32

        def run():
            idx = dev.view(ids.ptr, (T,), np.int32).copy()
            dev.write(out.ptr, T, H, H, np.where((idx >= 0)[:, None], dev.read(table.ptr, V, H, H)[np.clip(idx, 0, V - 1)], 0))
        dev.emit(run)
        return out

    def rmsnorm(x, weight, out, eps, *, residual=None, residual_out=None, ldx=None, ldo=None, stream=None):
        H = weight.size
        rows = x.size // x.shape[-1]
        assert x.shape[-1] == H and out.shape[-1] == H and H % 8 == 0

        def run():
            h = dev.read(x.ptr, rows, H, ldx or H)
            if residual is not None:
                h = from_bf16(to_bf16(h + dev.read(residual.ptr, rows, H, H))).reshape(rows, H)
                if residual_out is not None:
                    dev.write(residual_out.ptr, rows, H, H, h)
            dev.write(out.ptr, rows, H, ldo or H, _ref.rmsnorm(h, dev.read(weight.ptr, 1, H, H)[0], eps))
        dev.emit(run)
        return out

    def rope(x, positions, inv_freq, out, *, n_heads, head_dim, attention_scaling=1.0, interleaved=False,
             norm_weight=None, eps=1e-6, ldx=None, ldo=None, stream=None):
        T, H, D = positions.size, n_heads, head_dim
        assert positions.dtype == np.int32 and inv_freq.dtype == np.float32 and inv_freq.size == D // 2

        def run():
            v = dev.read(x.ptr, T, H * D, ldx or H * D).reshape(T, H, D)
            if norm_weight is not None:
                v = from_bf16(to_bf16(_ref.rmsnorm(v, dev.read(norm_weight.ptr, 1, D, D)[0], eps))).reshape(T, H, D)
            pos = dev.view(positions.ptr, (T,), np.int32).copy()
            inv = dev.view(inv_freq.ptr, (D // 2,), np.float32).copy()
            dev.write(out.ptr, T, H * D, ldo or H * D,
                      _ref.rope(v, pos, inv, attention_scaling, interleaved).reshape(T, H * D))
        dev.emit(run)
        return out

    def rope_qkv_cache(q, k, v, positions, inv_freq, q_out, k_cache, v_cache, *, n_heads, n_kv_heads, head_dim,
                       row0=0, row_offset=None, attention_scaling=1.0, interleaved=False, q_norm=None, k_norm=None,
                       eps=1e-6, ldq=None, ldk=None, ldv=None, ldqo=None, stream=None):
        T, D = positions.size, head_dim
        Hk = n_kv_heads

        def run():
            first = row0 + (dev.scalar(row_offset) if row_offset is not None else 0)
            pos = dev.view(positions.ptr, (T,), np.int32).copy()
            inv = dev.view(inv_freq.ptr, (D // 2,), np.float32).copy()
            for src, ld, H, nw, dst, ldd, r0 in ((q, ldq, n_heads, q_norm, q_out.ptr, ldqo, 0),
                                                 (k, ldk, Hk, k_norm, k_cache.ptr, Hk * D, first)):
                t = dev.read(src.ptr, T, H * D, ld or H * D).reshape(T, H, D)
                if nw is not None:
                    t = from_bf16(to_bf16(_ref.rmsnorm(t, dev.read(nw.ptr, 1, D, D)[0], eps))).reshape(T, H, D)
                ldd = ldd or H * D
                dev.write(dst + r0 * ldd * 2, T, H * D, ldd,
                          _ref.rope(t, pos, inv, attention_scaling, interleaved).reshape(T, H * D))
            dev.write(v_cache.ptr + first * Hk * D * 2, T, Hk * D, Hk * D,
                      dev.read(v.ptr, T, Hk * D, ldv or Hk * D))
        dev.emit(run)
        return q_out

    def swiglu(gate, up, out, *, T=None, I=None, ldg=None, ldu=None, ldo=None, stream=None):
        T = T if T is not None else out.shape[0]
        I = I if I is not None else out.shape[-1]
        assert I % 8 == 0
        dev.emit(lambda: dev.write(out.ptr, T, I, ldo or I, _ref.swiglu(dev.read(gate.ptr, T, I, ldg or I),
                                                                        dev.read(up.ptr, T, I, ldu or I))))
        return out

    def add(a, b, out, *, stream=None):
        n = a.size
        assert a.size == b.size == out.size and n % 8 == 0
        dev.emit(lambda: dev.write(out.ptr, 1, n, n, dev.read(a.ptr, 1, n, n) + dev.read(b.ptr, 1, n, n)))
        return out

    def attention(q, k_cache, v_cache, n_prefix, visibility, scale, out, *, T=None, max_keys=None, ldq=None,
                  ldk=None, ldv=None, ldo=None, splits=None, ws=None, stream=None):
        T = T if T is not None else q.shape[0]
        Hq, D = q.shape[-2], q.shape[-1]
        cap, Hkv, Dk = k_cache.shape[-3:]
        words = -(-T // 32)
        assert D in (64, 128) and Dk == D and Hq % Hkv == 0
        assert visibility.dtype == np.uint32 and visibility.size >= T * words
        assert hasattr(n_prefix, "ptr") or int(n_prefix) + T <= cap
        assert hasattr(n_prefix, "ptr") == (max_keys is not None) or not hasattr(n_prefix, "ptr")

        def run():
            npf = dev.scalar(n_prefix)
            n = npf + T
            assert n <= cap, f"attention over {n} slots > capacity {cap}"
            qv = dev.read(q.ptr, T, Hq * D, ldq or Hq * D).reshape(T, Hq, D)
            kv = dev.read(k_cache.ptr, n, Hkv * D, ldk or Hkv * D).reshape(n, Hkv, D)
            vv = dev.read(v_cache.ptr, n, Hkv * D, ldv or Hkv * D).reshape(n, Hkv, D)
            vis = dev.view(visibility.ptr, (T, words), np.uint32).copy()
            o = _ref.attention(qv, kv, vv, npf, vis, scale)
            dev.write(out.ptr, T, Hq * D, ldo or Hq * D, o.reshape(T, Hq * D))
        dev.emit(run)
        return out

    def log_softmax_topk(logits, k, out_logp, out_ids, *, V=None, ld=None, stream=None):
        rows = logits.shape[0]
        V, ld = V or logits.shape[-1], ld or logits.shape[-1]
        assert ld % 8 == 0 and 1 <= k <= min(1024, V)

        def run():
            lp, ids = _ref.log_softmax_topk(dev.read(logits.ptr, rows, V, ld), k)
            dev.view(out_logp.ptr, (rows, k), np.float32)[...] = lp
            dev.view(out_ids.ptr, (rows, k), np.int32)[...] = ids
        dev.emit(run)
        return out_logp, out_ids

    def argmax(logits, out, *, V=None, ld=None, ws=None, stream=None):
        rows = logits.shape[0]
        V, ld = V or logits.shape[-1], ld or logits.shape[-1]
        assert ld % 8 == 0
        dev.emit(lambda: dev.view(out.ptr, (rows,), np.int32).__setitem__(
            Ellipsis, _ref.argmax(dev.read(logits.ptr, rows, V, ld))))
        return out

    def sample(logits, temperature, positions, key, out, *, V=None, ld=None, stream=None):
        rows = logits.shape[0]
        V, ld = V or logits.shape[-1], ld or logits.shape[-1]

        def run():      # positions and the key are read at replay time, like the kernel does
            pos = dev.view(positions.ptr, (rows,), np.int32).copy()
            k = dev.view(key.ptr, (2,), np.uint32).copy()
            dev.view(out.ptr, (rows,), np.int32)[...] = _ref.sample(dev.read(logits.ptr, rows, V, ld), temperature,
                                                                    pos, k)
        dev.emit(run)
        return out

    def kv_compact(planes, src_slots, dst_start=None, *, meta=None, stream=None):
        if meta is None:
            host = np.asarray(src_slots, np.int64)
            meta = dk._scalar_on_device([int(dst_start), host.size], "meta", "kv_compact")
            src_slots = dk._scalar_on_device(host if host.size else [0], "src_slots", "kv_compact")

        def run():
            dst, m = (int(v) for v in dev.view(meta.ptr, (2,), np.int32))
            src = dev.view(src_slots.ptr, (max(m, 1),), np.int32).copy()
            rb = planes.row_bytes
            for p in dev.view(planes.pointers.ptr, (planes.count,), np.uint64):
                for i in range(m):
                    if src[i] != dst + i:
                        ctypes.memmove(int(p) + (dst + i) * rb, int(p) + int(src[i]) * rb, rb)
        dev.emit(run)

    # Each stand-in first runs the real entry point with launches that do nothing, so its argument checks
    # (shapes, dtypes, strides, host values during a capture) see exactly what the backend passes.
    class NoLaunch:
        """Launches nothing, but checks the arguments against the kernel's sm_90a PTX signature (count and widths,
        runtime.cuda.kernel.check_arguments), so a parameter added on one side only fails on the CPU too."""
        def __init__(self, family, entry):
            self.family, self.entry, self.function, self.pdl = family, entry, None, False
            self.param_sizes = ptx_param_sizes(family, entry, dev.device.arch)

        def __repr__(self):
            return f"{self.family}:{self.entry}"

        def launch(self, grid, block, args, smem=0, stream=None):
            from runtime.cuda.kernel import check_arguments
            check_arguments(self, list(args))

        def set_max_dynamic_smem(self, nbytes):
            pass

        def blocks_per_sm(self, block, smem):   # the decode attention plan asks the driver
            return 1

    def checked(real, fake):
        def run(*args, **kwargs):
            real(*args, **kwargs)
            return fake(*args, **kwargs)
        return run

    monkeypatch.setattr(dk, "get_kernel", lambda family, entry, arch=None: NoLaunch(family, entry))
    monkeypatch.setattr(dg, "get_kernel", lambda family, entry, arch=None: NoLaunch(family, entry))
    monkeypatch.setattr(dg, "device_cluster_slots", lambda cfg, smem: dg._cluster_slots(cfg[4], 1, 132))
    for name, fn in dict(linear=linear, embedding=embedding, rmsnorm=rmsnorm, rope=rope, rope_qkv_cache=rope_qkv_cache,
                         swiglu=swiglu, add=add,
                         attention=attention, log_softmax_topk=log_softmax_topk, argmax=argmax, sample=sample,
                         kv_compact=kv_compact).items():
        monkeypatch.setattr(dk, name, checked(getattr(dk, name), fn))

    class CopyRows:
        def launch(self, grid, block, args, smem=0, stream=None):
            dst, ldd, src, lds, rows, row_bytes, row0, off = args
            dst, ldd, src, lds, rows, row_bytes, row0 = (int(v) for v in (dst, ldd, src, lds, rows, row_bytes, row0))
            assert row_bytes % 16 == 0 and ldd % 16 == 0 and lds % 16 == 0 and dst % 16 == 0 and src % 16 == 0
            assert grid[1] == rows

            def run():
                first = row0 + (dev.scalar(off) if hasattr(off, "ptr") else 0)
                for r in range(rows):
                    ctypes.memmove(dst + (first + r) * ldd, src + r * lds, row_bytes)
            dev.emit(run)

    monkeypatch.setattr(cb, "get_kernel", lambda family, entry: CopyRows())

    @contextmanager
    def capture(stream=None):
        assert dev.capturing is None
        dev.capturing = []
        cap = SimpleNamespace(nodes=dev.capturing)
        try:
            yield cap
        finally:
            dev.capturing = None
        nodes = list(cap.nodes)

        def replay(stream=None):
            for fn in nodes:
                fn()
        cap.instantiate = lambda: SimpleNamespace(launch=replay, num_kernels=len(nodes))
    monkeypatch.setattr(ce, "capture", capture)
    return dev
