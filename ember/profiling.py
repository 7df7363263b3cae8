"""Named ranges of the step loop (`ember.schedule`, `ember.prepare`, ...) for the profiler, free when nobody
profiles: a `torch.profiler.record_function` costs a few microseconds to enter and leave, several times per step."""

from __future__ import annotations

import contextlib

from torch.profiler import record_function

_enabled = False
_NULL = contextlib.nullcontext()


def section(name: str):
    """A `record_function(name)` range while `enabled()` is on, else a shared no-op context."""
    return record_function(name) if _enabled else _NULL


@contextlib.contextmanager
def enabled():
    """Turn the step loop's named ranges on for the duration of a profile."""
    global _enabled
    previous, _enabled = _enabled, True
    try:
        yield
    finally:
        _enabled = previous
