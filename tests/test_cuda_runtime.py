"""runtime.cuda: CPU-side logic always; device memory, copies, a CuTe kernel and graphs on a GPU."""
import numpy as np
import pytest

import runtime.cuda as rc
from runtime.bf16 import from_bf16, to_bf16
from runtime.cuda import memory as rcmem
from runtime.cuda.kernel import Launch, _slot_value
from runtime.testing import assert_close


# ---------------------------------------------------------------- CPU: no GPU needed
def test_no_device_raises_a_clear_error():
    try:
        rc.require_device()
    except rc.NoDeviceError as e:
        assert e.op and "cu" in e.op and str(e)  # names the failed call
        with pytest.raises(rc.NoDeviceError):
            rc.empty((4,), np.float32)  # every entry point fails the same clear way
    else:
        pytest.skip("a GPU is present: the no-device path is not reachable here")


def test_check_turns_results_into_exceptions():
    from cuda.bindings import driver
    assert rc.check((driver.CUresult.CUDA_SUCCESS, 7), "cuFake") == 7
    assert rc.check((driver.CUresult.CUDA_SUCCESS,), "cuFake") is None
    with pytest.raises(rc.OutOfMemoryError) as e:
        rc.check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    assert e.value.op == "cuMemAlloc" and e.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(rc.CudaError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        rc.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuLaunchKernel")


def test_stream_priority_in_the_context_range(monkeypatch):
    """Stream(priority=...): the context's range (the fake device's is 0 lowest .. -5 highest), a clear error
    outside it."""
    from fake_cuda import install
    install(monkeypatch)
    assert rc.priority_range() == (0, -5)
    for ok in (0, -1, -5):
        rc.Stream(priority=ok)
    for bad in (1, -6):
        with pytest.raises(ValueError, match=r"want -5 \(highest\) .. 0"):
            rc.Stream(priority=bad)


def test_argument_packing():
    arr = rc.DeviceArray(0x7F0000001000, (4, 4), np.uint16)
    assert _slot_value(arr, 0)[0] == 0x7F0000001000
    assert _slot_value(np.int32(-2), 0).view(np.int32)[0] == -2
    assert _slot_value(np.float32(1.5), 0).view(np.float32)[0] == 1.5
    assert _slot_value(np.int64(-(2**40)), 0).view(np.int64)[0] == -(2**40)
    with pytest.raises(TypeError, match="np.int32"):
        _slot_value(3, 1)
    with pytest.raises(TypeError, match="numpy"):
        _slot_value(2.0, 1)

    class FakeKernel:
        function = None
    launch = Launch(FakeKernel(), (3, 2), 128, [arr, np.int32(5), np.float32(0.25)])
    assert launch.grid == (3, 2, 1) and launch.block == (128, 1, 1)
    # the address array points at the value slots, packed once; set_arg mutates in place
    slots = launch.values.ctypes.data
    assert list(launch.addresses) == [slots, slots + 8, slots + 16]
    launch.set_arg(1, np.int32(9))
    assert launch.values[1:2].view(np.int32)[0] == 9 and launch.addresses[0] == slots
    # read the arguments back the way the driver does: through the void** at launch.params
    import ctypes
    pointers = (ctypes.c_uint64 * 3).from_address(launch.params)
    assert list(pointers) == [slots, slots + 8, slots + 16]
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0x7F0000001000
    assert ctypes.c_int32.from_address(pointers[1]).value == 9
    assert ctypes.c_float.from_address(pointers[2]).value == 0.25
    assert Launch(FakeKernel(), 1, 1, []).params == 0  # no arguments: kernelParams NULL
    with pytest.raises(ValueError):
        Launch(FakeKernel(), 0, 128, [])


@pytest.fixture
def fake_arena(monkeypatch):
    """An Arena whose cuMemAlloc is faked: the sub-allocation logic needs no GPU."""
    monkeypatch.setattr(rcmem, "_mem_alloc", lambda n, what: 0x100000)
    monkeypatch.setattr(rcmem, "_mem_free", lambda p: None)
    return rcmem.Arena(1 << 20, name="test")


def test_arena_first_fit_alignment_and_oom(fake_arena):
    a = fake_arena.alloc("a", (100,), np.uint8)
    b = fake_arena.alloc("b", (1000,), np.float32, align=1024)
    assert a.ptr % 256 == 0 and b.ptr % 1024 == 0 and b.ptr >= a.ptr + a.nbytes
    c = fake_arena.alloc("c", (10,), np.uint16)
    fake_arena.free("a")
    d = fake_arena.alloc("d", (64,), np.uint8)  # reuses the hole a left
    assert d.ptr == a.ptr
    assert "arena 'test'" in fake_arena.report() and "b" in fake_arena.report()
    with pytest.raises(ValueError, match="already allocated"):
        fake_arena.alloc("b", (1,), np.uint8)
    with pytest.raises(rc.OutOfMemoryError) as e:
        fake_arena.alloc("huge", (2 << 20,), np.uint8)
    msg = str(e.value)
    assert "huge" in msg and "2.00 MiB" in msg and "capacity 1.00 MiB" in msg
    spans = sorted((x.ptr, x.ptr + x.nbytes) for x in (b, c, d))
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))  # no overlap
    fake_arena.reset()
    assert fake_arena.used == 0
    v = b.view(10, (5,))
    assert v.ptr == b.ptr + 40 and v.shape == (5,)
    with pytest.raises(ValueError, match="overruns"):
        b.view(999, (5,))
    with pytest.raises(ValueError, match="non-negative"):
        fake_arena.alloc("neg", (4, -1), np.float32)
    fake_arena.close()
    with pytest.raises(ValueError, match="closed"):  # its memory is gone: no dangling buffers
        fake_arena.alloc("late", (4,), np.uint8)


def test_arena_random_alloc_free_keeps_buffers_disjoint(fake_arena):
    """Random allocations (sizes, alignments, zero-size) and frees: every live buffer aligned, inside the arena,
    disjoint from the others; freed space is reused; `used` is exact."""
    rng = np.random.default_rng(7)
    live = {}
    for step in range(3000):
        if live and rng.random() < 0.4:
            name = list(live)[int(rng.integers(len(live)))]
            fake_arena.free(name)
            del live[name]
            continue
        n, align = int(rng.integers(0, 5000)), 1 << int(rng.integers(0, 12))
        try:
            live[f"b{step}"] = (fake_arena.alloc(f"b{step}", (n,), np.uint8, align=align), align)
        except rc.OutOfMemoryError:
            assert fake_arena.used + n > fake_arena.capacity // 4, "out of memory with most of the arena free"
    spans = sorted((a.ptr, a.ptr + a.nbytes) for a, _ in live.values())
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    base = 0x100000
    assert all(a.ptr % al == 0 and base <= a.ptr and a.ptr + a.nbytes <= base + fake_arena.capacity
               for a, al in live.values())
    assert fake_arena.used == sum(a.nbytes for a, _ in live.values())
    for name in list(live):
        fake_arena.free(name)
    assert fake_arena.used == 0 and fake_arena.alloc("all", (fake_arena.capacity,), np.uint8).ptr == base


def test_pinned_view_keeps_its_buffer_alive(monkeypatch):
    """A numpy view of pinned memory outliving the PinnedBuffer object must not read freed memory."""
    import ctypes
    import gc

    freed, keep = [], []

    class Driver:
        def cuMemHostAlloc(self, n, flags):
            keep.append(ctypes.create_string_buffer(n))   # host stand-in for page-locked memory
            return (0, ctypes.addressof(keep[-1]))

        def cuMemFreeHost(self, ptr):
            freed.append(ptr)
            return (0,)

    monkeypatch.setattr(rcmem, "driver", lambda: Driver())
    monkeypatch.setattr(rcmem, "get_device", lambda: None)
    view = rcmem.PinnedBuffer(64).array(np.float32, (4, 4))
    gc.collect()
    assert not freed
    view[:] = 1.0
    del view
    gc.collect()
    assert len(freed) == 1


def test_max_dynamic_smem_opt_in_once_per_value(monkeypatch):
    """Kernel.set_max_dynamic_smem calls the driver only for a value above the largest it has set (the launch paths
    call it before every launch)."""
    from types import SimpleNamespace
    import runtime.cuda.kernel as rck
    calls = []

    class Driver:
        CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8)

        def cuFuncSetAttribute(self, fn, attr, value):
            calls.append(value)
            return (0,)

    monkeypatch.setattr(rck, "driver", lambda: Driver())
    k = rck.Kernel("fam", "entry", None, "90a")
    for n in (100_000, 100_000, 60_000, 150_000, 120_000, 150_000):
        k.set_max_dynamic_smem(n)
    assert calls == [100_000, 150_000] and k.max_dynamic_smem == 150_000


def test_empty_rejects_negative_sizes():
    with pytest.raises(ValueError, match="non-negative"):  # checked before any driver call
        rc.empty((3, -2), np.float32)


def test_bucket_for():
    assert rc.bucket_for(1, [16, 64, 1024]) == 16
    assert rc.bucket_for(64, [16, 64, 1024]) == 64
    assert rc.bucket_for(65, [16, 64, 1024]) == 1024
    with pytest.raises(ValueError):
        rc.bucket_for(2000, [16, 64, 1024])


# ---------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


@gpu
def test_device_properties(cuda_device):
    d = cuda_device
    assert d.sm_count > 0 and d.l2_bytes > 0 and d.smem_optin_bytes >= 48 * 1024
    assert d.total_mem_bytes > 1 << 30 and d.cc[0] >= 9
    assert d.arch in rc.ARCHS, str(d)
    free, total = d.mem_info()
    assert 0 < free <= total


@gpu
def test_arena_on_device(cuda_device):
    arena = rc.Arena(8 << 20, name="t")
    x = arena.alloc("x", (1000,), np.float32)
    y = arena.alloc("y", (333,), np.int32, align=4096)
    assert y.ptr % 4096 == 0 and x.ptr % 256 == 0
    hx = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x.upload(hx)
    np.testing.assert_array_equal(x.download(), hx)
    with pytest.raises(rc.OutOfMemoryError, match="asked 16.00 MiB"):
        arena.alloc("big", (16 << 20,), np.uint8)
    arena.free("x")
    z = arena.alloc("z", (1000,), np.float32)
    assert z.ptr == x.ptr
    arena.close()
    with pytest.raises(rc.OutOfMemoryError, match="asked 1024.00 GiB"):
        rc.empty((1 << 40,), np.uint8)  # more than any GPU: the driver's OOM, explained


@gpu
def test_copy_round_trips(cuda_device, tmp_path):
    rng = np.random.default_rng(1)
    for dtype, shape in ((np.float32, (37, 11)), (np.uint16, (989,)), (np.int64, (3, 5, 7)), (np.uint8, (1,))):
        h = (rng.standard_normal(shape) * 1000).astype(dtype) if dtype == np.float32 else \
            rng.integers(0, np.iinfo(dtype).max, shape, dtype=dtype)
        d = rc.to_device(h)
        np.testing.assert_array_equal(d.download(), h)
        e = rc.empty(shape, dtype).fill_bytes(0xAB)
        assert (e.download().view(np.uint8) == 0xAB).all()
        e.copy_from(d)
        np.testing.assert_array_equal(e.download(), h)
    d = rc.to_device(np.arange(100, dtype=np.int32))
    np.testing.assert_array_equal(d.view(10, (5,)).download(), np.arange(10, 15))
    s = rc.Stream()
    h = rng.standard_normal(12345).astype(np.float32)
    d = rc.empty(h.shape, h.dtype).upload(h, stream=s)
    np.testing.assert_array_equal(d.download(stream=s), h)
    with pytest.raises(ValueError, match="shape"):
        d.upload(np.zeros(5, np.float32))
    pin = rc.PinnedBuffer(4096)
    pin.array(np.float32)[:] = 3.0
    assert pin.array(np.float32, (32, 32)).shape == (32, 32)
    # chunked upload from a memmap, odd size, chunks smaller than the data
    data = rng.integers(0, 255, (1 << 20) + 37, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    seen = []
    dst = rc.upload_chunked(rc.empty(mm.shape, np.uint8), mm, chunk_bytes=100_000,
                            progress=lambda done, total: seen.append((done, total)))
    np.testing.assert_array_equal(dst.download(), data)
    assert seen[-1] == (data.size, data.size) and len(seen) == -(-data.size // 100_000)


def int4_reference(packed: np.ndarray, scales_bf16: np.ndarray) -> np.ndarray:
    """numpy dequant of compressed-tensors pack-quantized int4: (nibble - 8) * scale, rounded to bf16."""
    n, kp = packed.shape
    shifts = (4 * np.arange(8, dtype=np.uint32))
    nib = (packed.view(np.uint32)[:, :, None] >> shifts) & 0xF  # element 8p+i at bits 4i
    q = nib.reshape(n, kp * 8).astype(np.float32) - 8.0
    s = np.repeat(from_bf16(scales_bf16), 32, axis=1)
    return to_bf16(q * s)


INT4_KERNELS = {  # entry -> (threads, units of work): words of 8 values, or groups of 32
    "int4_to_bf16_kernel<128>": (128, 8), "int4_to_bf16_kernel<256>": (256, 8),
    "int4_to_bf16_group_kernel<128>": (128, 32)}


def int4_to_bf16(packed: rc.DeviceArray, scales: rc.DeviceArray, out: rc.DeviceArray, entry: str, stream=None):
    threads, per = INT4_KERNELS[entry]
    assert packed.nbytes * 2 == out.size and scales.size * 32 == out.size
    units = out.size // per
    grid = min(-(-units // threads), rc.get_device().sm_count * 8)
    rc.get_kernel("int4_convert", entry).launch(grid, threads, [packed, scales, out, np.int64(units)],
                                                stream=stream)


@gpu
@pytest.mark.parametrize("entry", list(INT4_KERNELS))
@pytest.mark.parametrize("n,k", [(1, 32), (37, 2048), (989, 96), (256, 7168)])
def test_int4_to_bf16_matches_numpy(cuda_device, n, k, entry):
    rng = np.random.default_rng(n * 7 + k)
    packed = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint64).astype(np.uint32).view(np.int32)
    scales = to_bf16(rng.uniform(0.001, 0.05, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32)))
    ref = int4_reference(packed, scales)
    out = rc.empty((n, k), np.uint16).fill_bytes(0xFF)  # poison: 0xFFFF is a bf16 NaN
    int4_to_bf16(rc.to_device(packed), rc.to_device(scales), out, entry)
    got = out.download()
    assert not np.isnan(from_bf16(got)).any()
    mismatch = np.argwhere(got != ref)  # bit-exact, signed zeros included
    assert mismatch.size == 0, (f"{len(mismatch)} mismatches, first at {mismatch[:5].tolist()}: "
                                f"got {from_bf16(got[tuple(mismatch[0])])} want {from_bf16(ref[tuple(mismatch[0])])}")


@pytest.fixture(params=["ctypes", "bindings"])
def launch_path(request, monkeypatch):
    """Run a test through each launch path (ctypes into libcuda, and cuda.bindings)."""
    from runtime.cuda import kernel as kmod
    if request.param == "ctypes":
        monkeypatch.setenv("DDTREE_LAUNCH", "ctypes")
        monkeypatch.setattr(kmod, "_ctypes_launch", None)
        assert kmod._launcher(), "libcuda.so.1 could not be bound through ctypes"
    else:
        monkeypatch.setattr(kmod, "_ctypes_launch", False)
    return request.param


@gpu
def test_launch_prepared_and_kernel_errors(cuda_device, launch_path):
    k = rc.get_kernel("runtime_probe", "add_scalar_kernel")
    x0 = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    x = rc.to_device(x0)
    launch = k.prepare((4,), 256, [x, np.float32(2.0), np.float32(1.0), np.int32(1000)])
    launch()
    launch.set_arg(2, np.float32(-3.0))
    launch()
    assert_close(x.download(), (x0 * 2 + 1) * 2 - 3, "prepared launch, then set_arg", rtol=1e-6)
    with pytest.raises(KeyError, match="no entry"):
        rc.get_kernel("runtime_probe", "missing_kernel")
    assert k.attribute("NUM_REGS") > 0
    ms = rc.bench(lambda: launch(), warmup=2, iters=5)
    assert ms > 0
    bad = k.prepare((1,), 2048, [x, np.float32(1.0), np.float32(0.0), np.int32(1)])  # > 1024 threads
    with pytest.raises(rc.CudaError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        bad()


@gpu
def test_graph_capture_replay_and_update(cuda_device, launch_path):
    k = rc.get_kernel("runtime_probe", "add_scalar_kernel")
    s = rc.Stream()
    n = 777
    rng = np.random.default_rng(3)
    a0, b0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    a, b = rc.to_device(a0), rc.to_device(b0)
    with rc.capture(s) as g:
        k.launch(4, 256, [a, np.float32(2.0), np.float32(0.0), np.int32(n)], stream=s)
        k.launch(4, 256, [a, np.float32(1.0), np.float32(5.0), np.int32(n)], stream=s)
    np.testing.assert_array_equal(a.download(), a0)  # capturing ran nothing
    ge = g.instantiate()
    assert ge.num_kernels == 2
    ge.launch(s)
    s.synchronize()
    assert_close(a.download(), a0 * 2 + 5, "graph replay", rtol=1e-6)
    # re-point the first kernel at buffer b and change the second one's scalar: no re-capture
    ge.update_kernel_args(0, {0: b})
    ge.update_kernel_args(1, {2: np.float32(-1.0)})
    ge.launch(s)
    s.synchronize()
    assert_close(b.download(), b0 * 2, "updated kernel 0", rtol=1e-6)  # kernel 0 now works on b
    assert_close(a.download(), a0 * 2 + 5 - 1, "updated kernel 1", rtol=1e-6)  # kernel 1 still on a, new b


_FIRST_USE_IN_CAPTURE = r"""
import numpy as np
import runtime.cuda as rc
s = rc.Stream()
n = 777
a0 = np.arange(n, dtype=np.float32)
a = rc.to_device(a0)
with rc.capture(s) as g:   # the family's module, the function and its smem opt-in all load inside the capture
    k = rc.get_kernel("runtime_probe", "add_scalar_kernel")
    k.set_max_dynamic_smem(64 * 1024)
    k.launch(4, 256, [a, np.float32(2.0), np.float32(1.0), np.int32(n)], stream=s)
ge = g.instantiate()
ge.launch(s)
s.synchronize()
assert (a.download() == a0 * 2 + 1).all()
print("ok")
"""


@gpu
def test_kernel_first_used_inside_a_capture(cuda_device):
    """A kernel whose module is first loaded inside a stream capture (a graph captured before any eager run):
    the loads run in relaxed capture mode, so the capture stays valid. A fresh process: here the family is loaded."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", _FIRST_USE_IN_CAPTURE], cwd=Path(__file__).resolve().parents[1],
                         env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@gpu
def test_memory_freed_inside_a_capture(cuda_device):
    """An allocation whose last reference goes away inside a capture (as a garbage collection does to an earlier
    test's or step's buffers): its cuMemFree waits for the capture's end, which stays valid."""
    k = rc.get_kernel("runtime_probe", "add_scalar_kernel")
    s = rc.Stream()
    n = 777
    a0 = np.arange(n, dtype=np.float32)
    a, junk = rc.to_device(a0), rc.empty((1 << 20,), np.float32)
    with rc.capture(s) as g:
        del junk   # its finalizer runs here
        k.launch(4, 256, [a, np.float32(2.0), np.float32(1.0), np.int32(n)], stream=s)
    ge = g.instantiate()
    ge.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(a.download(), a0 * 2 + 1)


@gpu
def test_sm_partition_streams_run_kernels_eager_and_in_a_graph(cuda_device):
    """SmPartition: two green contexts' streams; a kernel of the primary context runs on each, on its own and as
    the branches of a captured fork / join, and each side reports the SMs it holds."""
    from runtime.cuda.green import SmPartition
    total = cuda_device.sm_count
    with pytest.raises(ValueError, match="want 1 .."):
        SmPartition(total)
    part = SmPartition(total // 2, priorities=(rc.priority_range()[1], 0))   # the first side's stream at the top
    assert part.sizes[0] >= total // 2 and part.sizes[0] + part.sizes[1] <= total and part.sizes[1] > 0
    k = rc.get_kernel("runtime_probe", "add_scalar_kernel")
    n = 100_003
    rng = np.random.default_rng(5)
    a0, b0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    a, b = rc.to_device(a0), rc.to_device(b0)
    hot, cold = part.streams
    k.launch((n + 255) // 256, 256, [a, np.float32(3.0), np.float32(1.0), np.int32(n)], stream=hot)
    k.launch((n + 255) // 256, 256, [b, np.float32(-2.0), np.float32(0.5), np.int32(n)], stream=cold)
    hot.synchronize()
    cold.synchronize()

    def fma(v, mul, add):   # the kernel's x * mul + add, rounded once (float64 holds the product and sum exactly)
        return (v.astype(np.float64) * mul + add).astype(np.float32)

    np.testing.assert_array_equal(a.download(), fma(a0, 3, 1), "green stream 0")
    np.testing.assert_array_equal(b.download(), fma(b0, -2, 0.5), "green stream 1")
    s, fork, join0, join1 = rc.Stream(), rc.Event(timing=False), rc.Event(timing=False), rc.Event(timing=False)
    a.upload(a0)
    b.upload(b0)
    with rc.capture(s) as g:
        k.launch((n + 255) // 256, 256, [a, np.float32(2.0), np.float32(0.0), np.int32(n)], stream=s)
        fork.record(s)
        hot.wait(fork)
        cold.wait(fork)
        k.launch((n + 255) // 256, 256, [a, np.float32(1.0), np.float32(5.0), np.int32(n)], stream=hot)
        k.launch((n + 255) // 256, 256, [b, np.float32(0.5), np.float32(0.0), np.int32(n)], stream=cold)
        join0.record(hot)
        join1.record(cold)
        s.wait(join0)
        s.wait(join1)
        k.launch((n + 255) // 256, 256, [a, np.float32(-1.0), np.float32(0.0), np.int32(n)], stream=s)
    ge = g.instantiate()
    assert ge.num_kernels == 4
    for _ in range(3):   # replays: each starts from the previous one's result
        ge.launch(s)
    s.synchronize()
    want_a, want_b = a0.copy(), b0.copy()
    for _ in range(3):
        want_a, want_b = -fma(fma(want_a, 2, 0), 1, 5), fma(want_b, 0.5, 0)
    np.testing.assert_array_equal(a.download(), want_a, "graph over the partition, a")
    np.testing.assert_array_equal(b.download(), want_b, "graph over the partition, b")


@gpu
def test_bucket_graph_replayed_1000_times(cuda_device):
    k = rc.get_kernel("runtime_probe", "add_scalar_kernel")
    s = rc.Stream()
    arena = rc.Arena(1 << 20, name="graph-test")
    buf = arena.alloc("x", (1024,), np.float32)
    x0 = np.random.default_rng(4).integers(-100, 100, 1024).astype(np.float32)
    buf.upload(x0)
    cache = rc.GraphCache(s)
    steps = 8

    def record(budget, stream):  # one bucket = fixed shapes; each step adds 1 to the first `budget` slots
        for _ in range(steps):
            k.launch(-(-budget // 128), 128, [buf, np.float32(1.0), np.float32(1.0), np.int32(budget)],
                     stream=stream)

    bucket = rc.bucket_for(50, [16, 64, 256])
    g = cache.get(bucket, record)
    assert cache.get(bucket, record) is g and len(cache) == 1
    for _ in range(1000):
        g.launch(s)
    s.synchronize()
    want = x0.copy()
    want[:64] += 1000 * steps
    np.testing.assert_array_equal(buf.download(), want)


def test_frees_during_a_capture_wait_for_its_end(monkeypatch):
    """A cuMemFree / cuMemFreeHost / graph destroy made while a stream captures (a garbage collection runs any
    finalizer there) would invalidate the capture: graph.release holds them until the last capture has ended."""
    import runtime.cuda.graph as graph
    import runtime.cuda.memory as memory
    done = []

    class Drv:
        def cuMemFree(self, p):
            done.append(("free", p))
            return (0,)

        def cuMemFreeHost(self, p):
            done.append(("free host", p))
            return (0,)

    monkeypatch.setattr(memory, "driver", lambda: Drv())
    monkeypatch.setattr(graph, "_deferred", [])
    monkeypatch.setattr(graph, "_active", {7: object()})   # a capture in progress
    memory._mem_free(0x1000)
    memory.PinnedBuffer._release(0x2000)
    assert done == [] and len(graph._deferred) == 2
    graph._active.clear()
    graph._release_deferred()
    assert sorted(done) == [("free", 0x1000), ("free host", 0x2000)] and graph._deferred == []
    memory._mem_free(0x3000)                                  # no capture: at once
    assert done[-1] == ("free", 0x3000)


def test_plain_launches_drop_programmatic_serialization():
    """Inside plain_launches a PDL family's launch is bound without the programmatic attribute (a full edge in a
    capture); before and after it, with it. No GPU: the launch is only bound, not made."""
    import types
    kern = types.SimpleNamespace(function=None, pdl=True, param_sizes=None, checked_types=set(), family="f",
                                 entry="e")
    assert Launch(kern, 1, 32, [])._config is not None
    with rc.plain_launches():
        with rc.plain_launches():
            assert Launch(kern, 1, 32, [])._config is None
        assert Launch(kern, 1, 32, [])._config is None
    assert Launch(kern, 1, 32, [])._config is not None
