"""ember's custom ops (`torch.ops.ember.*`): each defined on one `torch.library.Library` with the schema inferred
from its Python signature, its body registered for every backend (CompositeExplicitAutograd), and a fake for
tracing.

    @define("name", mutates_args=(), library=LIBRARY)     the body; returns it unchanged
    @register_fake("name", library=LIBRARY)               its fake (shapes and dtypes of the outputs, no data)

`torch.library.custom_op` would do the same, but its calls pass through Python wrappers (its autograd, in-place
view and backend kernels) before the body; these ops are inference-only and run from compiled code on every layer,
so the dispatcher calls the body directly. Host time a call under inference_mode
(`benches/experiments/op_dispatch.py`, medians of 5 rounds): on an H100 host an empty body 9.4 us as a custom_op,
5.0 us here, 1.9 us as a plain call; the gate_up projection of 512 rows 140 / 127 / 111 us. On a 2-core CPU, the
empty body 14.3 / 7.0 / 2.2 us.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

LIBRARY = torch.library.Library("ember", "FRAGMENT")


def define(name: str, mutates_args: tuple[str, ...] = (), library: torch.library.Library = LIBRARY
           ) -> Callable[[F], F]:
    """Define `ember::<name>` (or `<library's namespace>::<name>`) from the decorated function's signature and
    register it as the op's body."""
    def register(fn: F) -> F:
        library.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        library.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return register


def register_fake(name: str, library: torch.library.Library = LIBRARY) -> Callable[[F], F]:
    """Register the decorated function as `ember::<name>`'s fake implementation."""
    def register(fn: F) -> F:
        torch.library.register_fake(f"{library.ns}::{name}", fn, lib=library)
        return fn
    return register
