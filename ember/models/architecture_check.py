"""Refuse a model folder that neither ember's own models nor the transformers fallback can run, before any weight
loads."""

from __future__ import annotations


def check_architecture(path, trust_remote_code: bool = False, model_impl: str = "auto") -> None:
    """Refuse a model folder whose config.json names an architecture that `model_impl` cannot run: one ember does
    not implement ("ember"), or one the transformers fallback cannot run ("transformers", and "auto" without a
    native implementation), with the reason. `trust_remote_code` cannot help: ember runs its own model code or
    transformers' library classes, never code shipped with a checkpoint."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from ember.models.registry import check_model_impl, native_architecture, supported_architectures, uses_fallback
    check_model_impl(model_impl)
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
    why = (" trust_remote_code=True does not change that: ember runs only its own model implementations and "
           "transformers' library classes, never code shipped with a checkpoint." if trust_remote_code else "")
    names = SimpleNamespace(architectures=architectures)
    if not uses_fallback(names, model_impl):
        if native_architecture(names) is None:
            raise ValueError(f"model architecture {architectures or None} in {config} is not implemented in ember; "
                             f"supported: {', '.join(supported_architectures())}; model_impl='auto' or "
                             f"'transformers' runs it through transformers if it can.{why}")
        return
    from ember.models.fallback_check import fallback_refusal
    from ember.models.loader import CheckpointError, load_config
    try:
        reason = fallback_refusal(load_config(path))
    except CheckpointError:
        return          # the loader reports a config it cannot build
    if reason is None:
        return
    if native_architecture(names) is not None:
        raise ValueError(f"model architecture {architectures or None} in {config} cannot run through the "
                         f"transformers fallback: {reason}. ember implements {native_architecture(names)} itself: "
                         f"model_impl='ember' or 'auto' runs that.{why}")
    raise ValueError(f"model architecture {architectures or None} in {config} is not implemented in ember "
                     f"(supported: {', '.join(supported_architectures())}) and cannot run through the transformers "
                     f"fallback: {reason}.{why}")
