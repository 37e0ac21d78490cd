"""runtime/philox.py, the reference of the device Philox (cutlass_kernels/device_common.cuh) that sampling is
keyed by: Random123's known-answer vectors; the round and key schedule cross-checked through numpy's own
Philox (numpy implements the 4x64 member of the family, not 4x32: a scalar Philox4xW written here from the
paper reproduces numpy's 4x64 output, and its 4x32 instance must agree with runtime.philox); the uniform
conversion and the seed key."""
import numpy as np
import pytest

from runtime.philox import philox4x32_10, position_uniforms, seed_key, word_to_uniform

# Random123 tests/kat_vectors, "philox4x32 10" lines: counter[4], key[2] -> output[4].
KAT_4X32_10 = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

P32 = dict(W=32, M=(0xD2511F53, 0xCD9E8D57), K=(0x9E3779B9, 0xBB67AE85))
P64 = dict(W=64, M=(0xD2E7470EE14C6C93, 0xCA5A826395121157), K=(0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B))


def philox4_scalar(ctr, key, W, M, K, rounds=10):
    """Philox4xW-R on Python ints, straight from Salmon et al. 2011 (an independent second implementation)."""
    mask = (1 << W) - 1
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + K[0]) & mask, (k[1] + K[1]) & mask]
        p0, p1 = M[0] * c[0], M[1] * c[2]
        c = [(p1 >> W) ^ c[1] ^ k[0], p1 & mask, (p0 >> W) ^ c[3] ^ k[1], p0 & mask]
    return c


@pytest.mark.parametrize("ctr,key,want", KAT_4X32_10)
def test_known_answers(ctr, key, want):
    got = philox4x32_10(np.array([ctr], np.uint32), key)
    assert got.dtype == np.uint32 and got.shape == (1, 4)
    assert [f"{w:08x}" for w in got[0]] == [f"{w:08x}" for w in want]
    assert philox4_scalar(ctr, key, **P32) == list(want)


def test_scalar_family_reproduces_numpy_philox4x64():
    """numpy.random.Philox is Philox4x64-10: its counter is bumped (as a 256-bit little-endian integer) before
    each block, and random_raw returns the block's four words in order. The scalar implementation, at W = 64,
    must reproduce it: that checks the round structure and key schedule the 4x32 code shares."""
    rng = np.random.default_rng(0)
    for trial in range(4):
        ctr = [0, 0, 0, 0] if trial == 0 else [int(x) for x in rng.integers(0, 2**63, 4, dtype=np.uint64)]
        key = [int(x) for x in rng.integers(0, 2**63, 2, dtype=np.uint64)]
        g = np.random.Philox(counter=np.array(ctr, np.uint64), key=np.array(key, np.uint64))
        raw = [int(x) for x in g.random_raw(4)]
        bumped = [(ctr[0] + 1) & (2**64 - 1), ctr[1] + (ctr[0] == 2**64 - 1), ctr[2], ctr[3]]
        assert raw == philox4_scalar(bumped, key, **P64)


def test_vectorised_equals_scalar():
    rng = np.random.default_rng(1)
    ctr = rng.integers(0, 2**32, (300, 4), dtype=np.uint64).astype(np.uint32)
    ctr[0], ctr[1] = 0, 0xFFFFFFFF
    for key in ((0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0x9E3779B9, 7)):
        got = philox4x32_10(ctr, key)
        want = np.array([philox4_scalar([int(v) for v in row], key, **P32) for row in ctr], np.uint32)
        np.testing.assert_array_equal(got, want)


def test_uniforms_and_seed_key():
    w = np.array([0, 0xFF, 0x100, 0x80000000, 0xFFFFFFFF], np.uint32)
    u = word_to_uniform(w)
    assert u.dtype == np.float32
    assert u.tolist() == [0.0, 0.0, 2.0**-24, 0.5, 1.0 - 2.0**-24]       # exact; never 1
    assert seed_key(0x0123456789ABCDEF).tolist() == [0x89ABCDEF, 0x01234567]
    assert seed_key(5).dtype == np.uint32
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            seed_key(bad)
    key = seed_key(2**40 + 3)
    pos = np.array([0, 1, 7, 2**31 - 1], np.int32)
    u = position_uniforms(key, pos)
    assert u.dtype == np.float32 and u.shape == (4,)
    ctr = np.zeros((4, 4), np.uint32)
    ctr[:, 0] = pos
    np.testing.assert_array_equal(u, word_to_uniform(philox4x32_10(ctr, key)[:, 0]))
    many = position_uniforms(key, np.arange(20000))
    assert 0.0 <= many.min() and many.max() < 1.0 and abs(float(many.mean()) - 0.5) < 0.01
    assert (many * 2**24 == np.floor(many * 2**24)).all()
    assert (position_uniforms(seed_key(2**40 + 4), np.arange(20000)) != many).mean() > 0.99
