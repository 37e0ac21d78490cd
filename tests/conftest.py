"""Shared fixtures. GPU tests take `cuda_device`: it skips them, with the reason, when no GPU is usable;
`dk` is runtime.dense_kernels on that device, `ref` the numpy backend (the float32 oracle)."""
import pytest


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
