"""Attention backend registry: selection by priority, refusal reasons, named requests, entry-point plug-ins."""

import sys
import textwrap

import pytest
import torch

from ember.attention_backends import registry
from ember.attention_backends.base import AttentionBackend, AttentionLayerOptions, CudaGraphSupport
from ember.attention_backends.registry import BackendSelectionError, get_backend, register_backend, select_backend
from ember.kv_spec import KVCacheSpec

SPEC = KVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
OPTS = [AttentionLayerOptions(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125)]
CPU = torch.device("cpu")


@pytest.fixture
def clean_registry():
    saved = dict(registry._factories), dict(registry._loaded)
    yield
    registry._factories.clear(); registry._factories.update(saved[0])
    registry._loaded.clear(); registry._loaded.update(saved[1])


def test_cpu_backend_is_selected_on_cpu_and_triton_refusal_is_reported(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sel = select_backend(SPEC, torch.float32, CPU, OPTS)
    assert sel.backend.name == "cpu_sdpa"
    assert "triton_unified" in sel.refused and sel.refused["triton_unified"], sel.refused


def test_named_backend_that_cannot_serve_raises_with_reasons(clean_registry):
    @register_backend("fp16_only")
    class Fp16Only(AttentionBackend):
        priority = 50

        @classmethod
        def supports(cls, spec, dtype, device, options=None):
            return [] if dtype == torch.float16 else [f"dtype {dtype} is not float16"]

    with pytest.raises(BackendSelectionError, match="fp16_only.*dtype torch.float32 is not float16"):
        select_backend(SPEC, torch.float32, CPU, OPTS, requested="fp16_only")
    # in auto mode it is passed over (lower-priority cpu_sdpa wins) and the reason is reported
    sel = select_backend(SPEC, torch.float32, CPU, OPTS)
    assert sel.backend.name == "cpu_sdpa"
    assert sel.refused["fp16_only"] == ["dtype torch.float32 is not float16"]
    # where it can serve, its higher priority wins
    spec16 = KVCacheSpec(16, 2, 64, torch.float16)
    assert select_backend(spec16, torch.float16, CPU, OPTS).backend is Fp16Only


def test_per_layer_options_are_checked(clean_registry):
    @register_backend("no_softcap")
    class NoSoftcap(AttentionBackend):
        priority = 50

        @classmethod
        def supports(cls, spec, dtype, device, options=None):
            return ["logit soft-capping is not supported"] if options and options.logits_soft_cap else []

    capped = [AttentionLayerOptions(4, 2, 64, 0.125, logits_soft_cap=30.0)]
    assert select_backend(SPEC, torch.float32, CPU, OPTS).backend is NoSoftcap
    sel = select_backend(SPEC, torch.float32, CPU, capped)
    assert sel.backend.name == "torch_ref" and sel.refused["no_softcap"] == ["logit soft-capping is not supported"]


def test_unknown_backend_name_lists_registered():
    with pytest.raises(BackendSelectionError, match=r"'nope' is not registered.*torch_ref"):
        get_backend("nope")


def test_entry_point_plugin_is_discovered(tmp_path, monkeypatch, clean_registry):
    pkg = tmp_path / "toy_ember_backend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from ember.attention_backends.base import AttentionBackend, CudaGraphSupport
        from ember.attention_backends.torch_ref import TorchRefBackend

        class ToyBackend(TorchRefBackend):
            '''A plug-in that reuses the reference kernels.'''
            priority = 99
            cudagraph_support = CudaGraphSupport.UNIFORM_BATCH
    """))
    dist = tmp_path / "toy_ember_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-ember-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[ember.attention_backends]\ntoy = toy_ember_backend:ToyBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.rescan_entry_points()
    assert "toy" in registry.available_backends()
    backend = get_backend("toy")
    assert backend.name == "toy" and backend.cudagraph_support == CudaGraphSupport.UNIFORM_BATCH
    assert select_backend(SPEC, torch.float32, CPU, OPTS).backend is backend
    sys.modules.pop("toy_ember_backend", None)
