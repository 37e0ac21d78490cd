"""The CUDA backend and the graph-captured engine on a CPU stand-in for the GPU (tests/fake_cuda.py): the
GPU tests of test_cuda_engine.py, run in CPU CI for the plumbing (views, lazy fusions, bound prefixes, the
device state block, capture and replay, commit plans). Kernel numerics are checked on the GPU."""
import gc

import pytest

import test_cuda_engine as gpu_tests
from fake_cuda import install
from loader.testing import write_tiny_model


@pytest.fixture
def backend_cls(monkeypatch):
    install(monkeypatch)
    from runtime.backends.cuda_backend import CudaBackend
    yield CudaBackend
    gc.collect()        # fake buffers are released while the fake driver is still in place


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_tiny")
    write_tiny_model(root / "qwen3", gpu_tests.QWEN3, seed=0)
    write_tiny_model(root / "llama", gpu_tests.LLAMA, seed=1)
    write_tiny_model(root / "draft", gpu_tests.drafter_config(gpu_tests.QWEN3), seed=2)
    return root


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_logits_match_numpy(backend_cls, tiny_dirs, kind):
    gpu_tests.test_logits_match_numpy(backend_cls(), tiny_dirs, kind)


def test_ddtree_equals_ar_every_bucket(backend_cls, tiny_dirs):
    gpu_tests.test_ddtree_equals_ar_every_bucket(backend_cls(), tiny_dirs)


def test_eager_cuda_engine_matches_graphs(backend_cls, tiny_dirs):
    gpu_tests.test_eager_cuda_engine_matches_graphs(tiny_dirs, None)


def test_sampled_ddtree_equals_ar(backend_cls, tiny_dirs):
    gpu_tests.test_sampled_ddtree_equals_ar(backend_cls(), tiny_dirs)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_fused_prologues_at_verify_sizes(backend_cls, tiny_dirs, kind, monkeypatch):
    gpu_tests.test_fused_prologues_at_verify_sizes(backend_cls(), tiny_dirs, kind, monkeypatch)
