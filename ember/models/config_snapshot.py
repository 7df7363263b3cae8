"""A model's transformers config, resolved once and then kept as plain values.

Building a transformers config imports its family's configuration module, and through transformers' docstring
machinery much of transformers' modeling and generation code with it (scikit-learn too, where it is installed).
ember only reads the config's attributes. So the first build of a config resolves it through AutoConfig and stores
its `to_dict()` as JSON under ember's cache directory. A later build of the same values (same config.json, same
overrides, same transformers version) reads that JSON and imports nothing of transformers.

Every build, the first included, returns the same kind of object, a `ConfigSnapshot`, so a warm start sees exactly
what a cold one saw (the compile cache key is taken from it too). A snapshot file that cannot be read is reported
and rebuilt.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ember.config import cache_dir, package_version

logger = logging.getLogger("ember")

FORMAT_VERSION = 1


class ConfigSnapshot(SimpleNamespace):
    """The resolved attributes of a transformers config (its `to_dict()`), read like the config itself."""

    def __getattr__(self, name: str):
        if name == "rope_scaling":      # transformers 5 keeps it as rope_parameters, and reads the old name alike
            return self.__dict__.get("rope_parameters")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(vars(self))

    def to_transformers(self):
        """The transformers config these values came from (for a transformers model built beside ember's)."""
        from transformers import AutoConfig
        return AutoConfig.for_model(**self.to_dict())


def snapshot_path(source: str, cache_root: Path | str | None) -> Path:
    """Where the snapshot of a config built from `source` (canonical JSON of its values) is stored."""
    if cache_root is None:
        cache_root = cache_dir()
    blob = json.dumps([source, package_version("transformers"), FORMAT_VERSION])
    return Path(cache_root) / "configs" / f"{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"


def _read(path: Path) -> ConfigSnapshot | None:
    if not path.is_file():
        return None
    try:
        values = json.loads(path.read_text())
        if not isinstance(values, dict) or "model_type" not in values:
            raise ValueError("not a config dict")
    except (OSError, ValueError) as e:
        logger.warning("config snapshot %s cannot be read (%s); rebuilding it through transformers", path, e)
        return None
    return ConfigSnapshot(**values)


def _write(path: Path, values: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(values, f)
        os.replace(tmp, path)
    except OSError as e:        # a read-only cache costs the next start the transformers import, nothing else
        logger.info("config snapshot not saved to %s: %s", path, e)


def snapshot_config(source: str, build: Callable[[], Any], cache_root: Path | str | None = None) -> ConfigSnapshot:
    """The snapshot of the config that `build()` makes from `source` (the canonical JSON of what it is built from):
    read from the cache, or built, stored and read back the way a later start will read it."""
    path = snapshot_path(source, cache_root)
    snapshot = _read(path)
    if snapshot is not None:
        return snapshot
    text = json.dumps(build().to_dict(), default=str)
    values = json.loads(text)
    _write(path, values)
    return ConfigSnapshot(**values)
