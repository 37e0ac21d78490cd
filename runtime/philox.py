"""Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
Random123 / cuRAND constants), vectorised in numpy: the reference of ddtree::philox4x32_10 in
cutlass_kernels/device_common.cuh, and what the numpy backend samples with.

Sampling contract (base.py `sample`): key = the 64-bit seed as two uint32 words (lo, hi); counter =
(position, 0, 0, 0), position = the row's absolute sequence position (the position of the token whose next
token is sampled, the number the model gets in `positions`); uniform = (first output word >> 8) * 2^-24, in
[0, 1) and exact in float32. So the token sampled after position p depends only on (seed, p, logits): AR and
every tree node at that position draw the same number, and DDTree output equals AR output for a seed.
"""
from __future__ import annotations

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)     # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85                           # key bumps (golden ratio, sqrt(3) - 1)
ROUNDS = 10
_LO = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def seed_key(seed: int) -> np.ndarray:
    """The Philox key of a 64-bit seed: uint32 [2] = (lo, hi)."""
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)


def philox4x32_10(counters, key) -> np.ndarray:
    """counters uint32 [n, 4], key (k0, k1) -> uint32 [n, 4]. Products of two 32-bit words are exact in uint64;
    their high and low halves are the round's mulhi / mullo."""
    c = np.asarray(counters, dtype=np.uint32).reshape(-1, 4).astype(np.uint64)
    c0, c1, c2, c3 = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
    k = np.asarray(key, dtype=np.uint32).reshape(2)
    k0, k1 = int(k[0]), int(k[1])
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = ((p1 >> _32) ^ c1 ^ np.uint64(k0), p1 & _LO,
                          (p0 >> _32) ^ c3 ^ np.uint64(k1), p0 & _LO)
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def word_to_uniform(words) -> np.ndarray:
    """uint32 -> float32 in [0, 1): the top 24 bits times 2^-24 (exact; never rounds up to 1)."""
    return ((np.asarray(words, dtype=np.uint32) >> np.uint32(8)).astype(np.float32)
            * np.float32(1.0 / (1 << 24)))


def position_uniforms(key, positions) -> np.ndarray:
    """float32 [n]: the sampling uniform of each absolute sequence position (module docstring)."""
    pos = np.asarray(positions).reshape(-1)
    if pos.size and (pos.min() < 0 or pos.max() > 0xFFFFFFFF):
        raise ValueError("positions must be in [0, 2**32)")
    counters = np.zeros((pos.size, 4), np.uint32)
    counters[:, 0] = pos
    return word_to_uniform(philox4x32_10(counters, key)[:, 0])
