"""Refuse a model folder whose architecture ember does not implement, before any weight loads."""

from __future__ import annotations


def check_architecture(path, trust_remote_code: bool = False) -> None:
    """Refuse a model folder whose config.json names no architecture ember implements, before loading weights.
    `trust_remote_code` cannot help: ember runs its own model code, never code shipped with a checkpoint."""
    import json
    from pathlib import Path

    from ember.models.registry import supported_architectures
    config = Path(path) / "config.json"
    if not config.is_file():
        return          # the loader reports a folder without config.json
    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError):
        return          # the loader reports a config.json it cannot read
    if not isinstance(parsed, dict):
        return
    architectures = parsed.get("architectures") or []
    supported = supported_architectures()
    if any(a in supported for a in architectures):
        return
    why = (" trust_remote_code=True does not change that: ember runs only its own model implementations, never "
           "code shipped with a checkpoint." if trust_remote_code else "")
    raise ValueError(f"model architecture {architectures or None} in {config} is not implemented in ember; "
                     f"supported: {', '.join(supported)}.{why}")
