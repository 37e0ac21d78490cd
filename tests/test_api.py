"""runtime.api, the embedding API: load a target (+ DFlash drafter), encode prompts (chat template by default where
the model has one), generate text; the errors it raises for bad input. numpy backend (CPU)."""
import numpy as np
import pytest

from loader import LoadError
from runtime import api
from test_ddtree_run import need_default_model, tiny_model_dirs, write_smollm2_drafter


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """(target dir, drafter dir): a tiny HF llama with a word-level tokenizer (no chat template), its drafter."""
    return tiny_model_dirs(tmp_path_factory.mktemp("api"))


PROMPT = "w3 w17 w42 w8 w91"


def test_generate_with_and_without_a_drafter(tiny_dirs):
    target_dir, draft_dir = tiny_dirs
    notices = []
    ar = api.load(target_dir, backend="numpy", notice=notices.append)
    assert ar.drafter is None and ar.backend.name == "numpy" and not ar.has_chat_template
    out = ar.generate(PROMPT, max_new_tokens=20)
    assert out.mode == "ar" and len(out.text.split()) == 20 and len(out.tokens) == 20
    assert out.prompt_tokens == 5 and out.result.stop_reason == "max_new_tokens"
    assert notices == []                          # numpy asked for by name, a quick load, no template: nothing said
    dd = api.load(target_dir, draft=draft_dir, backend="numpy")
    for mode in (None, "chain", "ar"):
        got = dd.generate(PROMPT, max_new_tokens=20, mode=mode, budget=16)
        assert got.mode == (mode or "ddtree") and got.text == out.text and got.tokens == out.tokens
    assert dd.generate(ar.encode(PROMPT), max_new_tokens=20).text == out.text     # token ids as they are
    pieces = []
    streamed = dd.generate(PROMPT, max_new_tokens=20, temperature=0.8, seed=5, on_text=pieces.append)
    assert "".join(pieces) == streamed.text and len(pieces) > 1
    assert streamed.text == ar.generate(PROMPT, max_new_tokens=20, temperature=0.8, seed=5).text
    assert streamed.text != out.text


def test_conversation_keeps_the_history_of_complete_turns(tiny_dirs):
    """Conversation.send: each reply is generated over the whole history through the chat template (ChatML for a
    tokenizer without one) and appended with its user message; a turn interrupted in on_text is not kept; reset
    keeps only the system message."""
    target_dir, _ = tiny_dirs
    llm = api.load(target_dir, backend="numpy")
    conv = llm.chat(system="w5 w6")
    first = conv.send("w3 w17", max_new_tokens=6)
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    assert conv.messages[-1]["content"] == first.text
    same = llm.generate([{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w3 w17"}],
                        max_new_tokens=6)
    assert same.tokens == first.tokens
    second = conv.send("w42", max_new_tokens=6)
    assert second.prompt_tokens > first.prompt_tokens + len(first.tokens)   # the history is in the prompt
    assert len(conv.messages) == 5

    def stop(piece):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        conv.send("w8", max_new_tokens=6, on_text=stop)
    assert len(conv.messages) == 5
    with pytest.raises(ValueError, match="needs some text"):
        conv.send("  ")
    conv.reset()
    assert conv.messages == [{"role": "system", "content": "w5 w6"}]


def test_kept_cache_gives_the_same_turns(tiny_dirs):
    """A conversation keeps the KV caches between turns (the next turn prefills only its new tokens) and replies
    exactly as one that prefills every turn whole, for AR and for DDTree (whose drafter context is kept too)."""
    target_dir, draft_dir = tiny_dirs
    for draft, mode in ((None, "ar"), (draft_dir, "ddtree")):
        llm = api.load(target_dir, draft=draft, backend="numpy")
        # one kept cache per LLM (its engine): the fresh conversation runs on a second one
        kept, fresh = llm.chat(system="w5 w6"), api.load(target_dir, draft=draft, backend="numpy").chat(system="w5 w6")
        for text in ("w3 w17", "w42 w8", "w91"):
            a = kept.send(text, max_new_tokens=8, mode=mode, budget=8)
            b = fresh.send(text, max_new_tokens=8, mode=mode, budget=8, keep_cache=False)
            assert a.tokens == b.tokens, (mode, text)
            assert b.result.reused_tokens == 0
        assert a.result.reused_tokens > 0 and a.result.reused_tokens < a.prompt_tokens, mode
        assert kept.messages == fresh.messages
        # a prompt that shares nothing reuses nothing, and the answer is still the fresh one's
        other = llm.generate("w60 w61", max_new_tokens=6, mode=mode, budget=8, keep_cache=True)
        assert other.result.reused_tokens == 0
        assert other.tokens == llm.generate("w60 w61", max_new_tokens=6, mode=mode, budget=8).tokens


def test_bad_input_raises_clear_errors(tiny_dirs, tmp_path):
    target_dir, draft_dir = tiny_dirs
    with pytest.raises(LoadError, match="model path does not exist"):
        api.load(tmp_path / "nope", backend="numpy")
    with pytest.raises(LoadError, match="drafter directory does not exist"):
        api.load(target_dir, draft=tmp_path / "nope", backend="numpy")
    with pytest.raises(LoadError, match="DFlash drafter"):
        api.load(draft_dir, backend="numpy")
    with pytest.raises(LoadError, match="not a DFlash drafter"):
        api.load(target_dir, draft=target_dir, backend="numpy")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(LoadError, match="must be a .gguf"):
        api.load(tmp_path / "w.bin", backend="numpy")
    with pytest.raises(ValueError, match="backend must be one of"):
        api.load(target_dir, backend="tpu")
    llm = api.load(target_dir, backend="numpy")
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        llm.generate(PROMPT, mode="ddtree")
    with pytest.raises(ValueError, match="system message needs the chat template"):
        llm.encode(PROMPT, chat=False, system="be brief")
    with pytest.raises(ValueError, match="needs the chat template"):
        llm.encode([{"role": "user", "content": PROMPT}], chat=False)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([])
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate(PROMPT, max_new_tokens=0)


def test_cuda_backend_unavailable_without_a_gpu():
    from runtime.cuda import NoDeviceError, require_device
    try:
        require_device()
        pytest.skip("a CUDA device is usable here; this test covers the no-GPU error")
    except NoDeviceError:
        pass
    with pytest.raises(api.BackendUnavailable, match="no usable CUDA device"):
        api.select_backend("cuda")
    said = []
    assert api.select_backend("auto", said.append).name == "cpu"
    assert said and said[0].startswith("backend: cpu (bf16 weights, linear on ") and \
        "because no usable CUDA device" in said[0], said


def test_bad_cpu_isa_setting_is_a_backend_error():
    """DDTREE_CPU_ISA names a build to cap the cpu kernels at; a bad value fails the backend with the choices (a fresh
    interpreter: the module reads it once, on import)."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "from runtime import api; api.select_backend('cpu')"],
                       capture_output=True, text=True, env={**os.environ, "DDTREE_CPU_ISA": "sse9"})
    assert r.returncode != 0 and "BackendUnavailable: cpu backend: DDTREE_CPU_ISA='sse9': one of avx2, baseline" \
        in r.stderr, r.stderr


def test_default_model_chat_template_by_default():
    """The embedded SmolLM2-135M-Instruct: a question goes through its chat template unless chat=False; a message
    list and a system message are rendered by the same template."""
    need_default_model()
    said = []
    llm = api.load(backend="numpy", notice=said.append)
    assert llm.has_chat_template
    question = "Why is the sky blue?"
    ids = llm.encode(question)
    assert any("chat template" in s for s in said)
    assert ids == llm.encode([{"role": "user", "content": question}])
    assert len(ids) > len(llm.encode(question, chat=False))
    with_system = llm.encode(question, system="Answer in one word.")
    assert "Answer in one word." in llm.tokenizer.decode(with_system)
    out = llm.generate(question, max_new_tokens=6)
    assert len(out.text.split()) >= 3 and out.prompt_tokens == len(ids)
    assert np.all(np.asarray(out.tokens) >= 0)


def test_default_drafter_is_taken_on_cuda_only(tmp_path, monkeypatch):
    """load() with no model and no draft takes the trained default drafter where the backend is cuda (a numpy
    backend named "cuda" stands in here), leaves it out on numpy and cpu unless default_draft=True, never with
    False."""
    from runtime.backends.numpy_backend import NumpyBackend
    need_default_model()
    monkeypatch.setenv("DDTREE_DRAFTER_HOME", str(tmp_path))
    d = write_smollm2_drafter(api.default_drafter_dir())

    class CudaNamed(NumpyBackend):
        name = "cuda"
    said = []
    assert api.load(backend=CudaNamed(), notice=said.append).drafter is not None
    assert any(s.startswith(f"drafter: {d}") for s in said)
    said.clear()
    assert api.load(backend="numpy", notice=said.append).drafter is None
    assert any("left out on the numpy backend" in s for s in said)
    assert api.load(backend="numpy", default_draft=True).drafter is not None
    said.clear()
    assert api.load(backend="cpu", notice=said.append).drafter is None
    assert any("left out on the cpu backend" in s for s in said)
    assert api.load(backend=CudaNamed(), default_draft=False).drafter is None
