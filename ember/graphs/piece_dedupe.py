"""Which compiled pieces are the same program: the pieces between two attention calls of identical layers differ
only in the parameters they are handed, so one compile serves them all.

API:
    piece_signature(piece, example_args) -> str     equal for pieces that compile to the same code
    group_pieces(signatures: Sequence[str]) -> list[int]    each piece's group index, groups numbered by first use

A signature covers the piece's graph with its own node and placeholder names replaced by positions (dynamo names
placeholders after the parameters they carry, e.g. `..._layers_modules_3_...`), the targets and constant arguments
of every node, the content of any constant tensor the piece holds, and the metadata of each input: shape (symbols
included), strides, dtype, device and requires_grad.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.node import map_arg


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else repr(target)


def _value_meta(value: Any) -> str:
    """Input metadata: what the compiled code may specialise on."""
    if isinstance(value, torch.Tensor):
        shape = tuple(str(s) for s in value.shape)
        stride = tuple(str(s) for s in value.stride())
        return f"tensor{shape}{stride}{value.dtype}{value.device.type}{value.requires_grad}{value.storage_offset()}"
    if isinstance(value, torch.SymInt):
        return f"sym({value.node.expr})"
    return f"{type(value).__name__}({value!r})"


def _constant_digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return f"{_value_meta(value)}:{hashlib.sha256(data).hexdigest()}"
    return repr(value)


def piece_signature(piece: torch.fx.GraphModule, example_args: Sequence[Any]) -> str:
    """A hash that is equal for two pieces exactly when one's compiled code may run the other."""
    names: dict[torch.fx.Node, str] = {}
    lines = [_value_meta(a) for a in example_args]
    for i, node in enumerate(piece.graph.nodes):
        names[node] = f"%{i}"
        if node.op == "placeholder":
            line = "placeholder"
        elif node.op == "get_attr":
            # a constant the piece owns (the parameters arrive as inputs): equal only with equal content
            owner = piece
            for part in node.target.split("."):
                owner = getattr(owner, part)
            line = f"get_attr {_constant_digest(owner)}"
        else:
            args = map_arg(node.args, lambda n: names[n])
            kwargs = map_arg(node.kwargs, lambda n: names[n])
            line = f"{node.op} {_target_name(node.target)} {args!r} {sorted(kwargs.items())!r}"
        lines.append(line)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def group_pieces(signatures: Sequence[str]) -> list[int]:
    """Each piece's group index; groups are numbered in order of their first piece."""
    groups: dict[str, int] = {}
    return [groups.setdefault(s, len(groups)) for s in signatures]
