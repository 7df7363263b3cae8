"""Linear layers with e4m3 weights and float32 scales (`ember::scaled_linear`), and the swap that puts them in
place of a built model's linear layers.

A layer holds its weight [N, K] in float8_e4m3fn, its scales under the checkpoint's name (`weight_scale`, or
`weight_scale_inv` for block checkpoints): one per output row [N] for per-tensor and per-channel checkpoints and for
online quantization, or one per block [N / 128, K / 128]; and `input_scale` [1] for static activation scales. The
parameters load through the loader's per-parameter weight loaders, packed parts (q/k/v, gate/up) included:

- a per-tensor scale fills its part's rows, so parts with different scales pack without requantizing;
- block scales fill their part's block rows (each part must be whole blocks, checked at start-up);
- static input scales of packed parts (one input, so usually equal) take their maximum: nothing saturates that
  would not have saturated in one of the parts;
- online (`quantization="fp8"`): the checkpoint's float weight arrives at the weight's loader, which quantizes each
  row and fills the row scales itself.

Under tensor parallelism a layer holds what its unquantized counterpart would, and its scales follow (each parameter
carries its `checkpoint_slice`, so the loader reads only this rank's bytes):

- column-parallel (q/k/v, gate/up): its rows of each part; per-channel scales and block rows with them, a part's
  per-tensor scale whole;
- row-parallel (o, down): its columns of the input; per-tensor and per-channel scales whole, block scales their
  block columns. Each rank scales its partial product before the all-reduce, so the sum is of dequantized parts;
- 128x128 blocks must not straddle a shard boundary: a split that is not whole blocks is refused at start-up;
- online, each rank quantizes its slice: a column-parallel row is whole, so its scale is one rank's as much as the
  whole model's; a row-parallel rank's scale is the amax of its part of the row (the whole row's is their maximum).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.distributed.ops import all_reduce
from ember.distributed.parallel_state import TP_GROUP
from ember.distributed.shard import CheckpointSlice, current_shard
from ember.kernels.fp8 import FP8, dequantize, quantize_blocks, quantize_rows, round_activations
from ember.kernels.scaled_linear_op import linear_fp8
from ember.models.layers.linear import Linear, PackedLinear, QKVLinear, RowParallelLinear, check_shape
from ember.models.layers.onednn import onednn_linear, takes_packed
from ember.quant import QuantConfig, QuantConfigError


def _param(shape: tuple[int, ...], dtype: torch.dtype | None, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


class ScaledLinear(nn.Module):
    """y = x (W x scales)^T (+ b), W [N, K] e4m3, stacked from `output_sizes` parts like `PackedLinear`.

    A tensor-parallel shard: `shard_ranges[i]` (first row, rows) of part i's `full_sizes[i]` rows (column-parallel),
    or `input_range` (first column, columns, of the whole layer's) with its partial products all-reduced
    (row-parallel). Without them, the whole layer."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, quant: QuantConfig,
                 q_size: int | None = None, kv_size: int | None = None,
                 shard_ranges: list[tuple[int, int]] | None = None, full_sizes: list[int] | None = None,
                 input_range: tuple[int, int, int] | None = None):
        super().__init__()
        self.in_features, self.output_sizes = in_features, list(output_sizes)
        self.out_features = n = sum(self.output_sizes)
        self.shard_ranges = list(shard_ranges or [(0, size) for size in self.output_sizes])
        self.full_sizes = list(full_sizes or self.output_sizes)
        self.input_range = input_range or (0, in_features, in_features)
        self.reduces = self.input_range[1] != self.input_range[2]      # row-parallel: all-reduce the partial sums
        self.q_size, self.kv_size = q_size, kv_size
        self.online = quant.online
        self.block = quant.weight_block if quant.block else None
        self.strategy = quant.weight_strategy
        self.scale_name = quant.scale_name
        self.weight = _param((n, in_features), FP8, self.load_weight)
        self.weight.casts_itself = True         # the loader hands it the checkpoint's tensor as it is
        bn, bk = self.block or (1, 1)
        scale_shape = (-(-n // bn), -(-in_features // bk)) if self.block else (n,)
        scale = _param(scale_shape, torch.float32, self.load_weight_scale)
        if self.online:
            scale.loaded_by = "weight"          # filled by the weight's loader, not read from the checkpoint
        self.register_parameter(self.scale_name, scale)
        self.input_scale = _param((1,), torch.float32, self.load_input_scale) if quant.activation == "static" \
            else None
        self.bias = _param((n,), None, self.load_bias) if bias else None
        self._input_scales: dict[int | None, float] = {}
        self.packed_weight: torch.Tensor | None = None    # oneDNN's copy on the CPU (ember.models.layers.onednn)
        if self.shard_ranges != [(0, size) for size in self.full_sizes] or self.reduces:
            self._slice_checkpoint_tensors(quant)

    def _slice_checkpoint_tensors(self, quant: QuantConfig) -> None:
        """Give each sharded parameter its `checkpoint_slice`: the rows (column-parallel) or columns (row-parallel)
        of the checkpoint tensor this rank reads, in elements or, for block scales, in blocks. Per-tensor scales,
        input scales, a row-parallel layer's per-channel scales and its bias are read whole."""
        bn, bk = self.block or (1, 1)
        if self.reduces:
            start, length, full = self.input_range
            self.weight.checkpoint_slice = lambda shard_id: CheckpointSlice(1, start, length, full)
            if self.block is not None:
                blocks = CheckpointSlice(1, start // bk, -(-length // bk), -(-full // bk))
                self.scale.checkpoint_slice = lambda shard_id: blocks
            return
        self.weight.checkpoint_slice = self._rows_of_part(1)
        if self.bias is not None:
            self.bias.checkpoint_slice = self._rows_of_part(1)
        if self.block is not None:
            self.scale.checkpoint_slice = self._rows_of_part(bn)
        elif self.strategy == "channel" and not self.online:
            self.scale.checkpoint_slice = self._rows_of_part(1)

    def _rows_of_part(self, unit: int):
        """The rule for a column-parallel parameter: part `shard_id`'s rows this rank holds, in units of `unit` rows
        (None, the whole tensor, for an already packed one)."""
        def rule(shard_id: int | None) -> CheckpointSlice | None:
            if shard_id is None or not 0 <= shard_id < len(self.full_sizes):
                return None
            (start, length), full = self.shard_ranges[shard_id], self.full_sizes[shard_id]
            return CheckpointSlice(0, start // unit, -(-length // unit), -(-full // unit))
        return rule

    @classmethod
    def replacing(cls, linear: Linear, quant: QuantConfig, name: str = "a linear layer") -> "ScaledLinear":
        """The scaled layer of `linear`'s shape, packing and tensor-parallel shard (built where `linear` was:
        usually on meta); `name` is the module's, for the refusals."""
        sizes = linear.output_sizes if isinstance(linear, PackedLinear) else [linear.out_features]
        q = (linear.q_size, linear.kv_size) if isinstance(linear, QKVLinear) else (None, None)
        ranges = linear.shard_ranges if isinstance(linear, PackedLinear) else None
        full = linear.full_sizes if isinstance(linear, PackedLinear) else None
        columns = linear.input_range if isinstance(linear, RowParallelLinear) and linear.tp_size > 1 else None
        if quant.block:
            size = linear.tp_size if isinstance(linear, RowParallelLinear) else current_shard().size
            _check_blocks(name, quant.weight_block, ranges or [(0, n) for n in sizes], full or sizes, columns, size)
        device = linear.weight.device
        with torch.device(device):
            return cls(linear.in_features, sizes, linear.bias is not None, quant, *q, shard_ranges=ranges,
                       full_sizes=full, input_range=columns)

    @property
    def scale(self) -> torch.Tensor:
        """The weight scales, whatever the checkpoint calls them (`weight_scale`, `weight_scale_inv`)."""
        return getattr(self, self.scale_name)

    # ---- loading ------------------------------------------------------------------------------------------------
    def _rows(self, shard_id: int | None) -> tuple[int, int]:
        """(first row, rows) of packed part `shard_id` (None: every row, an unpacked or already packed tensor)."""
        if shard_id is None:
            return 0, self.out_features
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard {shard_id} is out of range for {len(self.output_sizes)} packed projections")
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def _materialised(self, name: str, device: torch.device) -> torch.Tensor:
        """Parameter `name`, given storage on `device` first if it is still on meta (keeping its attributes)."""
        param = self._parameters[name]
        if param.is_meta:
            new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
            new.__dict__.update(param.__dict__)
            self._parameters[name] = param = new
        return param

    def load_weight(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        first, rows = self._rows(shard_id)
        target = param.data.narrow(0, first, rows)
        check_shape(param, loaded, target.shape)
        if loaded.dtype == FP8:
            if self.online:
                raise ValueError("is float8_e4m3fn, but config.json has no quantization_config to give its scales")
            target.copy_(loaded)
            return
        if not self.online:
            raise ValueError(f"is {loaded.dtype}, but the checkpoint's quantization_config says float8_e4m3fn")
        quantized, scale = quantize_rows(loaded)                      # [rows, K] e4m3, [rows] float32
        target.copy_(quantized)
        self._materialised(self.scale_name, param.device).data.narrow(0, first, rows).copy_(scale)

    def load_weight_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        first, rows = self._rows(shard_id)
        loaded = loaded.float()
        if self.block is not None:
            bn, bk = self.block
            target = param.data.narrow(0, first // bn, -(-rows // bn))
            check_shape(param, loaded, target.shape)
            target.copy_(loaded)
            return
        target = param.data.narrow(0, first, rows)
        if self.strategy == "tensor" and loaded.numel() == 1:
            target.copy_(loaded.reshape(1).expand(rows))
        elif self.strategy == "channel" and loaded.numel() == rows:
            target.copy_(loaded.reshape(rows))
        else:
            expected = "one value" if self.strategy == "tensor" else f"{rows} values (one per output channel)"
            raise ValueError(f"weight scale has shape {tuple(loaded.shape)}; a per-{self.strategy} scale needs "
                             f"{expected}")

    def load_input_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"input scale has shape {tuple(loaded.shape)}; a static per-tensor scale is one value")
        self._input_scales[shard_id] = float(loaded.float().reshape(()))
        param.data.fill_(max(self._input_scales.values()))

    def load_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        first, rows = self._rows(shard_id)
        target = param.data.narrow(0, first, rows)
        check_shape(param, loaded, target.shape)
        target.copy_(loaded)

    @torch.no_grad()
    def fill_random(self, std: float, dtype: torch.dtype, generator: torch.Generator) -> None:
        """Random weights (normal, `std`) drawn in `dtype`, quantized as this layer's checkpoints would be; a zero
        bias and a static input scale of 1/64 (activations up to 7 before they saturate)."""
        device = self.weight.device
        w = torch.empty(self.weight.shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
        quantized, scale = quantize_blocks(w, self.block) if self.block is not None else quantize_rows(w)
        self.weight.data.copy_(quantized)
        self.scale.data.copy_(scale)
        if self.bias is not None:
            self.bias.data.zero_()
        if self.input_scale is not None:
            self.input_scale.data.fill_(1 / 64)

    # ---- running ------------------------------------------------------------------------------------------------
    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W x scales [N, K] in `dtype`."""
        return dequantize(self.weight, self.scale, dtype, self.block)

    def weight_to_pack(self) -> torch.Tensor:
        """The CPU's oneDNN copy holds the dequantized weight (ember.models.layers.onednn)."""
        return self.dequantized_weight(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduces:
            return self._project(x, self.bias)
        # row-parallel: each rank's product is dequantized (scaled) before the sum, and the bias is added once
        out = all_reduce(self._project(x, None), TP_GROUP)
        return out if self.bias is None else out + self.bias

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if takes_packed(x, self.packed_weight):
            # the CPU: x rounded to e4m3 as the GPU's op rounds it, times the dequantized weight
            x = round_activations(x, self.input_scale, self.block[1] if self.block else None)
            return onednn_linear(x, self.packed_weight, bias)
        return linear_fp8(x, self.weight, self.scale, self.input_scale, bias, self.block)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `QKVLinear.forward_split`: x [T, hidden] -> q, k, v."""
        return self.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward_q(self, x: torch.Tensor) -> torch.Tensor:
        """As `QKVLinear.forward_q`: q [T, q_size] only."""
        q = self.q_size
        scale = self.scale[:q] if self.block is None else self.scale[:q // self.block[0]]
        bias = None if self.bias is None else self.bias[:q]
        return linear_fp8(x, self.weight[:q], scale, self.input_scale, bias, self.block)

    def extra_repr(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per row"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8 e4m3, scales {scales}, input_scale={'static' if self.input_scale is not None else 'dynamic'}")


def _check_blocks(name: str, block: tuple[int, int], ranges: list[tuple[int, int]], full_sizes: list[int],
                  columns: tuple[int, int, int] | None, size: int) -> None:
    """Refuse, naming the sizes, a layer whose weight blocks a packed part or this rank's shard would cut: each part
    (and each rank's rows of it, or its columns of a row-parallel layer) must start on a block and hold whole blocks,
    bar the tensor's last, partial one."""
    bn, bk = block
    for part, ((start, length), full) in enumerate(zip(ranges, full_sizes)):
        if (length, full) != (full, full) and (start % bn or (length % bn and start + length != full)):
            raise QuantConfigError(
                f"{name}: the {bn}x{bk} weight blocks do not split over tensor_parallel_size {size}: this rank would "
                f"hold rows [{start}, {start + length}) of packed part {part} ({full} rows), not whole {bn}-row "
                f"blocks; choose a tensor_parallel_size that splits each projection into multiples of {bn} rows")
    local = [length for _, length in ranges]
    if len(local) > 1 and any(length % bn for length in local[:-1]):
        raise QuantConfigError(f"{name}: packed parts of {local} rows do not start on whole {bn}-row weight blocks; "
                               f"ember cannot pack this block-quantized checkpoint")
    if columns is not None:
        start, length, full = columns
        if start % bk or (length % bk and start + length != full):
            raise QuantConfigError(
                f"{name}: the {bn}x{bk} weight blocks do not split over tensor_parallel_size {size}: this rank would "
                f"hold input columns [{start}, {start + length}) of {full}, not whole {bk}-column blocks; choose a "
                f"tensor_parallel_size that splits the input of each row-parallel projection into multiples of {bk}")


def hf_names(module_name: str, packed_modules: dict[str, list[str]]) -> list[str]:
    """The checkpoint module names behind an ember module (q_proj, k_proj and v_proj behind qkv_proj)."""
    parts = module_name.split(".")
    for packed, shards in packed_modules.items():
        if packed in parts:
            i = parts.index(packed)
            return [".".join(parts[:i] + [shard] + parts[i + 1:]) for shard in shards]
    return [module_name]


def quantize_linear_layers(model: nn.Module, quant: QuantConfig) -> int:
    """Replace every `Linear` of a built (meta) model that `quant` quantizes by its `ScaledLinear`; returns how many.
    A packed layer whose parts the checkpoint quantizes differently is refused."""
    packed = getattr(model, "packed_modules", {})
    swaps = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        names = hf_names(name, packed)
        quantized = [quant.quantizes(n) for n in names]
        if any(quantized) and not all(quantized):
            mixed = ", ".join(f"{n} ({'fp8' if q else 'not quantized'})" for n, q in zip(names, quantized))
            raise QuantConfigError(f"ember packs {mixed} into one layer; it cannot run parts of one packed layer "
                                   f"in different formats")
        if all(quantized):
            swaps.append(name)
    for name in swaps:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, ScaledLinear.replacing(getattr(parent, leaf), quant, name))
    return len(swaps)
