"""Model definitions, each written once against the backend interface (runtime.backends.base)."""
from loader.spec import DeepseekV3Spec, DFlashSpec, LlamaSpec

from .deepseek_v3 import DeepseekV3Model
from .dflash import DFlashDrafter
from .llama import LlamaModel


def build_model(spec, weights, backend):
    """The model class for `spec` (a loader.spec dataclass), loaded from `weights` onto `backend`."""
    if isinstance(spec, LlamaSpec):
        return LlamaModel(spec, weights, backend)
    if isinstance(spec, DeepseekV3Spec):
        return DeepseekV3Model(spec, weights, backend)
    if isinstance(spec, DFlashSpec):
        return DFlashDrafter(spec, weights, backend)
    raise TypeError(f"no model for spec {type(spec).__name__}")


__all__ = ["build_model", "LlamaModel", "DeepseekV3Model", "DFlashDrafter"]
