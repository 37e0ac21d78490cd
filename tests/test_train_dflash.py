"""tools/train_dflash.py: its torch target and drafter compute what the runtime's models compute (so a drafter trained
there drafts the same in ddtree-run), and a short training run writes a drafter that loads and runs in the engine."""
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import loader  # noqa: E402
from loader.testing import TINY_LLAMA_CONFIG  # noqa: E402
from runtime.backends.numpy_backend import NumpyBackend  # noqa: E402
from runtime.bf16 import round_bf16  # noqa: E402
from runtime.backends.base import causal_visibility  # noqa: E402
from runtime.models import build_model  # noqa: E402
from runtime.testing import assert_close  # noqa: E402
from tools import train_dflash as td  # noqa: E402


def _tiny_target(seed=0):
    spec = loader.load_config(TINY_LLAMA_CONFIG)
    rng = np.random.default_rng(seed)
    weights = {n: (rng.normal(0, 0.3, e.shape) if "norm" not in n else 1 + rng.normal(0, 0.1, e.shape)).astype(
        np.float32) for n, e in loader.expected_tensors(spec).items() if not e.optional}
    return spec, weights


def test_torch_target_and_drafter_match_the_runtime(tmp_path):
    spec, weights = _tiny_target()
    taps = [0, 1]
    tt = td.TorchTarget(spec, weights, "cpu")
    ours = build_model(spec, weights, NumpyBackend())
    b = ours.backend
    ids = [3, 17, 42, 8, 51, 9, 33, 20, 11, 5]
    T = len(ids)
    # the target's tap states, one forward over the sequence (torch left-padded by two, numpy plain)
    tid = torch.tensor([[0, 0] + ids])
    real = torch.tensor([[False, False] + [True] * T])
    pos = (real.long().cumsum(1) - 1).clamp(min=0)
    _, tapped, _ = tt.step(tid, pos, real, [None] * len(tt.layers), taps)
    states = torch.cat([tapped[t] for t in taps], -1)[0, 2:]
    cache = ours.new_cache(T + 4)
    _, ref_taps = ours.forward(cache, b.from_host(np.asarray(ids, np.int32)), b.from_host(np.arange(T, dtype=np.int32)),
                               b.from_host(causal_visibility(T)), taps=taps)
    ref_states = np.concatenate([b.to_host(ref_taps[t]) for t in taps], -1)
    assert_close(states.numpy(), ref_states, "tap states", rtol=1e-4, atol=1e-4)

    # the drafter: torch forward at anchor s vs the runtime's DFlashDrafter after add_context(0..s-1) + draft
    block, s = 4, 6
    cfg = td.drafter_config(spec, layers=2, block=block, taps=taps, mask_token_id=63)
    dr = td.Drafter(cfg, "cpu", seed=3, final_norm=tt.norm)
    with torch.no_grad():
        for v in dr.p.values():      # not the init's ones: every norm and weight matters in the comparison
            v.add_(0.05 * torch.randn(v.shape))
    hidden = dr.forward(tt, states, torch.tensor(ids), torch.tensor([s, 3]), block)
    dr.save(tmp_path / "d", "float32")           # the same numbers on both sides
    dspec, dweights = loader.load_model(tmp_path / "d")
    from runtime.models.dflash import DFlashDrafter
    rd = DFlashDrafter(dspec, dweights, b)
    for row, anchor in enumerate((s, 3)):
        dcache = rd.new_cache(T + block)
        rd.add_context(dcache, b.from_host(ref_states[:anchor]), b.from_host(np.arange(anchor, dtype=np.int32)))
        emb = b.to_host(ours.embed(b.from_host(np.asarray([ids[anchor]] + [63] * (block - 1), np.int32))))
        out = b.to_host(rd.draft(dcache, b.from_host(emb), b.from_host(np.arange(anchor, anchor + block,
                                                                                 dtype=np.int32))))
        assert_close(hidden[row].detach().numpy(), out, f"draft hidden at {anchor}", rtol=1e-4, atol=1e-4)


def test_short_training_run_writes_a_drafter_the_engine_runs(tmp_path, monkeypatch):
    """A few steps on the tiny target with its own greedy answers (no tokenizer chat template: the prompts are
    token ids): the loss is finite, the checkpoint loads as a DFlash drafter, and DDTree with it == AR."""
    spec, weights = _tiny_target(seed=1)
    tt = td.TorchTarget(spec, weights, "cpu")
    prompts = [[random.Random(i).randrange(4, 60) for _ in range(5 + i % 3)] for i in range(6)]
    data = td.generate_answers(tt, prompts, 12, [0, 1], {2}, batch=4, log=lambda m: None)
    assert len(data) == 6 and all(len(t) == len(p) + 12 or t[-1] == 2 for (t, _, n), p in
                                  zip(data, sorted(prompts, key=len)))
    for tokens, states, n in data:
        assert states.shape[0] >= len(tokens) - 1 and np.isfinite(states).all()
    cfg = td.drafter_config(spec, layers=1, block=4, taps=[0, 1], mask_token_id=63)
    dr = td.Drafter(cfg, "cpu", seed=0, final_norm=tt.norm)
    opt = torch.optim.AdamW(dr.params(), lr=1e-2)
    seqs = [(torch.from_numpy(t), torch.from_numpy(s.astype(np.float32)), n) for t, s, n in data]
    losses = []
    for step in range(30):
        tokens, states, n = seqs[step % len(seqs)]
        anchors = td.sample_anchors(len(tokens), n, 6, random.Random(step))
        loss, _, _ = td.block_loss(dr, tt, (tokens, states), anchors, 4, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < np.mean(losses[:5])
    dr.save(tmp_path / "f32", "float32")
    again = td.Drafter(cfg, "cpu", seed=5)
    again.load(tmp_path / "f32")
    assert all(torch.equal(again.p[k], v) for k, v in dr.p.items())
    dr.save(tmp_path / "d")                        # bf16 by default: each weight rounded once
    again.load(tmp_path / "d")
    assert all(np.array_equal(again.p[k].detach().numpy(), round_bf16(v.detach().numpy()).reshape(v.shape))
               for k, v in dr.p.items())
    td.save_answers(tmp_path / "a.npz", data, [0, 1])
    back = td.load_answers(tmp_path / "a.npz", [0, 1], spec.hidden_size)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(data, back))
    from runtime.engine import Engine
    from runtime.models.dflash import DFlashDrafter
    dspec, dweights = loader.load_model(tmp_path / "d")
    b = NumpyBackend()
    target = build_model(spec, weights, b)
    eng = Engine(target, DFlashDrafter(dspec, dweights, b))
    prompt = [5, 9, 14, 30]
    ar = eng.generate(prompt, mode="ar", max_new_tokens=16)
    dd = eng.generate(prompt, mode="ddtree", budget=8, max_new_tokens=16)
    assert dd.tokens == ar.tokens


def test_bad_arguments_are_refused_before_any_work(capsys):
    """Counts out of range, a non-positive learning rate and tap layers outside the target: exit 2 with the
    reason (no traceback, no model answered)."""
    cases = [(["--steps", "0"], "--steps 0"), (["--block", "1", "--lr", "0"], "--block 1, --lr 0.0")]
    try:
        loader.default_model_path()       # the taps are checked against the target, so it is loaded first
        cases += [(["--taps", "1,x"], "--taps '1,x'"), (["--taps", "1,99"], "--taps '1,99'")]
    except loader.LoadError:
        pass
    for argv, reason in cases:
        assert td.main(argv + ["--out", "/nonexistent/never-written"]) == 2
        assert reason in capsys.readouterr().err
