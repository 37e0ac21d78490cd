"""Streaming upload: the staging plan (CPU), and on a GPU every tensor of a tiny checkpoint back bit-exact."""
import io

import numpy as np
import pytest

from loader import open_checkpoint
from loader.testing import TINY_KIMI_CONFIG, write_tiny_model
from loader.upload import Progress, plan_staging, upload_arrays, upload_checkpoint


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_plan_covers_every_byte_once(chunk):
    rng = np.random.default_rng(chunk)
    sizes = [int(s) for s in rng.integers(0, 300, 40)] + [0, 5 * chunk + 3]
    fills = plan_staging(sizes, chunk)
    seen = [np.zeros(s, np.int32) for s in sizes]
    for fill in fills:
        used = np.zeros(chunk, np.int32)
        for p in fill:
            assert p.nbytes > 0
            seen[p.tensor][p.src_off:p.src_off + p.nbytes] += 1
            used[p.stage_off:p.stage_off + p.nbytes] += 1
        assert used.max() == 1                                   # no staging byte written twice per fill
    assert all((s == 1).all() for s in seen)
    assert all(sum(p.nbytes for p in f) == chunk for f in fills[:-1])   # fills are packed full
    assert plan_staging([], chunk) == [] and plan_staging([0, 0], chunk) == []


def test_progress_line():
    out = io.StringIO()
    bar = Progress(2_000_000_000, stream=out)
    bar.update(1_000_000_000)
    bar.finish()
    assert "GB/s" in out.getvalue() and "2.00 GB" in out.getvalue()


class _FakeCuda:
    """Stands in for runtime.cuda on the CPU: 'device' memory is host numpy, HtoD copies are memmoves. It runs
    upload_checkpoint's real staging/offset logic end to end."""

    class PinnedBuffer:
        def __init__(self, nbytes):
            self._a = np.full(nbytes, 0xAB, np.uint8)      # poisoned
            self.ptr = self._a.ctypes.data

        def array(self, dtype=np.uint8):
            return self._a.view(dtype)

    class Event:
        def __init__(self, timing=True):
            pass

        def record(self, stream=None):
            return self

        def synchronize(self):
            pass

    class Driver:
        copies = 0

        def cuMemcpyHtoDAsync(self, dst, src, n, s):
            import ctypes
            ctypes.memmove(dst, src, n)
            _FakeCuda.Driver.copies += 1
            return (0,)

        def cuStreamSynchronize(self, s):
            return (0,)


class _Dev:
    def __init__(self, shape, dtype):
        self.host = np.zeros(shape, dtype)
        self.host.reshape(-1).view(np.uint8)[:] = 0xCD        # poisoned
        self.ptr = self.host.ctypes.data
        self.nbytes = self.host.nbytes


class _HostArena:
    def __init__(self):
        self.buffers = {}

    def alloc(self, name, shape, dtype):
        assert name not in self.buffers
        self.buffers[name] = _Dev(shape, dtype)
        return self.buffers[name]


@pytest.fixture
def fake_cuda(monkeypatch):
    import sys
    import types
    cuda = types.ModuleType("runtime.cuda")
    cuda.PinnedBuffer, cuda.Event = _FakeCuda.PinnedBuffer, _FakeCuda.Event
    cuda.check = lambda result, op: result
    device = types.ModuleType("runtime.cuda.device")
    device.driver = lambda: _FakeCuda.Driver()
    stream = types.ModuleType("runtime.cuda.stream")
    stream.stream_handle = lambda s: 0
    monkeypatch.setitem(sys.modules, "runtime.cuda", cuda)
    monkeypatch.setitem(sys.modules, "runtime.cuda.device", device)
    monkeypatch.setitem(sys.modules, "runtime.cuda.stream", stream)
    _FakeCuda.Driver.copies = 0
    return _FakeCuda.Driver


@pytest.mark.parametrize("chunk", [100, 4096, 64 << 20])
def test_upload_logic_on_host_fake(tmp_path, fake_cuda, chunk):
    written = write_tiny_model(tmp_path, TINY_KIMI_CONFIG, seed=6)
    ck = open_checkpoint(tmp_path)
    arena = _HostArena()
    dev = upload_checkpoint(ck, None, arena, progress=False, chunk_bytes=chunk, threads=3, prefix="w.")
    assert sorted(arena.buffers) == sorted("w." + n for n in written)
    for name, (_, arr) in written.items():
        assert dev[name].host.dtype.itemsize == arr.dtype.itemsize
        assert np.array_equal(dev[name].host.view(arr.dtype), arr), name
    assert fake_cuda.copies >= len(written)
    with pytest.raises(Exception, match="not in checkpoint"):
        upload_checkpoint(ck, ["nope"], _HostArena(), progress=False)


@pytest.mark.gpu
def test_upload_tiny_checkpoint_bit_exact(tmp_path, cuda_device):
    from runtime.cuda import Arena

    written = write_tiny_model(tmp_path, TINY_KIMI_CONFIG, seed=5)
    ck = open_checkpoint(tmp_path)
    arena = Arena(ck.total_bytes() + 256 * len(ck) + (1 << 20), name="weights")
    for chunk in (1 << 10, 64 << 20):      # many fills with tensors split across them / one fill
        arena.reset()
        dev = upload_checkpoint(ck, None, arena, progress=False, chunk_bytes=chunk)
        for name, (_, arr) in written.items():
            d = dev[name].download()
            assert d.shape == arr.shape and np.array_equal(d.view(arr.dtype), arr), name
    arena.reset()
    arrays = {"a": np.arange(12345, dtype=np.float32), "b": np.arange(77, dtype=np.uint16).reshape(7, 11)}
    dev = upload_arrays(arrays, arena, progress=False, chunk_bytes=4096)
    for n, a in arrays.items():
        assert np.array_equal(dev[n].download(), a)
