"""Attention backend registry: registration, lookup, selection by priority with reasons, entry-point plug-ins."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable

import torch

from ember.attention_backends.base import AttentionBackend, AttentionLayerOptions
from ember.kv_spec import KVCacheSpec

ENTRY_POINT_GROUP = "ember.attention_backends"

# name -> factory returning the backend class; factories import lazily so that a backend's heavy
# dependencies (Triton, ...) load only when it is asked for.
_factories: dict[str, Callable[[], type[AttentionBackend]]] = {}
_loaded: dict[str, type[AttentionBackend]] = {}
_entry_points_scanned = False


class BackendSelectionError(ValueError):
    """No backend (or not the one asked for) can serve a KV-cache group; the message lists every reason."""


def register_backend(name: str) -> Callable:
    """Decorator for a backend class, or for a zero-argument factory that returns one (imported lazily)."""
    def wrap(obj):
        if isinstance(obj, type) and issubclass(obj, AttentionBackend):
            obj.name = name
            _factories[name] = lambda: obj
        else:
            _factories[name] = obj
        _loaded.pop(name, None)
        return obj
    return wrap


def _scan_entry_points() -> None:
    global _entry_points_scanned
    if _entry_points_scanned:
        return
    _entry_points_scanned = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _factories:
            continue
        _factories[ep.name] = (lambda ep=ep: _load_entry_point(ep))


def _load_entry_point(ep) -> type[AttentionBackend]:
    obj = ep.load()
    backend = obj if isinstance(obj, type) else obj()
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(f"entry point {ep.name!r} ({ep.value}) did not give an AttentionBackend subclass")
    backend.name = ep.name
    return backend


def rescan_entry_points() -> None:
    """Look at installed distributions again (for plug-ins installed after ember was imported)."""
    global _entry_points_scanned
    _entry_points_scanned = False
    _scan_entry_points()


def available_backends() -> list[str]:
    _scan_entry_points()
    return sorted(_factories)


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`."""
    _scan_entry_points()
    if name not in _factories:
        raise BackendSelectionError(f"attention backend {name!r} is not registered; registered: {available_backends()}")
    if name not in _loaded:
        backend = _factories[name]()
        backend.name = name
        _loaded[name] = backend
    return _loaded[name]


def check_backend_options(names, backend: str = "auto") -> None:
    """ValueError for an option name that `backend` (for "auto": every registered backend that loads) does not
    read, so that a misspelt switch fails at start-up instead of changing nothing."""
    if backend != "auto":
        known = set(get_backend(backend).option_names)
    else:
        known = set()
        for name in available_backends():
            try:
                known.update(get_backend(name).option_names)
            except ImportError:   # a plug-in whose dependencies are missing reads no options here
                continue
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"attention backend option(s) {unknown} are not read by backend {backend!r}; "
                         f"known: {sorted(known)}")


@dataclass(frozen=True)
class Selection:
    """The chosen backend and why the others were passed over."""
    backend: type[AttentionBackend]
    refused: dict[str, list[str]]


def select_backend(spec: KVCacheSpec, dtype: torch.dtype, device: torch.device,
                   options: list[AttentionLayerOptions], requested: str = "auto") -> Selection:
    """Pick a backend for one KV-cache group. `requested` is a name or "auto" (highest priority that supports it).

    Never falls back silently: a named backend that cannot serve raises with its reasons, and "auto" reports
    every refused backend's reasons in the returned `Selection`.
    """
    def reasons_of(backend: type[AttentionBackend]) -> list[str]:
        reasons = list(backend.supports(spec, dtype, device, None))
        for opt in set(options):
            reasons += [r for r in backend.supports(spec, dtype, device, opt) if r not in reasons]
        return reasons

    if requested != "auto":
        backend = get_backend(requested)
        reasons = reasons_of(backend)
        if reasons:
            raise BackendSelectionError(
                f"attention backend {requested!r} cannot serve this model on {device} ({dtype}): " + "; ".join(reasons))
        return Selection(backend, {})

    refused: dict[str, list[str]] = {}
    candidates = []
    for name in available_backends():
        try:
            backend = get_backend(name)
        except Exception as exc:  # a broken plug-in must not take the engine down; it is reported
            refused[name] = [f"failed to load: {exc}"]
            continue
        reasons = reasons_of(backend)
        if reasons:
            refused[name] = reasons
        else:
            candidates.append(backend)
    if not candidates:
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in refused.items())
        raise BackendSelectionError(f"no attention backend can serve this model on {device} ({dtype}): {detail}")
    best = max(candidates, key=lambda b: (b.priority, b.name))
    return Selection(best, refused)


# Built-in backends, imported on first use.
register_backend("torch_ref")(lambda: importlib.import_module("ember.attention_backends.torch_ref").TorchRefBackend)
register_backend("cpu_sdpa")(lambda: importlib.import_module("ember.attention_backends.cpu_sdpa").CpuSdpaBackend)
register_backend("triton_unified")(
    lambda: importlib.import_module("ember.attention_backends.triton_unified.backend").TritonUnifiedBackend)
register_backend("flash")(lambda: importlib.import_module("ember.attention_backends.flash.backend").FlashBackend)
register_backend("per_phase")(
    lambda: importlib.import_module("ember.attention_backends.per_phase").PerPhaseBackend)
