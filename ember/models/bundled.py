"""Real public model configs bundled with ember (ember/configs/*.json), for random-weight benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from ember.models.config_snapshot import snapshot_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def bundled_config_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def bundled_config(name: str, **overrides):
    """The resolved config (a `ConfigSnapshot`) of a bundled model ("qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b",
    "llama-3.1-70b", "gemma-3-1b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"), with `overrides` applied before
    transformers builds it (so derived fields such as per-layer types follow them; fewer `num_hidden_layers` keep
    the first of a listed `layer_types`). `.to_transformers()` gives the transformers config."""
    path = CONFIG_DIR / f"{name.lower()}.json"
    if not path.is_file():
        raise ValueError(f"no bundled config {name!r}; bundled: {bundled_config_names()}")
    values = {**json.loads(path.read_text()), **overrides}
    if "num_hidden_layers" in overrides and "layer_types" in values and "layer_types" not in overrides:
        values["layer_types"] = values["layer_types"][:overrides["num_hidden_layers"]]

    def build():
        from transformers import AutoConfig
        return AutoConfig.for_model(**values)

    return snapshot_config(json.dumps(values, sort_keys=True), build)
