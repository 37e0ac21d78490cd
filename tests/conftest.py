"""Shared fixtures. GPU tests take `cuda_device`: it skips them, with the reason, when no GPU is usable;
`dk` is runtime.dense_kernels on that device, `ref` the numpy backend (the float32 oracle)."""
import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def no_default_drafter(tmp_path_factory):
    """A drafter trained into the developer's ~/.cache (tools/train_dflash.py) must not change what the tests of
    the default model see: runtime.api looks for it under an empty folder here."""
    os.environ["DDTREE_DRAFTER_HOME"] = str(tmp_path_factory.mktemp("drafters"))


@pytest.fixture(scope="session")
def cuda_device():
    from runtime.cuda import NoDeviceError, require_device
    try:
        return require_device()
    except NoDeviceError as e:
        pytest.skip(f"no CUDA device: {e}")


@pytest.fixture(scope="module")
def dk(cuda_device):
    import runtime.dense_kernels as dk
    return dk


@pytest.fixture(scope="module")
def ref():
    from runtime.backends.numpy_backend import NumpyBackend
    return NumpyBackend()
