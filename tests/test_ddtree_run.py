"""ddtree-run: exit codes and messages for bad input, and end-to-end runs (embedded SmolLM2 default; a tiny HF
target directory with a DFlash drafter directory, DDTree output == AR output, greedy and sampled)."""
import json

import numpy as np
import pytest

from loader import save_safetensors
from tools.ddtree_run import EXIT_BACKEND, EXIT_USAGE, main
from test_models import VOCAB, hf_tiny, tiny_drafter_checkpoint


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_missing_model_path(tmp_path, capsys):
    code, _, err = run_cli(["--model", str(tmp_path / "nope"), "hi"], capsys)
    assert code == EXIT_USAGE and "model path does not exist" in err


def test_bad_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    code, _, err = run_cli(["--backend", "numpy", "--model", str(bad), "hi"], capsys)
    assert code == EXIT_USAGE and "cannot load" in err and "GGUF" in err and str(bad) in err
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    code, _, err = run_cli(["--backend", "numpy", "--model", str(truncated), "hi"], capsys)
    assert code == EXIT_USAGE and "cannot load" in err


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_bad_budget(value, capsys):
    code, _, err = run_cli(["--budget", value, "hi"], capsys)
    assert code == EXIT_USAGE and "--budget" in err


@pytest.mark.parametrize("value", ["-1", str(2**64), "x"])
def test_bad_seed(value, capsys):
    code, _, err = run_cli(["--seed", value, "hi"], capsys)
    assert code == EXIT_USAGE and "--seed" in err


def test_ddtree_mode_needs_drafter(capsys):
    code, _, err = run_cli(["--mode", "ddtree", "hi"], capsys)
    assert code == EXIT_USAGE and "needs a DFlash drafter" in err


def test_cuda_backend_without_gpu(capsys):
    from runtime.cuda import NoDeviceError, require_device
    try:
        require_device()
        pytest.skip("a CUDA device is usable here; this test covers the no-GPU message")
    except NoDeviceError:
        pass
    code, _, err = run_cli(["--backend", "cuda", "hi"], capsys)
    assert code == EXIT_BACKEND and "--backend cuda" in err and "no usable CUDA device" in err


def test_default_model_runs(capsys):
    need_default_model()
    code, out, err = run_cli(["--backend", "numpy", "--max-new-tokens", "3", "--stats", "--no-chat",
                              "The capital of France is"], capsys)
    assert code == 0, err
    assert "Paris" in out
    assert "decoding autoregressively" in err and "tokens/s" in err and "chat template" not in err


def test_default_model_answers_a_question_through_its_chat_template(capsys, monkeypatch):
    """An instruct model's chat template is applied by default: SmolLM2-Instruct given the raw question stops at
    once (its first token is the end of turn), through the template it answers. The prompt may come from stdin."""
    import io
    need_default_model()
    args = ["--backend", "numpy", "--max-new-tokens", "8", "--stats"]
    code, out, err = run_cli(args + ["Why is the sky blue?"], capsys)
    assert code == 0, err
    assert "prompt wrapped in the model's chat template" in err
    assert len(out.split()) >= 4 and "generated 8" in err, (out, err)
    monkeypatch.setattr("sys.stdin", io.StringIO("Why is the sky blue?\n"))
    code, piped, err = run_cli(args + ["-"], capsys)
    assert code == 0 and piped == out, (piped, out, err)
    code, raw, err = run_cli(args + ["--no-chat", "Why is the sky blue?"], capsys)
    assert code == 0 and "chat template" not in err
    assert raw != out


def test_interactive_chat_remembers_until_reset(capsys, monkeypatch):
    """ddtree-run -i on the embedded SmolLM2: one message per stdin line, the second answer uses the first turn,
    /reset forgets it, /exit ends; --no-chat is refused."""
    import io
    need_default_model()
    code, _, err = run_cli(["-i", "--no-chat"], capsys)
    assert code == EXIT_USAGE and "--interactive needs the chat template" in err
    lines = "What is the capital of France?\nAnd of Germany?\n\n/reset\nAnd of Germany?\n/exit\nnot read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code, out, err = run_cli(["--backend", "numpy", "-i", "--system", "Answer in one short sentence.",
                              "--max-new-tokens", "12"], capsys)
    assert code == 0, err
    replies = out.strip().split("\n")
    assert len(replies) == 3, out
    assert "Paris" in replies[0] and "Berlin" in replies[1], out
    assert replies[2] != replies[1] and "conversation reset" in err


def write_smollm2_drafter(folder, block_size: int = 4):
    """A random-weight DFlash drafter of SmolLM2-135M's shape (taps 1 / 14 / 27) written into folder (made here):
    losslessness does not depend on the drafter's weights."""
    from loader import save_safetensors
    from runtime.models.dflash import random_checkpoint
    folder.mkdir(parents=True)
    config, weights = random_checkpoint(576, 30, 49152, taps=(1, 14, 27), block_size=block_size)
    (folder / "config.json").write_text(json.dumps(config))
    save_safetensors(folder / "model.safetensors", weights)
    return folder


def need_default_model():
    import loader
    try:
        loader.default_model_path()
    except Exception as e:
        pytest.skip(f"default SmolLM2 GGUF not available: {e}")


def test_default_model_takes_its_trained_drafter(tmp_path, capsys, monkeypatch):
    """With no --model and no --draft, a drafter in runtime.api.default_drafter_dir() is used on cuda (not tested
    here), left out with a notice on numpy unless --mode ddtree asks for it; --no-draft never; the output is the
    same (lossless)."""
    from runtime import api
    need_default_model()
    monkeypatch.setenv("DDTREE_DRAFTER_HOME", str(tmp_path))
    d = write_smollm2_drafter(api.default_drafter_dir(), block_size=8)
    args = ["--backend", "numpy", "--max-new-tokens", "6", "--budget", "4", "--stats", "--no-chat",
            "The capital of France is"]
    code, ar_out, err = run_cli(args, capsys)       # numpy: left out (DDTree is slower than AR on a CPU), said so
    assert code == 0 and "left out on the numpy backend" in err and "mode ar" in err, err
    code, dd_out, err = run_cli(["--mode", "ddtree"] + args, capsys)
    assert code == 0 and f"drafter: {d}" in err and "mode ddtree" in err, err
    assert dd_out == ar_out
    code, _, err = run_cli(["--no-draft"] + args, capsys)
    assert code == 0 and "mode ar" in err and "drafter" not in err, err
    code, _, err = run_cli(["--no-draft", "--mode", "ddtree", "x"], capsys)
    assert code == EXIT_USAGE and "needs a DFlash drafter" in err
    code, _, err = run_cli(["--no-draft", "--draft", str(d), "x"], capsys)
    assert code == EXIT_USAGE and "--draft and --no-draft" in err


def test_build_kernels_ahead_of_time(capsys):
    """--build-kernels ARCH compiles every kernel family for that arch into the cache (NVRTC, no GPU needed; the
    same shared cache test_kernel_build reads), then exits 0 without a prompt or a model; a bad arch is refused."""
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    code, out, err = run_cli(["--build-kernels", "90a"], capsys)
    assert code == 0, err
    n = sum(1 for f in FAMILIES.values() if f.targets("90a"))
    assert f"{n} kernel modules ready, 0 failed" in err and out == ""
    assert len(list((nvrtc.cache_dir() / nvrtc.nvrtc_version() / "90a").glob("*.cubin"))) >= n
    code, _, err = run_cli(["--build-kernels", "sm_80"], capsys)
    assert code == EXIT_USAGE and "unsupported CUDA arch '80'" in err


def test_prompt_from_stdin_refuses_a_terminal_and_empty_input(capsys, monkeypatch):
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stdin", Tty(""))
    code, _, err = run_cli(["--backend", "numpy"], capsys)
    assert code == EXIT_USAGE and "no prompt" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    code, _, err = run_cli(["--backend", "numpy", "-"], capsys)
    assert code == EXIT_USAGE and "prompt read from stdin is empty" in err


def test_load_progress_is_quiet_for_quick_loads_and_reports_slow_ones(monkeypatch):
    """The model-load progress (runtime.api.LoadProgress): nothing for a load under QUIET_S; past it, a line per
    EVERY_S with the layer reached, and the total at the end. runtime.models.common.Weights calls it once per
    layer, at the layer's first tensor."""
    from runtime import api
    from runtime.models.common import Weights
    clock, lines = [0.0], []
    monkeypatch.setattr(api.time, "perf_counter", lambda: clock[0])
    quick = api.LoadProgress("m.gguf", 30, lines.append)
    for i in range(30):
        clock[0] += 0.01
        quick(i)
    quick.done()
    assert lines == []
    clock[0] = 0.0
    slow = api.LoadProgress("big", 36, lines.append)
    w = Weights({f"model.layers.{i}.{n}": np.zeros(2, np.float32) for i in range(36) for n in ("a", "b")}
                | {"model.norm.weight": np.zeros(2, np.float32)}, on_layer=slow)
    for i in range(36):
        clock[0] += 1.0
        for n in ("a", "b"):
            w.get(f"model.layers.{i}.{n}")
    w.get("model.norm.weight")
    slow.done()
    assert lines[0] == "loading big: layer 2/36 (2 s)", lines
    assert lines[1] == "loading big: layer 7/36 (7 s)", lines
    assert len(lines) == 8 and lines[-1] == "loaded big in 36.0 s", lines


def tiny_model_dirs(root):
    """(target dir, drafter dir) under root: a tiny HF llama with a word-level tokenizer ("w0".."w96", no chat
    template) and a DFlash drafter checkpoint for it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    _, target = hf_tiny("llama", root)
    target_dir = root / "llama"
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.save(str(target_dir / "tokenizer.json"))
    config, weights = tiny_drafter_checkpoint(target, taps=(0, 2))
    draft_dir = root / "draft"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps(config))
    save_safetensors(draft_dir / "model.safetensors", weights)
    return target_dir, draft_dir


def test_target_dir_with_drafter_dir(tmp_path, capsys):
    target_dir, draft_dir = tiny_model_dirs(tmp_path)
    prompt = "w3 w17 w42 w8 w91"
    common = ["--backend", "numpy", "--model", str(target_dir), "--max-new-tokens", "24", prompt]
    code, ar_out, err = run_cli(["--mode", "ar"] + common, capsys)
    assert code == 0, err
    code, dd_out, err = run_cli(["--draft", str(draft_dir), "--budget", "16", "--stats"] + common, capsys)
    assert code == 0, err
    assert "mode ddtree" in err and "per round" in err
    assert "chat template" not in err            # a tokenizer without a chat template: raw completion
    assert dd_out == ar_out and len(ar_out.split()) == 24
    code, stream_out, err = run_cli(["--draft", str(draft_dir), "--stream"] + common, capsys)
    assert code == 0 and stream_out.split() == ar_out.split()
    # sampled: one seed, the same text from ar and ddtree (position-keyed sampling)
    sampled = ["--temperature", "0.9", "--seed", "3"] + common
    code, ar_sampled, err = run_cli(["--mode", "ar"] + sampled, capsys)
    assert code == 0, err
    code, dd_sampled, err = run_cli(["--draft", str(draft_dir), "--budget", "16"] + sampled, capsys)
    assert code == 0, err
    assert dd_sampled == ar_sampled and ar_sampled != ar_out
    # a target passed as the drafter is refused with a message
    code, _, err = run_cli(["--draft", str(target_dir)] + common, capsys)
    assert code == EXIT_USAGE and "not a DFlash drafter" in err
