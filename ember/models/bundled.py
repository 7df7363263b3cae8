"""Real public model configs bundled with ember (ember/configs/*.json), for random-weight benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def bundled_config_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def bundled_config(name: str, **overrides):
    """The transformers config of a bundled model ("qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "gemma-3-1b"), with
    `overrides` applied before it is built (so derived fields such as per-layer types follow them)."""
    path = CONFIG_DIR / f"{name.lower()}.json"
    if not path.is_file():
        raise ValueError(f"no bundled config {name!r}; bundled: {bundled_config_names()}")
    from transformers import AutoConfig
    values = {**json.loads(path.read_text()), **overrides}
    return AutoConfig.for_model(**values)
