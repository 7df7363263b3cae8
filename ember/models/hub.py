"""Hugging Face hub ids ("org/name") to local model folders, through `huggingface_hub`: the local hub cache
first, then a download when the network is allowed."""

from __future__ import annotations

import os
import re
from pathlib import Path

# what ember reads from a model repository: config, safetensors weights, tokenizer files
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
# a tokenizer on its own: the same files without the weights
TOKENIZER_PATTERNS = [p for p in ALLOW_PATTERNS if p != "*.safetensors"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubModelError(ValueError):
    """A hub id could not be resolved to a local folder; the message says why and what to do."""


def looks_like_repo_id(model: str) -> bool:
    """True for "org/name" strings that are not an existing local path."""
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_repo_id(repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                    allow_patterns: list[str] | None = None, what: str = "model") -> Path:
    """The local snapshot folder of `repo_id` at `revision` (the files `allow_patterns` match, by default a model's):
    from the hub cache if it is there, else downloaded (with progress on stderr) unless HF_HUB_OFFLINE is set.
    Raises HubModelError saying how to fix it; `what` names the thing asked for ("model", "tokenizer")."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:   # transformers depends on huggingface_hub, so this is a broken install
        raise HubModelError(f"resolving the hub id {repo_id!r} needs huggingface_hub: pip install huggingface_hub"
                            ) from exc
    where = f" at revision {revision!r}" if revision else ""
    kwargs = dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir,
                  allow_patterns=allow_patterns if allow_patterns is not None else ALLOW_PATTERNS)
    try:
        cached = Path(snapshot_download(local_files_only=True, **kwargs))
    except LocalEntryNotFoundError:
        cached = None
    except Exception as exc:   # noqa: BLE001 - a corrupt cache entry is reported, not hidden
        raise HubModelError(f"the hub cache entry of {repo_id!r}{where} could not be read: {exc}") from exc
    if cached is not None and (allow_patterns is not None or has_weights(cached)):
        return cached        # a snapshot that a tokenizer's download left holds no weights: the model's downloads
    if _offline():
        raise HubModelError(
            f"{what} {repo_id!r}{where} is not in the Hugging Face cache ({_cache_root(cache_dir)}) and HF_HUB_OFFLINE "
            f"is set, so it cannot be downloaded; unset HF_HUB_OFFLINE, or fetch it where there is a network with "
            f"`huggingface-cli download {repo_id}` and copy the cache, or pass a local {what} folder")
    try:
        return Path(snapshot_download(**kwargs))
    except Exception as exc:   # noqa: BLE001 - network, auth and missing-repo errors all end here, named
        raise HubModelError(
            f"could not download {what} {repo_id!r}{where} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            f"check the id and the network, log in with `huggingface-cli login` for gated models, or pass a local "
            f"{what} folder") from exc


def cached_snapshot(repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
                    ) -> Path | None:
    """The snapshot folder of a model `repo_id` at `revision` if the hub cache holds its weights, else None; never
    downloads."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(repo_id=repo_id, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    return path if has_weights(path) else None


def has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _cache_root(cache_dir) -> str:
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants
    return str(constants.HF_HUB_CACHE)
