"""Save the MoE layer's output bits for a fixed set of inputs and launch plans, or compare two such files.

For changes that must not move a single bit (a cheaper but exact dequantization, a reordered pipeline): run
`save` on the GPU with each build (same seeds, same plans), then `compare` the two files. The tests check each
build against the float32 reference within bf16 tolerance; this checks the two builds against each other exactly.

    python -m tools.moe_bits save OUT.npz      # on the device, once per build (tree)
    python -m tools.moe_bits compare A.npz B.npz
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

E, HIDDEN, INTER, TOPK = 16, 1024, 512, 4
# (T, MoeLayer options): mma.sync alone, the default plan, and hot tiers on every wgmma pipeline in use
PLANS = [
    (1, dict()),     # T = 1's register rings (gate_up two buffers, down three with x staged)
    (2, dict()),     # T = 2: x staged (XS 1) on both GEMMs
    (8, dict()),     # the cp.async ring (gate_up) at 8-token chunks
    (24, dict()),    # down with 16-token chunks
    (4, dict(variants=("moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 4>", "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 2>"))),  # XS pieces
    (4, dict(gmma_min_tokens=None)),
    (64, dict(gmma_min_tokens=None)),
    (300, dict(gmma_min_tokens=None)),
    (200, dict()),
    (200, dict(gmma_tiers=[(64, 128, 7), (16, 64, 8)])),
    (200, dict(gmma_tiers=[(16, 64, 6)])),
    (300, dict(gmma_tiers=[(64, 256, 5), (17, 32, 8)])),
    (1024, dict()),
]


def random_experts(rng):
    """Random INT4 codes with scales of a checkpoint's magnitude, repacked and uploaded."""
    from runtime.bf16 import to_bf16
    from runtime.kimi_kernels import MoeWeights, repack_int4_experts
    mats = {}
    for name, (n, k) in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
        wp = rng.integers(-2**31, 2**31, size=(E, n, k // 8), dtype=np.int64).astype(np.int32)
        ws = to_bf16(rng.uniform(0.5, 1.5, size=(E, n, k // 32)).astype(np.float32) * (0.5 / np.sqrt(k)))
        mats[name] = repack_int4_experts(wp, ws, (n, k))
    return MoeWeights.upload(mats["gate"], mats["up"], mats["down"])


def save(path: str) -> None:
    """Run every plan of PLANS on the device and write the bf16 outputs (uint16 bits) to path."""
    from runtime import cuda
    from runtime.bf16 import to_bf16
    from runtime.kimi_kernels import MoeLayer
    cuda.require_device()
    weights = random_experts(np.random.default_rng(0))
    out = {}
    for T, plan in PLANS:
        rng = np.random.default_rng(T)
        layer = MoeLayer(weights, T, np.zeros(E, np.float32), topk=TOPK, **plan)
        layer.x.upload(to_bf16(rng.standard_normal((T, HIDDEN)).astype(np.float32)))
        layer.logits.upload(rng.standard_normal((T, E)).astype(np.float32))
        layer.y.fill_bytes(0xFF)   # NaN poison: a plan that writes nothing cannot compare equal
        layer.forward()
        cuda.default_stream().synchronize()
        out[f"T={T} {plan}"] = layer.y.download()
    np.savez(path, **out)
    print(f"saved {len(out)} layer outputs to {path}")


def compare(a_path: str, b_path: str) -> int:
    """Print per plan whether the outputs are bit-identical (and any NaN); 1 if any differ or hold NaN."""
    from runtime.bf16 import from_bf16
    a, b = np.load(a_path), np.load(b_path)
    if sorted(a.files) != sorted(b.files):
        print(f"different plan sets: {sorted(set(a.files) ^ set(b.files))}")
        return 1
    differ = 0
    for key in sorted(a.files):
        x, y = a[key].view(np.uint16), b[key].view(np.uint16)
        n = int((x != y).sum())
        nan = int(np.isnan(from_bf16(x)).sum() + np.isnan(from_bf16(y)).sum())
        print(f"{key}: {'identical' if n == 0 else f'{n} of {x.size} outputs differ'}"
              f"{f' ({nan} NaN)' if nan else ''}")
        differ += n > 0 or nan > 0
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save").add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "save":
        save(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
