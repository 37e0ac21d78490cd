"""Checkpoint load benchmark: a synthetic safetensors file (default 4 GB, a Kimi-like mix of tensor sizes)
read through the loader's mmap, and uploaded to the GPU with loader.upload (pinned double-buffered staging).

    python tools/bench_load.py                # host rows; device rows too when a GPU is visible
    python tools/bench_load.py --size-gb 1 --no-device

Rows (ratios in the same run): header parse; host mmap read cold (page cache dropped with
posix_fadvise DONTNEED) and warm; device: one pinned buffer memcpy HtoD (the ceiling), runtime.cuda
upload_chunked of one big array, loader.upload_checkpoint of the whole file. Target: >= 10 GB/s to device.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loader import open_checkpoint, save_safetensors  # noqa: E402

# (shape, dtype) groups of a Kimi K2.x layer, scaled: one attention-size bf16 matrix, INT4 experts, norms.
PATTERN = [((7168, 2048), "BF16"), ((2048, 896), "I32"), ((2048, 224), "BF16"), ((2,), "I64"),
           ((7168,), "BF16"), ((1536, 7168), "BF16"), ((512,), "BF16")]


def make_file(path: Path, size_gb: float) -> None:
    want = int(size_gb * 1e9)
    if path.exists() and abs(path.stat().st_size - want) < 0.05 * want:
        return
    rng = np.random.default_rng(0)
    block = rng.integers(0, 1 << 16, size=64 << 20, dtype=np.uint16)   # 128 MB of random bits, reused
    tensors, total, i = {}, 0, 0
    while total < want:
        shape, dt = PATTERN[i % len(PATTERN)]
        item = {"BF16": 2, "I32": 4, "I64": 8}[dt]
        n = int(np.prod(shape)) * item // 2
        start = (i * 7919) % (block.size - n)
        arr = block[start:start + n].view({"BF16": np.uint16, "I32": np.int32, "I64": np.int64}[dt]).reshape(shape)
        tensors[f"t{i:06d}"] = (dt, arr)
        total += arr.nbytes
        i += 1
    t = time.perf_counter()
    save_safetensors(path, tensors)
    print(f"wrote {path} ({total / 1e9:.2f} GB, {len(tensors)} tensors) in {time.perf_counter() - t:.1f} s")


def drop_page_cache(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def host_read(ck, names, buf) -> float:
    """Seconds to copy every tensor out of the mmap into a reused buffer (what staging does)."""
    t = time.perf_counter()
    for n in names:
        src = ck.tensor(n).reshape(-1).view(np.uint8)
        for o in range(0, src.size, buf.size):
            m = min(buf.size, src.size - o)
            np.copyto(buf[:m], src[o:o + m])
    return time.perf_counter() - t


def host_read_threads(ck, names, buf, threads: int) -> float:
    """The same with each chunk's copy split over threads, as loader.upload fills its staging buffers."""
    from concurrent.futures import ThreadPoolExecutor
    from loader.upload import COPY_SLICE

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for n in names:
            src = ck.tensor(n).reshape(-1).view(np.uint8)
            for o in range(0, src.size, buf.size):
                m = min(buf.size, src.size - o)
                jobs = [(buf[a:min(a + COPY_SLICE, m)], src[o + a:o + min(a + COPY_SLICE, m)])
                        for a in range(0, m, COPY_SLICE)]
                list(pool.map(lambda j: np.copyto(j[0], j[1]), jobs))
    return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--path", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "ddtree_bench_load.safetensors")
    ap.add_argument("--no-device", action="store_true")
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic file")
    args = ap.parse_args(argv)

    make_file(args.path, args.size_gb)
    rows = []
    t = time.perf_counter()
    ck = open_checkpoint(args.path)
    names = ck.names()
    total = ck.total_bytes()
    rows.append(("header parse + mmap setup", time.perf_counter() - t, None, None))
    buf = np.empty(args.chunk_mb << 20, np.uint8)
    cold = drop_page_cache(args.path)
    rows.append(("host mmap read, cold" if cold else "host mmap read (cache not dropped)",
                 host_read(ck, names, buf), total, "host"))
    rows.append(("host mmap read, warm", host_read(ck, names, buf), total, "host"))
    drop_page_cache(args.path)
    ck_seq = open_checkpoint(args.path)
    ck_seq.advise_sequential()
    rows.append(("host mmap read, cold, MADV_SEQUENTIAL", host_read(ck_seq, names, buf), total, "host"))
    nt = args.threads or min(8, os.cpu_count() or 1)
    rows.append((f"host mmap read, warm, {nt} threads", host_read_threads(ck, names, buf, nt), total, "host"))

    if not args.no_device:
        try:
            from runtime.cuda import Arena, PinnedBuffer, empty, require_device, upload_chunked
            dev = require_device()
        except Exception as e:   # NoDeviceError or no cuda bindings: host rows only
            print(f"device rows skipped: {e}")
            dev = None
        if dev is not None:
            from runtime.cuda import check
            from runtime.cuda.device import driver
            from loader.upload import upload_checkpoint

            pin = PinnedBuffer(1 << 30)
            pin.array(np.uint8)[:] = 1
            d = empty((1 << 30,), np.uint8)
            check(driver().cuMemcpyHtoD(d.ptr, pin.ptr, 1 << 30), "cuMemcpyHtoD")
            t = time.perf_counter()
            for _ in range(4):
                check(driver().cuMemcpyHtoD(d.ptr, pin.ptr, 1 << 30), "cuMemcpyHtoD")
            rows.append(("pinned HtoD memcpy (ceiling)", time.perf_counter() - t, 4 << 30, "device"))
            del d, pin
            one = max(names, key=ck.nbytes)
            big = ck.tensor(one)
            dbig = empty(big.shape, big.dtype)
            upload_chunked(dbig, big, chunk_bytes=args.chunk_mb << 20)
            t = time.perf_counter()
            for _ in range(8):
                upload_chunked(dbig, big, chunk_bytes=args.chunk_mb << 20)
            rows.append((f"upload_chunked one {big.nbytes / 1e6:.0f} MB tensor (warm)", time.perf_counter() - t,
                         8 * big.nbytes, "device"))
            del dbig
            arena = Arena(total + 256 * len(names) + (1 << 20), name="bench")
            drop_page_cache(args.path)
            t = time.perf_counter()
            upload_checkpoint(ck, names, arena, progress=True, chunk_bytes=args.chunk_mb << 20, threads=args.threads)
            rows.append(("upload_checkpoint, cold page cache", time.perf_counter() - t, total, "device"))
            arena.reset()
            t = time.perf_counter()
            out = upload_checkpoint(ck, names, arena, progress=True, chunk_bytes=args.chunk_mb << 20,
                                    threads=args.threads)
            rows.append(("upload_checkpoint, warm page cache", time.perf_counter() - t, total, "device"))
            probe = names[len(names) // 2]
            assert np.array_equal(out[probe].download(), ck.tensor(probe)), "upload corrupted data"

    print(f"\n{args.path}: {total / 1e9:.2f} GB in {len(names)} tensors")
    # ratio: host rows against the warm host read, device rows against the pinned-memcpy ceiling
    refs = {"host": total / rows[2][1] / 1e9}
    refs.update({r[3]: r[2] / r[1] / 1e9 for r in rows if r[0].startswith("pinned HtoD")})
    print(f"{'what':52s} {'seconds':>9s} {'GB/s':>8s} {'ratio':>7s}")
    for what, sec, nbytes, section in rows:
        rate = nbytes / sec / 1e9 if nbytes else None
        ratio = f"{rate / refs[section]:7.2f}" if rate else ""
        print(f"{what:52s} {sec:9.3f} {(f'{rate:8.2f}' if rate else ''):>8s} {ratio}")
    print("ratio: host rows / warm host read; device rows / pinned HtoD memcpy. Target >= 10 GB/s to device.")
    if not args.keep:
        ck.close()
        args.path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
