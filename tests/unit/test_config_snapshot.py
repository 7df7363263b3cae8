"""The resolved model config ember keeps between starts: equal to transformers' config on every attribute, read
back without importing transformers, rebuilt when its file is damaged or its config.json changes."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ember.models.bundled import bundled_config, bundled_config_names
from ember.models.config_snapshot import ConfigSnapshot, snapshot_config, snapshot_path
from ember.models.loader import CheckpointError, load_config


def _plain(value):
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return json.loads(json.dumps(value, default=str))


def _public_values(config) -> dict:
    values = {}
    for name in dir(config):
        if name.startswith("_") or name == "torch_dtype":
            continue
        try:
            value = getattr(config, name)
        except (AttributeError, NotImplementedError, ValueError):
            continue
        if not callable(value):
            values[name] = _plain(value)
    return values


@pytest.mark.parametrize("name", bundled_config_names())
def test_snapshot_reads_like_the_transformers_config(name, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    snapshot = bundled_config(name, num_hidden_layers=6)
    real = snapshot.to_transformers()
    assert isinstance(snapshot, ConfigSnapshot) and type(real).__name__.endswith("Config")
    expected = _public_values(real)
    seen = {k: _plain(getattr(snapshot, k)) for k in expected if hasattr(snapshot, k)}
    # every attribute a model reads is there with the same value; the rest are transformers' own runtime flags
    assert {k: expected[k] for k in seen} == seen
    missing = set(expected) - set(seen)
    assert not missing & {"hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "rope_parameters",
                          "rope_scaling", "layer_types", "sliding_window", "tie_word_embeddings", "architectures",
                          "rms_norm_eps", "vocab_size", "dtype", "model_type"}
    assert snapshot.rope_scaling == real.rope_scaling and snapshot.num_hidden_layers == 6
    again = bundled_config(name, num_hidden_layers=6)       # read from the snapshot file this time
    assert again.to_dict() == snapshot.to_dict()


def test_second_build_reads_the_file_and_a_damaged_file_is_rebuilt(tmp_path, caplog):
    calls = []

    def build():
        calls.append(1)
        return bundled_config("qwen3-0.6b", num_hidden_layers=2).to_transformers()

    first = snapshot_config("source-a", build, tmp_path)
    second = snapshot_config("source-a", build, tmp_path)
    assert len(calls) == 1 and second.to_dict() == first.to_dict()
    path = snapshot_path("source-a", tmp_path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])            # a truncated write
    with caplog.at_level(logging.WARNING, logger="ember"):
        third = snapshot_config("source-a", build, tmp_path)
    assert len(calls) == 2 and third.to_dict() == first.to_dict()
    assert "cannot be read" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text()) == first.to_dict()     # the file was written again, whole
    snapshot_config("source-b", build, tmp_path)                # other values, another file
    assert len(calls) == 3


def test_folder_config_follows_its_config_json(tmp_path):
    folder, cache = tmp_path / "model", tmp_path / "cache"
    folder.mkdir()
    values = json.loads((bundled_config.__globals__["CONFIG_DIR"] / "llama-3.2-1b.json").read_text())
    (folder / "config.json").write_text(json.dumps(values))
    assert load_config(folder, cache).num_hidden_layers == 16
    (folder / "config.json").write_text(json.dumps({**values, "num_hidden_layers": 3}))
    assert load_config(folder, cache).num_hidden_layers == 3
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read as a model config"):
        load_config(folder, cache)
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-family"}))
    with pytest.raises(CheckpointError, match="cannot be read as a model config"):
        load_config(folder, cache)


def test_warm_load_imports_no_transformers(tmp_path):
    """In a fresh process whose cache holds the snapshots, neither a bundled config nor a folder's config imports
    transformers."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text((bundled_config.__globals__["CONFIG_DIR"] / "qwen3-0.6b.json").read_text())
    code = textwrap.dedent(f"""
        import sys
        from ember.models.bundled import bundled_config
        from ember.models.loader import load_config
        a, b = bundled_config("qwen3-0.6b"), load_config({str(folder)!r})
        print(a.num_hidden_layers, b.head_dim, "transformers" in sys.modules)
    """)
    env = {**os.environ, "EMBER_CACHE": str(tmp_path / "cache")}
    cold = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    warm = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert cold.stdout.split() == ["28", "128", "True"], cold.stderr
    assert warm.stdout.split() == ["28", "128", "False"], warm.stderr
