"""tools/bench_verify.py end to end on the CPU stand-in (tests/fake_cuda.py), and its in-memory random weight
source (loader.testing.RandomWeights)."""
import os
import subprocess
import sys

import numpy as np

from loader import load_config
from loader.names import expected_tensors
from loader.testing import TINY_QWEN3_CONFIG, RandomWeights
from runtime.bf16 import from_bf16

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_random_weights_cover_the_spec_as_views_of_one_pool():
    cfg = dict(TINY_QWEN3_CONFIG, tie_word_embeddings=False)
    w = RandomWeights(cfg, seed=1)
    want = {n: e.shape for n, e in expected_tensors(load_config(cfg)).items()}
    assert set(w.names()) == set(want)
    for n in w.names():
        t = w.tensor(n)
        assert t.dtype == np.uint16 and t.shape == want[n], n
        assert t.base is not None and not t.flags.writeable          # a view, not a copy
    mat = from_bf16(w.tensor("model.layers.0.mlp.down_proj.weight"))
    assert 0.01 < mat.std() < 0.04 and (mat != 0).all()
    assert abs(from_bf16(w.tensor("model.layers.1.self_attn.k_norm.weight")).mean() - 1) < 0.05
    a, b = w.tensor("model.layers.0.self_attn.q_proj.weight"), w.tensor("model.layers.1.self_attn.q_proj.weight")
    assert not np.array_equal(a, b)                                  # different offsets
    tied = RandomWeights(TINY_QWEN3_CONFIG)
    assert "lm_head.weight" not in tied.names()                      # tied: the model reads the embedding


def test_random_weights_build_a_model():
    from runtime.backends.numpy_backend import NumpyBackend
    from runtime.engine import Engine
    from tools.bench_e2e import RANDOM_SHAPES, random_target
    cfg = dict(RANDOM_SHAPES["qwen3-tiny"], vocab_size=512, num_hidden_layers=1)
    target = random_target(cfg, NumpyBackend())
    r = Engine(target, None).generate([5, 6, 7], mode="ar", max_new_tokens=3)
    assert len(r.tokens) == 3 and all(0 <= t < 512 for t in r.tokens)


def test_bench_verify_fake_end_to_end():
    cmd = [sys.executable, "-m", "tools.bench_verify", "--random", "qwen3-tiny", "--fake", "--prefix", "24",
           "--budgets", "16,64", "--iters", "2", "--per-op", "16", "--reps", "2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for line in ("AR (1 token)", "verify b16", "verify b64", "target: verify budget 64 <= 1.25x AR",
                 "whole graph replay", "linear lm_head"):
        assert line in out, out
    assert "capturing the AR graph" in p.stderr and "done in" in p.stderr


def test_bench_ar_fake_end_to_end():
    """tools/bench_ar.py: every configuration (attention, gemv knobs) builds its engine, decodes and prints its
    row (a repeated one too); a decode instance that does not exist, or an unknown term, is refused before the model is built."""
    cmd = [sys.executable, "-m", "tools.bench_ar", "--random", "qwen3-tiny", "--fake", "--prompts", "8,40",
           "--new-tokens", "3", "--iters", "2", "--verify-budgets", "4",
           "--configs", "tree,decode,decode:32x3,decode+kw4+persist0,gemv0+gmma0+fuse32,swiglu16,decode+drows256+agmma0,decode",
           "--layers", "1"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("| decode | ") == 4, p.stdout   # a repeated configuration gets its own rows
    for row in ("| tree | ", "| decode:32x3 | ", "| decode+kw4+persist0 | ", "| gemv0+gmma0+fuse32 | ",
                "| swiglu16 | ", "| decode+drows256+agmma0 | "):
        assert p.stdout.count(row) == 2, p.stdout          # the AR table and the verify b4 table
    assert "verify graph replay at budget 4" in p.stdout, p.stdout
    bad = subprocess.run(cmd[:-3] + ["decode:8x8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "decode variant (8, 8)" in bad.stderr, bad.stdout + bad.stderr
    assert "building" not in bad.stderr, bad.stderr     # refused before the model is built
    typo = subprocess.run(cmd[:-3] + ["decode+kw3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert typo.returncode != 0 and "term 'kw3'" in typo.stderr, typo.stdout + typo.stderr


def test_bench_ar_configure_sets_and_restores_the_gmma_knobs():
    """bench_ar's 3wg0 / 1wg0 terms turn runtime.dense_gmma's plan rules off, and the next configuration starts
    from the defaults again (so an A/B's first column is the default plan)."""
    from runtime import dense_gmma
    from tools.bench_ar import KNOBS, configure, knob_owner
    defaults = {name: getattr(knob_owner(name), name) for name in KNOBS}
    assert defaults["GMMA_THREE_WG_MANY"] is True and defaults["GMMA_ONE_WG"] is True
    try:
        configure("decode+3wg0+1wg0", defaults)
        assert dense_gmma.GMMA_THREE_WG_MANY is False and dense_gmma.GMMA_ONE_WG is False
        # the plan follows the knob: Qwen3-8B gate_up at M = 129 on 132 SMs leaves three warpgroups
        assert dense_gmma.gmma_plan(129, 24576, 4096, 132)[0] != _plan_3wg(dense_gmma)
        configure("decode", defaults)
        assert dense_gmma.GMMA_THREE_WG_MANY is True and dense_gmma.GMMA_ONE_WG is True
        assert dense_gmma.gmma_plan(129, 24576, 4096, 132)[0] == _plan_3wg(dense_gmma)
        # on by default: the narrow kernel, unfused, one block per row block (timed, runtime/dense_gmma.py)
        assert (defaults["GMMA_NARROW"], defaults["NARROW_FUSE"], defaults["NARROW_MC"]) == (True, False, False)
        configure("decode+narrow0+nfuse1+nmc1", defaults)
        assert dense_gmma.GMMA_NARROW is False and dense_gmma.NARROW_FUSE is True and dense_gmma.NARROW_MC is True
        configure("decode", defaults)
        assert dense_gmma.GMMA_NARROW is True and dense_gmma.NARROW_FUSE is False and dense_gmma.NARROW_MC is False
    finally:
        configure("decode", defaults)


def _plan_3wg(dense_gmma):
    return dense_gmma.gmma_entry((136, *dense_gmma._DEFAULT_CONFIG_3WG[136], 1, 3))


def test_logit_error_measures_the_paths():
    """tools.logit_error: the numpy backend against itself has no error on any path; a model with other weights
    shows large errors and argmax misses (the measurement can tell them apart)."""
    from runtime.backends.numpy_backend import NumpyBackend
    from tools.bench_e2e import RANDOM_SHAPES, random_target
    from tools.logit_error import compare
    cfg = dict(RANDOM_SHAPES["smollm2-135m"], num_hidden_layers=2)
    ref = random_target(cfg, NumpyBackend())
    prompt = [11, 2000, 345, 7777, 90]
    rows, seq = compare(ref, random_target(cfg, NumpyBackend()), prompt, new_tokens=6, verify_rows=4)
    assert len(seq) == 11 and [r["pos"] for r in rows] == list(range(4, 10))
    for r in rows:
        for k in ("prefill", "ar"):
            assert r[k][0] < 1e-3 and r[k][1] == r["best"], (k, r)
    assert sum("verify 4" in r for r in rows) == 3   # its rows but the last (whose next token is not known)
    other, _ = compare(ref, random_target(cfg, NumpyBackend(), seed=1), prompt, new_tokens=6, verify_rows=4)
    assert min(r["prefill"][0] for r in other) > 0.5
    assert any(r["ar"][1] != r["best"] for r in other)


def test_greedy_split_reads_the_reference_at_the_divergence():
    """runtime.testing.greedy_split: no split for equal outputs; at a split to the reference's second-best token
    it reports that token pair as its top two with the reference's gap; a token outside its top two is never a
    tie (whatever the gap)."""
    from runtime.backends.numpy_backend import NumpyBackend
    from runtime.testing import NEAR_TIE, greedy_split, reference_logits
    from tools.bench_e2e import RANDOM_SHAPES, random_target
    from tools.logit_error import greedy
    ref = random_target(dict(RANDOM_SHAPES["smollm2-135m"], num_hidden_layers=2), NumpyBackend())
    prompt = [11, 2000, 345, 7777, 90]
    cont = greedy(ref, prompt, 5)[len(prompt):]
    assert greedy_split(ref, prompt, cont, cont) is None
    z, _ = reference_logits(ref, prompt + cont[:3])
    order = np.argsort(z)
    assert cont[3] == int(order[-1])
    second = cont[:3] + [int(order[-2])]
    split = greedy_split(ref, prompt, cont, second)
    assert split["index"] == 3 and split["top2"] and (split["a"], split["b"]) == (cont[3], int(order[-2]))
    assert abs(split["gap_std"] - float(z[order[-1]] - z[order[-2]]) / float(z.std())) < 1e-6
    assert split["tie"] == (split["gap_std"] < NEAR_TIE)
    far = greedy_split(ref, prompt, cont, cont[:3] + [int(order[0])])
    assert not far["top2"] and not far["tie"]


def test_bench_e2e_reference_target(monkeypatch, capsys):
    """bench_e2e's float32 reference for the lossless column: the random shape's weights on the numpy backend
    (the same ones the benchmarked target got), and none (with a notice) over the size cap."""
    from argparse import Namespace
    from runtime.backends.numpy_backend import NumpyBackend
    from runtime.testing import reference_logits
    import tools.bench_e2e as be
    args = Namespace(random="qwen3-tiny", model=None)
    ref = be.reference_target(args, hf_peer=False)
    same = be.random_target(be.RANDOM_SHAPES["qwen3-tiny"], NumpyBackend())
    z, _ = reference_logits(ref, [5, 6, 7])
    assert np.array_equal(z, reference_logits(same, [5, 6, 7])[0])
    monkeypatch.setattr(be, "REFERENCE_MAX_BYTES", 0)
    assert be.reference_target(args, hf_peer=False) is None
    assert "no float32 reference" in capsys.readouterr().err


def test_gpu_sanitize_selections_exist():
    """Every test node tools/gpu_sanitize.sh runs under compute-sanitizer is collected (instance ids change with the
    plan rules; a stale one would fail only on the device)."""
    import re
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    script = (root / "tools" / "gpu_sanitize.sh").read_text()
    nodes = re.findall(r'^\s+"(tests/[^"]+)"', script, re.M)
    assert len(nodes) >= 10
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *nodes],
                       cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and "tests collected" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_bench_w_tiles_epilogue_segments():
    """bench_w_tiles --trace-m: the last block's epilogue split at the stamps its path writes (0: not stamped)."""
    from tools.bench_w_tiles import epilogue_segments
    got = epilogue_segments([(0, 1000, 1500, 1900, 2200, 2600, 1400), (1, 1000, 1300, 1600, 2000, 2100, 1000),
                             (0, 1000, 0, 0, 0, 2000, 1200)])
    assert got == ("loop end -> cluster's last loop end 0.20, loop end -> partials in hand 0.40, partials in hand -> "
                   "staged 0.35, staged -> stores issued 0.35, stores issued -> exit 0.25, loop end -> exit 1.00 "
                   "(rank 0 in 2 of 3 links)"), got


def test_bench_w_tiles_link_stats():
    """bench_w_tiles --trace-m: a synthetic chain of 4 links x 2 blocks, each link 10 us after the previous one's last
    exit, its blocks entering 5 us before it; the medians and the last block out come out as built."""
    import numpy as np
    from tools.bench_w_tiles import link_stats
    st = np.zeros((4, 2, 9), np.uint64)
    for j in range(4):
        prev = 100_000 + 10_000 * j
        for b in range(2):
            st[j, b, :4] = (prev - 5000, prev + 1000, prev + 8000 + 500 * b, prev + 9000 + 1000 * b)
            st[j, b, 7] = b
        st[j, 1, 6] = prev + 9500
    r, last = link_stats(st, (1, 2, 1))  # the two blocks are one cluster
    np.testing.assert_allclose(r, [10.0, 2, -5.0, -5.0, 1.0, 1.0, 7.25, 8.5, 1.25, 1.5, 1.5])
    assert last == [(1, 128500, 0, 0, 129500, 130000, 128500), (1, 138500, 0, 0, 139500, 140000, 138500)], last
    st[3, 0, 2] = 139000  # the other block of the last link's cluster ends its loop later
    assert link_stats(st, (1, 2, 1))[1][-1] == (1, 138500, 0, 0, 139500, 140000, 139000)
    assert link_stats(st, (2, 1, 1))[1][-1][-1] == 138500  # two clusters of one block: only its own
