"""Files on disk -> model spec + named weight arrays: safetensors (single/sharded, mmap), HF configs,
compressed-tensors INT4, DFlash drafters, GGUF (the embedded SmolLM2 default), tokenizers.

    spec = loader.load_config(model_dir)              # LlamaSpec | DeepseekV3Spec | DFlashSpec
    ckpt = loader.open_checkpoint(model_dir)          # lazy, mmap-backed
    spec, ckpt = loader.load_model(model_dir)         # both, checkpoint checked against the spec (or a .gguf)
    m = loader.load_gguf()                            # default SmolLM2-135M-Instruct: .spec .tensors .tokenizer
    tok = loader.load_tokenizer(model_dir_or_gguf)
"""
from __future__ import annotations

import os
from pathlib import Path

from . import int4
from .checkpoint import Checkpoint, SafetensorsFile, open_checkpoint, save_safetensors, to_float32
from .config import load_config
from .errors import LoadError
from .gguf_model import GGUFModel, default_model_path, load_gguf
from .int4 import register_int4_repacker, repack_int4_for_kernel, unpack_int4
from .names import expected_tensors, validate_checkpoint
from .spec import DeepseekV3Spec, DFlashSpec, LlamaSpec, ModelSpec, QuantSpec, RopeScaling
from .tokenizer import Tokenizer, load_tokenizer


def load_model(path: os.PathLike | str, validate: bool = True) -> tuple[ModelSpec, Checkpoint | GGUFModel]:
    """(spec, weights) of a model directory (config.json + safetensors) or a .gguf file (weights = the
    GGUFModel, whose .tensors are checked while loading). For safetensors with validate, a missing tensor or
    a dtype/shape that disagrees with the config is a LoadError and unused tensors give a warning."""
    path = Path(path)
    if path.suffix == ".gguf":
        m = load_gguf(path)
        return m.spec, m
    spec = load_config(path)
    ckpt = open_checkpoint(path)
    if validate:
        validate_checkpoint(spec, ckpt)
    return spec, ckpt


__all__ = [
    "LoadError", "load_config", "open_checkpoint", "Checkpoint", "SafetensorsFile", "save_safetensors",
    "to_float32", "load_model", "expected_tensors", "validate_checkpoint", "load_gguf", "GGUFModel",
    "default_model_path", "load_tokenizer", "Tokenizer", "int4", "unpack_int4", "register_int4_repacker",
    "repack_int4_for_kernel", "LlamaSpec", "DeepseekV3Spec", "DFlashSpec", "ModelSpec", "QuantSpec",
    "RopeScaling",
]
