"""`LLM(tokenizer=, tokenizer_mode=, tokenizer_revision=)`, as vLLM takes them: the folder the tokenizer loads from.

`tokenizer=` names a folder or a hub id, resolved as a model is (a hub id through the Hugging Face cache, downloading
only the tokenizer's files); without it the tokenizer is the model's. transformers' AutoTokenizer loads it, so the one
mode is "auto"; the modes that need another loader are refused before anything loads.
"""

from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TOKENIZER_MODES = ("auto",)
# vLLM's other modes, with why ember cannot honour them
REFUSED_MODES = {
    "slow": "ember loads tokenizers with transformers' AutoTokenizer, which picks the fast (Rust) tokenizer; "
            "use tokenizer_mode='auto'",
    "mistral": "mistral_common tokenizers are not supported; use tokenizer_mode='auto' with a checkpoint that "
               "ships Hugging Face tokenizer files (tokenizer.json or tokenizer_config.json)",
    "custom": "custom tokenizer classes are not supported; use tokenizer_mode='auto'",
}


def check_tokenizer_mode(mode: object) -> None:
    """Refuse a `tokenizer_mode` other than "auto", saying why."""
    if mode in TOKENIZER_MODES:
        return
    if isinstance(mode, str) and mode in REFUSED_MODES:
        raise ValueError(f"tokenizer_mode {mode!r} is not supported: {REFUSED_MODES[mode]}")
    raise ValueError(f"tokenizer_mode {mode!r} is not a tokenizer mode; use 'auto' (vLLM's 'slow', 'mistral' and "
                     f"'custom' are not supported)")


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).exists() for name in TOKENIZER_FILES)


def tokenizer_folder(tokenizer: str | os.PathLike | None, tokenizer_revision: str | None,
                     model: str | os.PathLike | None, model_path: Path | None,
                     download_dir: str | os.PathLike | None = None) -> Path | None:
    """The folder to load the tokenizer from: `tokenizer` resolved (a folder or a hub id at `tokenizer_revision`),
    else the model's hub id at `tokenizer_revision`, else `model_path` (None: there is no model folder)."""
    if tokenizer is None:
        if tokenizer_revision is None:
            return model_path
        from ember.models.default_model import DEFAULT_MODEL_ALIASES
        from ember.models.hub import looks_like_repo_id
        if model is None or str(model) in DEFAULT_MODEL_ALIASES or not looks_like_repo_id(str(model)):
            raise ValueError(f"tokenizer_revision {tokenizer_revision!r} applies to a tokenizer from the hub, and the "
                             f"tokenizer here is that of the model {str(model or 'default')!r}, which is not a hub id; "
                             f"drop tokenizer_revision, or pass tokenizer='org/name' with it")
        return _from_hub(str(model), tokenizer_revision, download_dir)
    if isinstance(tokenizer, bool) or not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"tokenizer must be a folder or a hub id ('org/name'), got {type(tokenizer).__name__} "
                        f"{tokenizer!r}")
    name = str(tokenizer)
    path = Path(name).expanduser()
    if path.is_dir():
        if tokenizer_revision is not None:
            raise ValueError(f"tokenizer_revision {tokenizer_revision!r} applies to hub ids; tokenizer {name!r} is a "
                             f"local folder")
        if not has_tokenizer_files(path):
            raise ValueError(f"tokenizer {name!r} is a folder with none of {', '.join(TOKENIZER_FILES)}; pass the "
                             f"folder that holds the tokenizer's files")
        return path
    from ember.models.default_model import DEFAULT_MODEL_ALIASES, resolve_model_path
    if name in DEFAULT_MODEL_ALIASES:
        if tokenizer_revision is not None:
            raise ValueError(f"tokenizer_revision {tokenizer_revision!r} does not apply to the default model's "
                             f"tokenizer {name!r}; drop it")
        return resolve_model_path(name)
    from ember.models.hub import looks_like_repo_id
    if looks_like_repo_id(name):
        return _from_hub(name, tokenizer_revision, download_dir)
    raise ValueError(f"tokenizer {name!r} is neither a folder nor a hub id; pass a folder with tokenizer files "
                     f"(tokenizer.json, tokenizer_config.json) or a hub id such as 'Qwen/Qwen3-0.6B'")


def _from_hub(repo_id: str, revision: str | None, download_dir) -> Path:
    from ember.models.hub import TOKENIZER_PATTERNS, resolve_repo_id
    path = resolve_repo_id(repo_id, revision, download_dir, allow_patterns=TOKENIZER_PATTERNS, what="tokenizer")
    if not has_tokenizer_files(path):
        raise ValueError(f"the hub repository {repo_id!r} holds none of {', '.join(TOKENIZER_FILES)}; pass a "
                         f"tokenizer folder or another hub id as tokenizer=")
    return path
