"""Shared fixtures. GPU tests take `cuda_device`: it skips them, with the reason, when no GPU is usable."""
import pytest


@pytest.fixture(scope="session")
def cuda_device():
    from runtime.cuda import NoDeviceError, require_device
    try:
        return require_device()
    except NoDeviceError as e:
        pytest.skip(f"no CUDA device: {e}")
