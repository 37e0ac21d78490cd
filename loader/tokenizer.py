"""Tokenizers: an HF tokenizer.json (through the `tokenizers` package) or the byte-level BPE embedded in a
GGUF file (rebuilt as a `tokenizers` BPE from the vocab, merges and token types in its metadata).

Chat: `apply_chat_template` renders the model's own Jinja template the way transformers does (sandboxed,
trim_blocks/lstrip_blocks) when jinja2 is installed; without jinja2, or when a model has no template, the
built-in ChatML (SmolLM2/Qwen style) is used only if the model's template is ChatML or absent."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

from .errors import LoadError

CHATML_SYSTEM_SMOLLM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre` (the split llama.cpp applies before byte-level BPE).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class Tokenizer:
    """encode/decode around a `tokenizers.Tokenizer`, plus the ids and chat template the engine needs."""

    def __init__(self, tok, *, bos_token_id: Optional[int], eos_token_ids: Sequence[int], add_bos: bool,
                 chat_template: Optional[str], source: str, handles_bos: bool = False):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source
        self._handles_bos = handles_bos    # True when the tokenizer.json post-processor adds BOS itself

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their ids.
        BOS is prepended when the model asks for it and add_special_tokens is True."""
        if self._handles_bos:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a list of {'role', 'content'} messages."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat messages need 'role' and 'content', got {m!r}")
        if self.chat_template:
            try:
                return _render_jinja(self.chat_template, messages, add_generation_prompt,
                                     self._special(self.bos_token_id), self._special(self.eos_token_ids[0]
                                                                                     if self.eos_token_ids else None),
                                     self.source)
            except ImportError:
                if "<|im_start|>" not in self.chat_template:
                    raise LoadError("rendering this model's chat template needs jinja2 (pip install jinja2)",
                                    self.source, "chat_template") from None
        return chatml(messages, add_generation_prompt,
                      default_system=CHATML_SYSTEM_SMOLLM if self.chat_template and
                      CHATML_SYSTEM_SMOLLM in self.chat_template else None)

    def _special(self, i: Optional[int]) -> str:
        return "" if i is None else (self._tok.id_to_token(i) or "")


def chatml(messages: Sequence[dict], add_generation_prompt: bool = True,
           default_system: Optional[str] = None) -> str:
    """ChatML: <|im_start|>{role}\\n{content}<|im_end|>\\n per message; default_system is inserted first when
    the conversation has no system message (SmolLM2's template does this)."""
    out = []
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _render_jinja(template: str, messages, add_generation_prompt: bool, bos: str, eos: str, source: str) -> str:
    """The template rendered in jinja2's sandbox. A template that does not parse is a LoadError (a bad file); one
    that refuses these messages (raise_exception, e.g. "roles must alternate", or an error while rendering) is a
    ValueError naming the template's reason."""
    from jinja2.exceptions import TemplateError, TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateSyntaxError as e:
        raise LoadError(f"the chat template does not parse: {e}", source, "chat_template") from None
    try:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token=eos)
    except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"the model's chat template refused these messages: {e}") from None


# ---------------------------------------------------------------------------------------------------------

def load_tokenizer(path: os.PathLike | str) -> Tokenizer:
    """From a model directory / tokenizer.json (HF) or a .gguf file."""
    p = Path(path)
    if p.suffix == ".gguf":
        from .gguf_model import read_gguf
        return tokenizer_from_gguf(read_gguf(p), p)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise LoadError("tokenizer.json not found", p)
    return _tokenizer_from_hf(p)


def _read_json(p: Path) -> dict:
    if not p.is_file():
        return {}
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"not valid JSON: {e}", p) from None
    return d if isinstance(d, dict) else {}


def _tokenizer_from_hf(p: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(p))
    except Exception as e:   # tokenizers raises a bare Exception on bad files
        raise LoadError(f"cannot read tokenizer: {e}", p) from None
    folder = p.parent
    cfg = _read_json(folder / "tokenizer_config.json")
    gen = _read_json(folder / "generation_config.json")
    model_cfg = _read_json(folder / "config.json")

    def token_id(tok_entry):
        if isinstance(tok_entry, dict):
            tok_entry = tok_entry.get("content")
        return tok.token_to_id(tok_entry) if isinstance(tok_entry, str) else None

    bos = token_id(cfg.get("bos_token"))
    if bos is None:
        bos = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
    eos: list[int] = []
    for src in (gen.get("eos_token_id"), model_cfg.get("eos_token_id"), token_id(cfg.get("eos_token"))):
        for e in (src if isinstance(src, list) else [src]):
            if isinstance(e, int) and e not in eos:
                eos.append(e)
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):   # named templates: take "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return Tokenizer(tok, bos_token_id=bos, eos_token_ids=eos, add_bos=bool(cfg.get("add_bos_token", False)),
                     chat_template=template, source=str(p), handles_bos=True)


def tokenizer_from_gguf(reader, path) -> Tokenizer:
    """The byte-level BPE of a GGUF file's tokenizer.ggml.* metadata as a `tokenizers` Tokenizer."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from .gguf_model import field_value

    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise LoadError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')", path,
                        "tokenizer.ggml.model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = field_value(reader, "tokenizer.ggml.merges")
    types = field_value(reader, "tokenizer.ggml.token_type")
    if not tokens or merges is None:
        raise LoadError("GGUF lacks tokenizer.ggml.tokens/merges", path, "tokenizer.ggml.tokens")
    if types is None:
        types = [1] * len(tokens)
    if len(types) != len(tokens):
        raise LoadError(f"{len(types)} token types for {len(tokens)} tokens", path, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise LoadError(f"bad merge {m!r}", path, "tokenizer.ggml.merges")
        pairs.append((a, b))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    pre = field_value(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2", "gpt-2"):
        splits = [pre_tokenizers.Split(Regex(GPT2_REGEX), behavior="isolated")]
    elif pre == "smollm":
        splits = [pre_tokenizers.Digits(individual_digits=True),
                  pre_tokenizers.Split(Regex(GPT2_REGEX), behavior="isolated")]
    elif pre in ("llama-bpe", "llama3"):
        splits = [pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated")]
    else:
        raise LoadError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: default, gpt2, smollm, llama-bpe)",
                        path, "tokenizer.ggml.pre")
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [byte_level])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=(t == TOKEN_CONTROL), normalized=False)
             for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = [int(e) for e in (eos, eot) if e is not None]
    return Tokenizer(tok, bos_token_id=None if bos is None else int(bos), eos_token_ids=list(dict.fromkeys(eos_ids)),
                     add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
                     chat_template=field_value(reader, "tokenizer.chat_template"), source=str(path))
