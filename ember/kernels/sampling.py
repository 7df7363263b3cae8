"""Triton kernels for the sampler: the counter-based Gumbel noise of `sampler.gumbel_noise` and a one-pass sampler.

`sample_triton` takes argmax_v(logits[v] / T + g(v)) per row, reading the logits once in their own dtype and making
the noise in registers, instead of ~15 eager passes over an [N, V] int64 tensor. The integer bits are those of
`sampler.random_bits`; the float steps are the same IEEE operations as the torch code. Every vocabulary row is
split over several programs (so one request still fills the GPU), each writing a partial (max, index) that a
second, tiny kernel reduces. CPU tensors run an interpreted copy of the kernels (for tests), as
`attention_backends/triton_common/interpreted.py` does.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ember.kernels.interpret import interpreter_on
from ember.kernels.launcher import launcher

__all__ = ["random_bits_triton", "gumbel_noise_triton", "sample_triton", "sample_partials", "reduce_partials",
           "most_splits", "apply_token_bitmask_triton"]

# splitmix64 constants as unsigned literals: Triton types an int in [2**63, 2**64) as uint64
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)

BLOCK_SIZE = 1024     # vocabulary columns per tile
NUM_WARPS = 8
PROGRAMS_PER_SM = 4   # on an H100 1024 x 8 warps x 4/SM beat 2/SM by up to 25% for 64-256 greedy rows, ~3% sampled
CPU_PROGRAMS = 8      # programs to aim for under the interpreter: enough for several splits in small tests


@triton.jit
def _mix64(z):
    """splitmix64's finaliser on uint64 (wrapping multiplies, logical shifts)."""
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


@triton.jit
def _row_key(seed_ptr, counter_ptr, row):
    """The uint64 key of one (seed, counter) stream, as `sampler.random_bits` makes it."""
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    counter = tl.load(counter_ptr + row).to(tl.uint64, bitcast=True)
    return _mix64(_mix64(seed + _GOLDEN) + (counter + 1) * _GOLDEN)


@triton.jit
def _token_bits(row_key, cols):
    """[BLOCK] uint64 random bits of the token ids `cols` (int32) in the stream `row_key`."""
    return _mix64(row_key + (cols.to(tl.uint64) + 1) * _GOLDEN)


@triton.jit
def _gumbel(row_key, cols, ACCURATE_LOG: tl.constexpr):
    """[BLOCK] float32 Gumbel noise: the top 23 bits plus a half step, then -log(-log(u))."""
    top = (_token_bits(row_key, cols) >> 41).to(tl.int32)       # < 2**23: exact in int32 and float32
    uniform = (top.to(tl.float32) + 0.5) * 1.1920928955078125e-07   # * 2**-23
    if ACCURATE_LOG:
        # libdevice's logf is CUDA's logf, which torch.log uses: the noise matches the torch path bit for bit
        return -libdevice.log(-libdevice.log(uniform))
    return -tl.log(-tl.log(uniform))


@triton.jit
def _random_bits_kernel(seed_ptr, counter_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    bits = _token_bits(_row_key(seed_ptr, counter_ptr, row), cols)
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + cols, bits.to(tl.int64, bitcast=True), mask=cols < vocab_size)


@triton.jit
def _gumbel_noise_kernel(seed_ptr, counter_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr,
                         ACCURATE_LOG: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    noise = _gumbel(_row_key(seed_ptr, counter_ptr, row), cols, ACCURATE_LOG)
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + cols, noise, mask=cols < vocab_size)


# tl.reduce with Triton's own combine functions, not tl.max/tl.min: those are @triton.jit library functions that the
# interpreted copy cannot call (see attention_backends/triton_common/tiles.py)
@triton.jit
def _reduce_max(x):
    return tl.reduce(x, 0, tl.standard._elementwise_max)


@triton.jit
def _reduce_min(x):
    return tl.reduce(x, 0, tl.standard._elementwise_min)


@triton.jit
def _block_argmax(values, indices):
    """(value, index) of a [BLOCK] tile in torch.argmax's order: NaN above everything, ties to the lowest index."""
    nan = values != values
    any_nan = _reduce_max(nan.to(tl.int32)) > 0
    largest = _reduce_max(tl.where(nan, float("-inf"), values))
    winner = tl.where(any_nan, nan, values == largest)
    index = _reduce_min(tl.where(winner, indices, 2147483647))
    return tl.where(any_nan, float("nan"), largest), index


@triton.jit
def _allowed(bitmask_ptr, mask_stride, mask_row, cols, mask):
    """[BLOCK] bool: whether bitmask row `mask_row` allows the token ids `cols` (bit c % 32 of word c // 32)."""
    words = tl.load(bitmask_ptr + mask_row.to(tl.int64) * mask_stride + cols // 32, mask=mask, other=0)
    return ((words >> (cols % 32)) & 1) != 0


@triton.jit
def _apply_bitmask_kernel(logits_ptr, stride_row, bitmask_ptr, mask_stride, mask_index_ptr, vocab_size,
                          BLOCK: tl.constexpr):
    """Set to -inf the logits a row's grammar forbids; rows whose mask index is 0 have no grammar."""
    row = tl.program_id(0)
    mask_row = tl.load(mask_index_ptr + row) - 1
    if mask_row >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        allowed = _allowed(bitmask_ptr, mask_stride, mask_row, cols, mask)
        tl.store(logits_ptr + row.to(tl.int64) * stride_row + cols, tl.full((BLOCK,), float("-inf"), tl.float32),
                 mask=mask & (allowed == 0))


@triton.jit
def _perturb(x, cols, temperature_ptr, row_key, row, HAS_TEMPERATURE: tl.constexpr, ACCURATE_LOG: tl.constexpr):
    """x / T + g, the same two rounded float32 steps as the torch path's div_ and add_."""
    if HAS_TEMPERATURE:
        x = tl.math.div_rn(x, tl.load(temperature_ptr + row))
    return x + _gumbel(row_key, cols, ACCURATE_LOG)


# num_splits follows the batch size (see split_plan): out of the specialization key, so one compiled kernel serves
# every batch; cols_per_split is always a multiple of BLOCK and keeps its divisibility hint (aligned tile loads)
@triton.jit(do_not_specialize=["num_splits"])
def _sample_partial_kernel(logits_ptr, stride_row, temperature_ptr, seed_ptr, counter_ptr, greedy_ptr,
                           bitmask_ptr, mask_stride, mask_index_ptr,
                           partial_ptr, vocab_size, first_id, cols_per_split, num_splits,
                           HAS_TEMPERATURE: tl.constexpr, HAS_GREEDY_MASK: tl.constexpr, ALL_GREEDY: tl.constexpr,
                           HAS_MASK: tl.constexpr, ACCURATE_LOG: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, split): the best (score, token id) over cols_per_split columns (a multiple of BLOCK),
    column c holding token first_id + c (a vocabulary-parallel shard's; 0 for a whole row): its noise, its bitmask
    bit and the id stored are the token's. With HAS_MASK, a row whose mask index is positive takes only the tokens
    its grammar bitmask row allows.

    partial_ptr: [N, 2, num_splits] float32, the scores then the ids (int32 bits), one allocation for both.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, vocab_size)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    if not ALL_GREEDY:
        row_key = _row_key(seed_ptr, counter_ptr, row)
        if HAS_GREEDY_MASK:
            random_row = tl.load(greedy_ptr + row) == 0
    if HAS_MASK:
        mask_row = tl.load(mask_index_ptr + row) - 1

    # per lane: its best so far; starting at the lane's first column keeps all -inf rows at the lowest index
    best_value = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = first_id + start + tl.arange(0, BLOCK)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        ids = first_id + cols
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            if mask_row >= 0:
                x = tl.where(_allowed(bitmask_ptr, mask_stride, mask_row, ids, mask), x, float("-inf"))
        if not ALL_GREEDY:
            if HAS_GREEDY_MASK:
                if random_row:
                    x = _perturb(x, ids, temperature_ptr, row_key, row, HAS_TEMPERATURE, ACCURATE_LOG)
            else:
                x = _perturb(x, ids, temperature_ptr, row_key, row, HAS_TEMPERATURE, ACCURATE_LOG)
            x = tl.where(mask, x, float("-inf"))
        # later columns of a lane win only when strictly better (or the first NaN), so ties keep the lower index
        take = (x > best_value) | ((x != x) & (best_value == best_value))
        best_value = tl.where(take, x, best_value)
        best_index = tl.where(take, ids, best_index)

    value, index = _block_argmax(best_value, best_index)
    tl.store(partial_ptr + (2 * row) * num_splits + split, value)
    tl.store(partial_ptr + (2 * row + 1) * num_splits + split, index.to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["num_splits"])
def _sample_reduce_kernel(partial_ptr, out_ptr, num_splits, BLOCK_SPLITS: tl.constexpr):
    """One program per row: the argmax over its splits' partial results, ties to the lower index."""
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_SPLITS)
    mask = splits < num_splits
    value = tl.load(partial_ptr + (2 * row) * num_splits + splits, mask=mask, other=float("-inf"))
    index = tl.load(partial_ptr + (2 * row + 1) * num_splits + splits, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    index = tl.where(mask, index, 2147483647)
    _, best = _block_argmax(value, index)
    tl.store(out_ptr + row, best.to(tl.int64))


# ---- launchers -----------------------------------------------------------------------------------------------

@functools.cache
def _interpreted_module():
    """This module imported a second time with TRITON_INTERPRET=1, so its kernels run on CPU tensors."""
    name = __name__ + "_interpreted"
    spec = importlib.util.spec_from_file_location(name, __file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with interpreter_on():
        spec.loader.exec_module(module)
    return module


def _kernel(name: str, device: torch.device):
    """The compiled kernel for a GPU tensor, the interpreted copy for a CPU tensor."""
    if device.type == "cpu":
        return getattr(_interpreted_module(), name)
    return launcher(getattr(sys.modules[__name__], name))


def _accurate_log(device: torch.device) -> bool:
    # the interpreter has no libdevice; its tl.log is numpy's float32 log
    return device.type == "cuda"


@functools.cache
def _num_programs_target(device: torch.device) -> int:
    """A few programs per SM, so every SM streams logits whatever the batch size (one request included)."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _check_rows(seeds: torch.Tensor, counters: torch.Tensor, num_rows: int | None = None) -> None:
    if seeds.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(f"seeds ({seeds.dtype}) and counters ({counters.dtype}) must be int64 tensors")
    if seeds.shape != counters.shape or seeds.dim() != 1 or (num_rows is not None and seeds.numel() != num_rows):
        raise ValueError(f"seeds {tuple(seeds.shape)} and counters {tuple(counters.shape)} must both be [N]"
                         + ("" if num_rows is None else f" with N = {num_rows} rows of logits"))


def _per_token(kernel: str, dtype: torch.dtype, seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int,
               **constexprs) -> torch.Tensor:
    """Run a kernel that writes one value per (row, token id) into a new [N, V] tensor."""
    _check_rows(seeds, counters)
    n = seeds.numel()
    out = torch.empty(n, vocab_size, dtype=dtype, device=seeds.device)   # [N, V]
    grid = (n, triton.cdiv(vocab_size, BLOCK_SIZE))
    _kernel(kernel, seeds.device)[grid](seeds.contiguous(), counters.contiguous(), out, vocab_size,
                                        BLOCK=BLOCK_SIZE, **constexprs)
    return out


def random_bits_triton(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] int64, the bits of `sampler.random_bits`; for checking the kernels' hash against the torch one."""
    return _per_token("_random_bits_kernel", torch.int64, seeds, counters, vocab_size)


def gumbel_noise_triton(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] float32 Gumbel noise equal to `sampler.gumbel_noise`, in one pass that writes it once."""
    return _per_token("_gumbel_noise_kernel", torch.float32, seeds, counters, vocab_size,
                      ACCURATE_LOG=_accurate_log(seeds.device))


def split_plan(num_rows: int, vocab_size: int, target_programs: int, block: int = BLOCK_SIZE) -> tuple[int, int]:
    """(columns per split, a multiple of `block`; number of splits) so that rows x splits reaches ~target_programs."""
    wanted = max(1, -(-target_programs // num_rows))
    cols_per_split = max(block, triton.cdiv(triton.cdiv(vocab_size, wanted), block) * block)
    return cols_per_split, triton.cdiv(vocab_size, cols_per_split)


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor,
                  counters: torch.Tensor, greedy_mask: torch.Tensor | None, all_greedy: bool,
                  bitmask: torch.Tensor | None = None, mask_index: torch.Tensor | None = None) -> torch.Tensor:
    """[N] int64: per row argmax(logits / T + gumbel_noise) for random rows and argmax(logits) for greedy ones.

    logits: [N, V] float32/bf16/fp16, any row stride (a column stride other than 1 costs a copy); temperature:
    [N] float32 or None (1.0); greedy_mask: [N] bool or None (no greedy row unless all_greedy); bitmask
    [K, ceil(V / 32)] int32 with mask_index [N] int64 (row + 1, 0 for none): tokens a row's grammar forbids are out.
    No host sync; ties go to the lower id, NaN wins like in torch.argmax.
    """
    partial = sample_partials(logits, temperature, seeds, counters, greedy_mask, all_greedy, bitmask, mask_index)
    # the tile holds the splits of a one-row batch, the most any batch has, so one compiled kernel serves every
    # batch size (a tile per power of two would compile mid-run as the batch size moves)
    return reduce_partials(partial, most_splits(logits.shape[1], logits.device))


def most_splits(width: int, device: torch.device) -> int:
    """How many partials `sample_partials` makes a row over `width` columns for a one-row batch, the most any
    batch makes (a reduce tile that covers them serves every batch size)."""
    return split_plan(1, width, _num_programs_target(device))[1]


def sample_partials(logits: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor,
                    counters: torch.Tensor, greedy_mask: torch.Tensor | None, all_greedy: bool,
                    bitmask: torch.Tensor | None = None, mask_index: torch.Tensor | None = None,
                    first_id: int = 0, num_ids: int | None = None) -> torch.Tensor:
    """`sample_triton`'s first pass: [N, 2, splits] float32, per split of each row its best score and that token's
    id (int32 bits). With `first_id`, logits [N, C] are the columns of tokens first_id .. first_id + C - 1 (a
    vocabulary-parallel shard): each token is scored as in the whole row, so the partials of every shard, side by
    side along the last dim, reduce (`reduce_partials`) to the whole row's tokens. `num_ids` (default C): only the
    first num_ids columns are tokens (a last shard's padding past the vocabulary is never sampled); the splits
    follow C, so the shards of one vocabulary, all C wide, make as many partials each."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be [N, V] float32, bfloat16 or float16, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    num_rows, width = logits.shape
    vocab_size = width if num_ids is None else num_ids
    if not 0 <= vocab_size <= width:
        raise ValueError(f"num_ids {num_ids} must lie in [0, {width}], the logits' columns")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    if not all_greedy:
        _check_rows(seeds, counters, num_rows)
        seeds, counters = seeds.contiguous(), counters.contiguous()
    has_temperature = temperature is not None and not all_greedy
    has_greedy_mask = greedy_mask is not None and not all_greedy
    if has_temperature:
        temperature = temperature.to(torch.float32).contiguous()
    # bool pointers are awkward in Triton; the same bytes as uint8 load plainly
    greedy_bytes = greedy_mask.contiguous().view(torch.uint8) if has_greedy_mask else None

    has_mask = bitmask is not None
    if has_mask:
        _check_bitmask(bitmask, mask_index, num_rows, first_id + vocab_size)

    cols_per_split, num_splits = split_plan(num_rows, width, _num_programs_target(device))
    partial = torch.empty(num_rows, 2, num_splits, dtype=torch.float32, device=device)   # [N, (score, id), splits]
    _kernel("_sample_partial_kernel", device)[(num_rows, num_splits)](
        logits, logits.stride(0), temperature if has_temperature else logits,
        seeds if not all_greedy else logits, counters if not all_greedy else logits,
        greedy_bytes if has_greedy_mask else logits,
        bitmask if has_mask else logits, bitmask.stride(0) if has_mask else 0, mask_index if has_mask else logits,
        partial, vocab_size, first_id, cols_per_split, num_splits,
        HAS_TEMPERATURE=has_temperature, HAS_GREEDY_MASK=has_greedy_mask, ALL_GREEDY=all_greedy,
        HAS_MASK=has_mask, ACCURATE_LOG=_accurate_log(device), BLOCK=BLOCK_SIZE, num_warps=NUM_WARPS)
    return partial


def reduce_partials(partial: torch.Tensor, max_splits: int = 1) -> torch.Tensor:
    """[N] int64: each row's best token over `sample_partials`' [N, 2, splits] (ties to the lower id). The
    reduce's tile covers max(max_splits, splits), rounded up to a power of two."""
    num_rows, _, num_splits = partial.shape
    partial = partial.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=partial.device)               # [N]
    _kernel("_sample_reduce_kernel", partial.device)[(num_rows,)](
        partial, out, num_splits, BLOCK_SPLITS=triton.next_power_of_2(max(max_splits, num_splits)))
    return out


def _check_bitmask(bitmask: torch.Tensor, mask_index: torch.Tensor | None, num_rows: int, vocab_size: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1:
        raise ValueError(f"bitmask must be a row-contiguous [K, words] int32 tensor, got {tuple(bitmask.shape)} "
                         f"{bitmask.dtype}")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask rows of {bitmask.shape[1]} words cover {bitmask.shape[1] * 32} tokens, fewer than "
                         f"the vocabulary's {vocab_size}")
    if mask_index is None or mask_index.dtype != torch.int64 or mask_index.shape != (num_rows,):
        raise ValueError(f"mask_index must be [{num_rows}] int64 beside a bitmask, got "
                         f"{None if mask_index is None else (tuple(mask_index.shape), mask_index.dtype)}")
    if not mask_index.is_contiguous():
        raise ValueError("mask_index must be contiguous")


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor) -> None:
    """In place: logits[i, t] = -inf where row i's grammar forbids token t (bit t of bitmask[mask_index[i] - 1]);
    rows with mask_index 0 are untouched. logits: [N, V] float32 with unit column stride."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] float32 with unit column stride, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    num_rows, vocab_size = logits.shape
    _check_bitmask(bitmask, mask_index, num_rows, vocab_size)
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK_SIZE))
    _kernel("_apply_bitmask_kernel", logits.device)[grid](logits, logits.stride(0), bitmask, bitmask.stride(0),
                                                          mask_index, vocab_size, BLOCK=BLOCK_SIZE)
