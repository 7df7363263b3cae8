"""The weight loader: meta-device build, packed shards, dtype and device, and errors that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.models.loader import CheckpointError, checkpoint_files, load_config, load_model
from tests.helpers.model_harness import random_hf_model, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny untied Llama saved as one safetensors file, and its tensors."""
    path = tmp_path_factory.mktemp("llama")
    random_hf_model(tiny_config("llama"), seed=7).save_pretrained(path)
    return path, load_file(path / "model.safetensors")


def copy_with(saved, tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """The saved folder's config with `tensors` as its only weights file."""
    src, _ = saved
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def test_loads_in_the_requested_dtype_without_meta_tensors(saved):
    path, tensors = saved
    model = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"), progress=False)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"].bfloat16())
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].bfloat16())
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q.bfloat16())
    assert model.model.rotary_emb.cos_sin_cache.shape == (256, 16)
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_plain_tensors_are_assigned_not_copied(saved, monkeypatch):
    """A plain parameter takes the checkpoint tensor itself (same storage) when dtype and device already match."""
    import safetensors

    path, _ = saved
    seen = {}
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            seen[name] = self.f.get_tensor(name)
            return seen[name]

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    model = load_model(path, None, torch.float32, "cpu", progress=False)
    assert model.model.norm.weight.data_ptr() == seen["model.norm.weight"].data_ptr()
    assert model.lm_head.weight.data_ptr() == seen["lm_head.weight"].data_ptr()


def test_tied_checkpoint_with_a_redundant_lm_head_loads(tmp_path):
    hf = random_hf_model(tiny_config("qwen3"))
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)   # older exports carry these
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, None, torch.float32, "cpu", progress=False)
    assert model.lm_head.tied
    hidden = torch.randn(3, 64)
    assert torch.equal(model.compute_logits(hidden), hidden @ tensors["model.embed_tokens.weight"].T)


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*config.json"):
        load_config(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, None, torch.float32, "cpu")


def test_folder_without_weights(saved, tmp_path):
    (tmp_path / "config.json").write_text((saved[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*safetensors"):
        load_model(tmp_path, None, torch.float32, "cpu")


def test_index_naming_an_absent_shard(saved, tmp_path):
    path = copy_with(saved, tmp_path, saved[1])
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        checkpoint_files(path)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                  "model.layers.1.post_attention_layernorm.weight", "lm_head.weight"])
def test_missing_tensor_is_named(saved, tmp_path, name):
    tensors = {k: v for k, v in saved[1].items() if k != name}
    path = copy_with(saved, tmp_path, tensors)
    with pytest.raises(CheckpointError, match=f"missing tensor.*'{name}'"):
        load_model(path, None, torch.float32, "cpu", progress=False)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.v_proj.weight", "model.embed_tokens.weight",
                                  "model.layers.1.mlp.gate_proj.weight"])
def test_misshaped_tensor_is_named_with_both_shapes(saved, tmp_path, name):
    tensors = dict(saved[1])
    good = tuple(tensors[name].shape)
    tensors[name] = torch.zeros(good[0] + 1, good[1])
    path = copy_with(saved, tmp_path, tensors)
    bad = (good[0] + 1, good[1])
    with pytest.raises(CheckpointError) as info:
        load_model(path, None, torch.float32, "cpu", progress=False)
    message = str(info.value)
    assert name in message and str(bad) in message and str(good) in message


def test_unexpected_tensor_is_named(saved, tmp_path):
    tensors = dict(saved[1])
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)   # Qwen3's, not Llama's
    path = copy_with(saved, tmp_path, tensors)
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.q_norm.weight"):
        load_model(path, None, torch.float32, "cpu", progress=False)


def test_unknown_architecture_is_named(saved, tmp_path):
    path = copy_with(saved, tmp_path, saved[1])
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["BloomForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="BloomForCausalLM.*supported.*Qwen3ForCausalLM"):
        load_model(path, load_config(path), torch.float32, "cpu")


def test_loading_imports_no_sympy(saved):
    """Giving meta parameters storage does not go through torch's Python references, whose import of sympy cost a
    CPU start that imports neither otherwise (0.76 s); checked in a fresh process."""
    import subprocess
    import sys
    path, _ = saved
    code = ("import sys, torch\n"
            "from ember.models.loader import load_config, load_model, random_model\n"
            f"config = load_config({str(path)!r})\n"
            f"load_model({str(path)!r}, config, torch.float32, torch.device('cpu'))\n"
            "random_model(config, torch.float32, 'cpu')\n"
            "print('SYMPY', 'sympy' in sys.modules)\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SYMPY False" in done.stdout, done.stdout[-2000:]
