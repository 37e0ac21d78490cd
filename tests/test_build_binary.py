"""tools/build_binary.py: the standalone ddtree-run folder builds, and the built binary, run in a bare environment
from another directory, completes a prompt with the bundled SmolLM2 (numpy backend), decodes it with DDTree and the
bundled drafter, and compiles every kernel for sm_90a with its bundled NVRTC and headers (build_binary's own check,
which fails the build otherwise)."""
import json

import pytest


def test_standalone_binary_builds_and_runs(tmp_path):
    pytest.importorskip("PyInstaller", reason="PyInstaller not installed (pip install -e .[binary])")
    import loader
    from tools import build_binary
    from loader import save_safetensors
    from runtime.models.dflash import random_checkpoint
    draft = tmp_path / "drafter"               # a random-weight drafter of SmolLM2's shape (losslessness holds)
    draft.mkdir()
    config, weights = random_checkpoint(576, 30, 49152, taps=(1, 14, 27), block_size=4)
    (draft / "config.json").write_text(json.dumps(config))
    save_safetensors(draft / "model.safetensors", weights)
    try:
        loader.default_model_path()
        extra = ["--draft", str(draft)]
    except loader.LoadError:
        extra = ["--no-default-model"]     # still checks the kernel build
    assert build_binary.main(["--out", str(tmp_path / "dist")] + extra) == 0
    exe = tmp_path / "dist" / "ddtree-run" / "ddtree-run"
    assert exe.is_file() and (tmp_path / "dist" / "ddtree-run" / "_internal" / "cutlass_kernels").is_dir()
