"""tools/build_binary.py: the standalone ddtree-run folder builds, and the built binary, run in a bare environment
from another directory, completes a prompt with the bundled SmolLM2 (cpu backend), decodes it with DDTree and the
bundled drafter, and compiles every kernel for sm_90a with its bundled NVRTC and headers (build_binary's own check,
which fails the build otherwise)."""

import pytest


def test_standalone_binary_builds_and_runs(tmp_path):
    pytest.importorskip("PyInstaller", reason="PyInstaller not installed (pip install -e .[binary])")
    import loader
    from tools import build_binary
    from test_ddtree_run import write_smollm2_drafter
    draft = write_smollm2_drafter(tmp_path / "drafter")
    try:
        loader.default_model_path()
        extra = ["--draft", str(draft)]
    except loader.LoadError:
        extra = ["--no-default-model"]     # still checks the kernel build
    assert build_binary.main(["--out", str(tmp_path / "dist")] + extra) == 0
    exe = tmp_path / "dist" / "ddtree-run" / "ddtree-run"
    assert exe.is_file() and (tmp_path / "dist" / "ddtree-run" / "_internal" / "cutlass_kernels").is_dir()
