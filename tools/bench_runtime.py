"""Benchmark of the CUDA runtime layer (run on the GPU machine): read bandwidth of a streaming kernel vs
the driver's copy, our launch overhead, graph replay cost per node, NVRTC cold/warm builds, the warm load
of every kernel, and the int4->bf16 dequant against the bandwidth floor. Prints one table; ratios are
against numbers measured in the same run. Targets (issue 2): launch <= 5 us, graph replay <= 0.6 us/node,
warm load of all kernels <= 1 s."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import runtime.cuda as rc
from runtime.bf16 import to_bf16
from runtime.cuda import nvrtc
from tools.read_bandwidth import read_time_us

ROWS: list[tuple[str, str, str]] = []


def row(name: str, value: str, note: str = ""):
    ROWS.append((name, value, note))
    print(f"  {name:<44} {value:>16}  {note}", flush=True)


def bandwidth(gib: float):
    n_bytes = int(gib * 2**30) // 16 * 16
    src = rc.empty((n_bytes,), np.uint8).fill_bytes(0x5A)
    dst = rc.empty((n_bytes,), np.uint8)
    configs = [(b, t) for b in (2, 4, 8, 16) for t in (256, 512, 1024)]
    us, cfg = read_time_us([src], configs)
    read_gbs = n_bytes / us / 1e3
    row("read bandwidth, streaming kernel", f"{read_gbs:,.0f} GB/s",
        f"{gib:g} GiB, {cfg[0]} blocks/SM x {cfg[1]} threads (best of {len(configs)} configs)")
    drv = rc.device.driver()
    s = rc.default_stream()
    ms = rc.bench(lambda: rc.check(drv.cuMemcpyDtoDAsync(dst.ptr, src.ptr, n_bytes, s.handle), "cuMemcpyDtoDAsync"),
                  warmup=3, iters=20)
    copy_gbs = 2 * n_bytes / ms / 1e6
    row("cuMemcpyDtoD (read + write bytes)", f"{copy_gbs:,.0f} GB/s", f"read kernel / copy = {read_gbs / copy_gbs:.2f}")
    return read_gbs, copy_gbs


def launch_overhead():
    from runtime.cuda import kernel as kmod
    os.environ["DDTREE_LAUNCH"], kmod._ctypes_launch = "ctypes", None  # bind ctypes too, to compare
    k = rc.get_kernel("runtime_probe", "noop_kernel")
    buf = rc.empty((16,), np.uint8)
    s = rc.Stream()
    n = 20000

    def timed(fn):
        for _ in range(200):
            fn()
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        s.synchronize()
        return (t1 - t0) / n * 1e6

    ct = kmod._launcher()
    for path in ("ctypes", "bindings"):
        kmod._ctypes_launch = ct if path == "ctypes" else False
        if path == "ctypes" and not ct:
            row("launch overhead via ctypes", "n/a", "libcuda.so.1 not loadable by name")
            continue
        launch = k.prepare(1, 32, [buf, np.int32(0)])
        row(f"launch overhead, Launch() via {path}", f"{timed(lambda: launch(s)):.2f} us",
            f"host time, {n} noop launches; target <= 5")
        row(f"launch overhead, Kernel.launch via {path}",
            f"{timed(lambda: k.launch(1, 32, [buf, np.int32(0)], stream=s)):.2f} us", "packs arguments per call")
    os.environ.pop("DDTREE_LAUNCH")
    kmod._ctypes_launch = None  # back to the default path
    drv = rc.device.driver()
    keep = k.prepare(1, 32, [buf, np.int32(0)])  # owns the argument arrays that `params` points into
    params = keep.params
    f, h = k.function, s.handle
    row("  floor: bare cuda.bindings cuLaunchKernel", f"{timed(lambda: drv.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, h, params, 0)):.2f} us",
        "no checks, same arguments")
    if ct:
        fp, sp = int(f), s.ptr
        row("  floor: bare ctypes cuLaunchKernel", f"{timed(lambda: ct(fp, 1, 1, 1, 32, 1, 1, 0, sp, params, None)):.2f} us",
            "no checks, same arguments")
        t0 = time.perf_counter()
        for _ in range(n):
            pass
        row("  floor: empty Python loop", f"{(time.perf_counter() - t0) / n * 1e6:.3f} us", "")


def graph_replay():
    k = rc.get_kernel("runtime_probe", "noop_kernel")
    buf = rc.empty((16,), np.uint8)
    s = rc.Stream()
    nodes = 256
    launch = k.prepare(1, 32, [buf, np.int32(0)])
    with rc.capture(s) as g:
        for _ in range(nodes):
            launch(s)
    ge = g.instantiate()
    ms_graph = rc.bench(lambda: ge.launch(s), warmup=5, iters=50, stream=s)

    def stream_all():
        for _ in range(nodes):
            launch(s)
    ms_stream = rc.bench(stream_all, warmup=2, iters=10, stream=s)
    row("graph replay per node (GPU time)", f"{ms_graph * 1e3 / nodes:.3f} us",
        f"{nodes} noop nodes; target <= 0.6; stream launches: {ms_stream * 1e3 / nodes:.2f} us/kernel")
    s.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        ge.launch(s)
    t1 = time.perf_counter()
    s.synchronize()
    row("cuGraphLaunch host cost", f"{(t1 - t0) / 50 * 1e6:.2f} us", "per graph launch (50 launches, queue not full)")
    t0 = time.perf_counter()
    for i in range(1000):
        ge.update_kernel_args(i % nodes, {1: np.int32(i)})
    row("graph kernel-node argument update", f"{(time.perf_counter() - t0) * 1e3:.2f} us", "per update")


def nvrtc_builds(arch: str):
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("DDTREE_KERNEL_CACHE")
        os.environ["DDTREE_KERNEL_CACHE"] = tmp
        try:
            for fam in ("runtime_probe", "int4_convert", "mma_smoke"):
                nvrtc._header_memo.clear()
                t0 = time.perf_counter()
                nvrtc.compile_family(fam, arch, progress=False)
                cold = time.perf_counter() - t0
                nvrtc._header_memo.clear()
                t0 = time.perf_counter()
                m = nvrtc.compile_family(fam, arch, progress=False)
                warm = time.perf_counter() - t0
                assert m.from_cache
                row(f"NVRTC build {fam} sm_{arch}", f"{cold:.2f} s cold", f"warm (cache hit, headers re-hashed) "
                    f"{warm * 1e3:.1f} ms")
        finally:
            if old is None:
                os.environ.pop("DDTREE_KERNEL_CACHE")
            else:
                os.environ["DDTREE_KERNEL_CACHE"] = old


WARM_LOAD = """
import time, json, sys
t0 = time.perf_counter()
import runtime.cuda as rc
from cutlass_kernels.registry import FAMILIES
t1 = time.perf_counter()
rc.get_device()
t2 = time.perf_counter()
n = 0
skip = set(sys.argv[1:])
for fam in FAMILIES.values():
    if fam.name in skip:
        continue
    for e in fam.entries:
        rc.get_kernel(fam.name, e); n += 1
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "init": t2 - t1, "load": t3 - t2, "kernels": n, "families": len(FAMILIES)}))
"""


def warm_load():
    t0 = time.perf_counter()
    built = rc.compile_all(jobs=os.cpu_count(), errors="skip")  # make sure the device arch's cache is warm
    row("compile_all for the device arch", f"{time.perf_counter() - t0:.1f} s",
        f"cold or warm as found; failed: {sorted(n for n, _ in built.failed) or 'none'}")
    out = subprocess.run([sys.executable, "-c", WARM_LOAD, *sorted({n for n, _ in built.failed})],
                         capture_output=True, text=True,
                         env={**os.environ, "DDTREE_KERNEL_CACHE_REQUIRE": "1"})
    if out.returncode != 0:
        row("warm load of all kernels", "FAILED", out.stderr.strip().splitlines()[-1])
        return
    r = json.loads(out.stdout.strip().splitlines()[-1])
    row("warm load of all kernels (fresh process)", f"{r['load']:.3f} s",
        f"{r['kernels']} kernels in {r['families']} families; target <= 1; import {r['import']:.2f} s, "
        f"cuInit+ctx {r['init']:.2f} s")


def int4_dequant(read_gbs: float, copy_gbs: float, dev):
    n, k = 7168 * 8, 2048  # 8 experts of Kimi K2.x shape 7168x2048 (more than L2 holds)
    rng = np.random.default_rng(0)
    packed = rc.to_device(rng.integers(0, 2**32, (n, k // 8), dtype=np.uint64).astype(np.uint32))
    scales = rc.to_device(to_bf16(rng.uniform(0.001, 0.05, (n, k // 32))))
    out = rc.empty((n, k), np.uint16)
    moved = packed.nbytes + scales.nbytes + out.nbytes
    # copy_gbs counts read + write bytes, so a written byte costs 1/copy_gbs like a copied one
    floor_us = (packed.nbytes + scales.nbytes) / read_gbs / 1e3 + out.nbytes / copy_gbs / 1e3
    for entry, threads, per in (("int4_to_bf16_kernel<128>", 128, 8), ("int4_to_bf16_kernel<256>", 256, 8),
                                ("int4_to_bf16_group_kernel<128>", 128, 32)):
        kern = rc.get_kernel("int4_convert", entry)
        units = n * k // per
        best = (1e9, None)
        for blocks_per_sm in (2, 4, 8, 16, 32):
            grid = min(-(-units // threads), dev.sm_count * blocks_per_sm)
            launch = kern.prepare(grid, threads, [packed, scales, out, np.int64(units)])
            ms = rc.bench(launch, warmup=3, iters=20)
            best = min(best, (ms, blocks_per_sm))
        ms, bps = best
        row(f"int4->bf16 {entry}", f"{ms * 1e3:.1f} us",
            f"{n}x{k}: {moved / ms / 1e6:,.0f} GB/s r+w; floor {floor_us:.1f} us (reads at read bw, writes at "
            f"copy bw): at {floor_us / (ms * 1e3):.2f} of it; {bps} blocks/SM")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=4.0, help="buffer size for the bandwidth test")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    dev = rc.require_device()
    print(f"device: {dev}\nNVRTC {nvrtc.nvrtc_version()}, cache {rc.cache_dir()}", flush=True)
    warm_load()
    read_gbs, copy_gbs = bandwidth(args.gib)
    launch_overhead()
    graph_replay()
    int4_dequant(read_gbs, copy_gbs, dev)
    nvrtc_builds(dev.arch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": a, "value": b, "note": c} for a, b, c in ROWS], f, indent=1)


if __name__ == "__main__":
    main()
