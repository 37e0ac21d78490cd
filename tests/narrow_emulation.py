"""A numpy transcription of cutlass_kernels/dense_linear_narrow_sm90.cu's data movement, index for index: the copies
of each pipeline stage into the swizzled shared-memory tiles (load_w / load_x / the rmsnorm weight), the fused
prologue's in-place rewrite of the x tile, ldmatrix into the A fragments, the 128-byte-swizzled K-major B operand
as wgmma reads it, the RMSNorm row sums and the epilogue. Shared memory starts as NaN, so a read of anything no
copy wrote shows up in the output. It checks the kernel's address arithmetic on the CPU (tests/test_dense_gmma.py);
the wgmma and ldmatrix semantics it assumes are the PTX ISA's (the A fragment of m16k16; D = A B^T)."""
from __future__ import annotations

import numpy as np

from runtime.bf16 import round_bf16


def _chunk(smem, byte_off):
    """The 8 bf16 (16 bytes) at a byte offset of the shared memory (an array of bf16 values as float32)."""
    assert byte_off % 16 == 0
    return smem[byte_off // 2:byte_off // 2 + 8]


def _silu(v):
    return v / (1.0 + np.exp(-v))


def emulate_narrow(x, w, cfg, stage_bytes, *, x2=None, norm_w=None, eps=1e-6, residual=None):
    """out (float32, rounded to bf16) of linear_gmma_narrow_kernel<cfg> on bf16-valued float32 arrays x [M, K],
    w [N, K] (x2 [M, K], norm_w [K], residual [M, N] as the prologue / epilogue take them); and sum_out (the residual
    sum block (0, z) writes, or None)."""
    NW, TX, KA, STAGES, XMODE = cfg[:5]
    mc = len(cfg) == 6     # linear_gmma_narrow_mc_kernel: x rows bulk-copied by the cluster, unswizzled, kPitch apart
    CS = cfg[5] if mc else 1
    M, K = x.shape
    N = w.shape[0]
    threads = 256 if TX > 64 else 128
    rows_pass = threads // 8
    x_tiles = 1 if XMODE == 0 else 2
    atom_x, atom_w = TX * 128, NW * 128
    pitch = KA * 128 + 16
    tile_x = TX * pitch if mc else KA * atom_x
    stage_x = -(-x_tiles * tile_x // 1024) * 1024

    def x_off(t, r, c):  # the kernel's x_off: byte of 16-byte chunk c of token row r in x tile t
        if mc:
            return t * tile_x + r * pitch + 16 * c
        return (t * KA + (c >> 3)) * atom_x + r * 128 + (((c & 7) ^ (r & 7)) << 4)
    stage_g = stage_x + KA * atom_w
    stage_k = 64 * KA
    n_stages = -(-K // stage_k)
    chunks = KA * 8
    passes = -(-TX * chunks // threads)
    with_x2 = XMODE == 2 or (XMODE == 1 and x2 is not None)
    out = np.full((M, N), np.nan, np.float32)
    sum_out = np.full((M, K), np.nan, np.float32) if XMODE == 1 and x2 is not None else None
    for bz in range(-(-M // TX)):
        m0 = bz * TX
        live_rows = min(TX, M - m0)
        for bx in range(-(-N // NW)):
            n0 = bx * NW
            acc = np.zeros((64 * (threads // 128), NW), np.float64)   # D of the block's m64 tiles
            ss_slot = np.zeros((threads, passes), np.float64)
            for s in range(n_stages):
                smem = np.full(stage_bytes // 2, np.nan, np.float32)   # a fresh stage: stale bytes would be NaN
                k0 = s * stage_k
                for tid in range(threads):
                    wc, r_first = tid & 7, tid >> 3
                    chunk_dst = r_first * 128 + ((wc ^ (r_first & 7)) << 4)
                    for q in range(-(-NW // rows_pass)):                                   # load_w
                        if NW % rows_pass and r_first + rows_pass * q >= NW:
                            continue
                        n = n0 + r_first + rows_pass * q
                        for a in range(KA):
                            k = k0 + 64 * a + 8 * wc
                            dst = _chunk(smem, stage_x + a * atom_w + chunk_dst + q * rows_pass * 128)
                            dst[:] = w[n, k:k + 8] if (k < K and n < N) else 0.0
                    for t in range(x_tiles if not mc else 0):                               # load_x
                        if t == 1 and not with_x2:
                            break
                        src = x if t == 0 else x2
                        for q in range(-(-TX // rows_pass)):
                            if TX % rows_pass and r_first + rows_pass * q >= TX:
                                continue
                            m = m0 + r_first + rows_pass * q
                            for a in range(KA):
                                k = k0 + 64 * a + 8 * wc
                                dst = _chunk(smem, (t * KA + a) * atom_x + chunk_dst + q * rows_pass * 128)
                                dst[:] = src[m, k:k + 8] if (m < M and k < K) else 0.0
                    for rank in range(CS if mc else 0):   # the cluster's bulk copies: this row's k range, no more
                        r = CS * tid + rank
                        if r < live_rows:
                            n_el = min(stage_k, K - k0)
                            for t in range(2 if with_x2 else 1):
                                src = x if t == 0 else x2
                                base = x_off(t, r, 0) // 2
                                smem[base:base + n_el] = src[m0 + r, k0:k0 + n_el]
                    if XMODE == 1 and tid < 8 * KA:                                        # the norm weight
                        k = k0 + 8 * tid
                        _chunk(smem, stage_g + 16 * tid)[:] = norm_w[k:k + 8] if k < K else 0.0
                if XMODE:                                                                   # the prologue
                    for tid in range(threads):
                        for p in range(passes):
                            i = tid + threads * p
                            if i >= live_rows * chunks:
                                break
                            r, c = divmod(i, chunks)
                            a, cc = divmod(c, 8)
                            if mc and k0 + 8 * c >= K:
                                continue
                            off = x_off(0, r, c)
                            h = _chunk(smem, off).astype(np.float32)
                            u = _chunk(smem, x_off(1, r, c)) if with_x2 else None
                            if XMODE == 2:
                                h = round_bf16(_silu(h) * u)
                            else:
                                k = k0 + 64 * a + 8 * cc
                                if with_x2:
                                    h = round_bf16(h + u)
                                    if bx == 0 and k < K:
                                        sum_out[m0 + r, k:k + 8] = h
                                g = _chunk(smem, stage_g + a * 128 + 16 * cc)
                                ss_slot[tid, p] += float(np.sum(h.astype(np.float64) ** 2))
                                h = round_bf16(h * g)
                            _chunk(smem, off)[:] = h
                for a in range(KA):                                                         # the MMAs
                    for j in range(4):
                        # B as wgmma reads it: row n at 128 n, 16-byte chunk c of the k16 step's 32 bytes at c ^ (n % 8)
                        n_idx, k_idx = np.meshgrid(np.arange(NW), 16 * j + np.arange(16), indexing="ij")
                        byte = stage_x + a * atom_w + n_idx * 128 + (((k_idx >> 3) ^ (n_idx & 7)) << 4) + 2 * (k_idx & 7)
                        B = smem[byte // 2]
                        for warp in range(threads // 32):
                            A = np.zeros((16, 16), np.float32)
                            if 16 * warp < TX and m0 + 16 * warp < M:       # ldmatrix.x4 of the warp's 16 rows
                                rows = []
                                for lane in range(32):
                                    lm_row = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7)
                                    rows.append(_chunk(smem, x_off(0, lm_row, 8 * a + 2 * j + (lane >> 4))))
                                for lane in range(32):
                                    g_, t_ = lane >> 2, lane & 3
                                    for reg in range(4):    # register reg: row g + 8 (reg % 2), k 2t + 8 (reg / 2)
                                        col = 2 * t_ + 8 * (reg >> 1)
                                        # the cluster kernel zeroes the pairs past K (never copied)
                                        masked = mc and k0 + 64 * a + 16 * j + col >= K
                                        A[g_ + 8 * (reg & 1), col:col + 2] = 0.0 if masked else \
                                            rows[8 * reg + g_][2 * t_:2 * t_ + 2]
                            acc[16 * warp:16 * warp + 16] += A.astype(np.float64) @ B.T.astype(np.float64)
            scale = np.ones(acc.shape[0])
            if XMODE == 1:                              # each row's sum of squares from its slots, in chunk order
                sums = np.zeros(acc.shape[0])
                for r in range(live_rows):
                    for c in range(chunks):
                        i = r * chunks + c
                        sums[r] += ss_slot[i % threads, i // threads]
                scale[:live_rows] = 1.0 / np.sqrt(sums[:live_rows] / K + eps)
            for r in range(min(live_rows, acc.shape[0])):
                cols = slice(n0, min(n0 + NW, N))
                v = acc[r, :cols.stop - n0] * scale[r]
                if residual is not None:
                    v = v + residual[m0 + r, cols]
                out[m0 + r, cols] = round_bf16(v.astype(np.float32))
    return out, sum_out
