"""Token-to-expert alignment for the grouped MoE GEMM, on the device and without a host sync.

A step's T tokens each pick top_k experts: T * top_k token-slots (slot s = token * top_k + k). The grouped GEMM wants
the slots sorted by expert, each expert's run padded to a multiple of the GEMM's BLOCK_M, so that every block of
BLOCK_M rows belongs to one expert:

    sorted_slots  [capacity] int32   slot ids by expert (ascending slot order within an expert); padding holds the
                                     sentinel T * top_k; entries past num_padded are never read
    block_experts [capacity / BLOCK_M] int32   the expert of each block of rows; -1 past num_padded
    num_padded    [1] int32          rows in use: the sum over experts of their counts rounded up to BLOCK_M

`capacity` is the worst case for T (`align_capacity`): at most min(E, T * top_k) experts are non-empty and each pads
at most BLOCK_M - 1 rows. It depends on T alone, so the buffers and the GEMM grids are fixed for a CUDA-graph bucket
and nothing is read back to the host.

Under expert parallelism a rank holds E_local of the model's experts: `expert_map` [E] int32 maps a global expert id
to its local id, or -1 for an expert held elsewhere. The layout is then the local experts' (E = E_local above,
`block_experts` holds local ids); a slot of an expert held elsewhere joins no block and appears nowhere. The
capacity stays T * top_k + E_local (BLOCK_M - 1): every slot may be local.

Three launches: per chunk of CHUNK slots, the count of each expert; per expert, the exclusive sum of those counts
over chunks (each chunk's base within its expert); per chunk again, every slot's position (its expert's padded start,
its chunk's base, its rank among its chunk's slots of that expert), and from program 0 the padding sentinels and
num_padded. Positions follow slot order, so the result is deterministic and equals the stable sort
(`align_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.interpret import interpreted

__all__ = ["CHUNK", "align_capacity", "align_reference", "local_expert_ids", "moe_align"]

CHUNK = 64          # slots a program counts and places: its rank matrix is [CHUNK, CHUNK]
PREFIX_CHUNKS = 64  # chunks the prefix program scans per step
PREFIX_EXPERTS = 32 # experts per prefix program
BLOCK_TILE = 64     # block ids a scatter program labels per step


def align_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows the aligned layout can need for `num_slots` token-slots: every slot, plus BLOCK_M - 1 rows of padding
    for each expert that can be non-empty, rounded up to a whole block."""
    padded = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-padded // block_m) * block_m


# Kernels use tl.reduce / tl.associative_scan with Triton's own combine functions, not tl.sum / tl.cumsum: those
# are @triton.jit library functions that the interpreted copy (CPU tensors) cannot call. Counts that follow the
# step's token count stay out of the specialization key (Triton would compile a count of 1 or a multiple of 16
# apart), so one compile serves every bucket.
@triton.jit
def _slot_experts(topk_ids_ptr, expert_map_ptr, slots, slot_ok, E_P2: tl.constexpr, HAS_MAP: tl.constexpr):
    """The (local) expert of each slot; E_P2, which matches no expert, for a slot past the end or, with the map,
    of an expert held elsewhere."""
    ids = tl.load(topk_ids_ptr + slots, mask=slot_ok, other=E_P2)
    if HAS_MAP:
        local = tl.load(expert_map_ptr + tl.where(slot_ok, ids, 0), mask=slot_ok, other=-1)
        ids = tl.where(local >= 0, local, E_P2)
    return ids


@triton.jit(do_not_specialize=["num_slots"])
def _count_kernel(topk_ids_ptr, expert_map_ptr, chunk_counts_ptr, num_slots, num_experts,
                  CHUNK: tl.constexpr, E_P2: tl.constexpr, HAS_MAP: tl.constexpr):
    """chunk_counts[c, e] = slots of chunk c that chose (local) expert e."""
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = _slot_experts(topk_ids_ptr, expert_map_ptr, slots, slots < num_slots, E_P2, HAS_MAP)
    experts = tl.arange(0, E_P2)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)                    # [CHUNK, E_P2]
    counts = tl.reduce(hits, 0, tl.standard._sum_combine)
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, counts, mask=experts < num_experts)


@triton.jit(do_not_specialize=["num_chunks"])
def _prefix_kernel(chunk_counts_ptr, chunk_base_ptr, totals_ptr, num_chunks, num_experts,
                   CHUNKS: tl.constexpr, EXPERTS: tl.constexpr):
    """chunk_base[c, e] = slots of chunks before c that chose e; totals[e] = all slots that chose e."""
    experts = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    expert_ok = experts < num_experts
    running = tl.full((EXPERTS,), 0, tl.int32)
    for start in range(0, num_chunks, CHUNKS):
        chunks = start + tl.arange(0, CHUNKS)
        mask = (chunks < num_chunks)[:, None] & expert_ok[None, :]
        offsets = chunks[:, None] * num_experts + experts[None, :]            # [CHUNKS, EXPERTS]
        counts = tl.load(chunk_counts_ptr + offsets, mask=mask, other=0)
        inclusive = tl.associative_scan(counts, 0, tl.standard._sum_combine)
        tl.store(chunk_base_ptr + offsets, inclusive - counts + running[None, :], mask=mask)
        running += tl.reduce(counts, 0, tl.standard._sum_combine)
    tl.store(totals_ptr + experts, running, mask=expert_ok)


@triton.jit(do_not_specialize=["num_slots", "num_blocks", "blocks_per_program"])
def _scatter_kernel(topk_ids_ptr, expert_map_ptr, chunk_base_ptr, totals_ptr, sorted_ptr, block_experts_ptr,
                    num_padded_ptr, num_slots, num_experts, num_blocks, blocks_per_program,
                    CHUNK: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TILE: tl.constexpr,
                    HAS_MAP: tl.constexpr):
    """Each slot of chunk c to its row; program c also labels its share of the blocks, program 0 writes the
    padding sentinels and num_padded."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    expert_ok = experts < num_experts
    totals = tl.load(totals_ptr + experts, mask=expert_ok, other=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.associative_scan(padded, 0, tl.standard._sum_combine)           # [E_P2] inclusive
    starts = ends - padded

    lanes = tl.arange(0, CHUNK)
    slots = chunk * CHUNK + lanes
    ids = _slot_experts(topk_ids_ptr, expert_map_ptr, slots, slots < num_slots, E_P2, HAS_MAP)
    # rank among this chunk's earlier slots of the same expert
    before = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])   # [CHUNK, CHUNK]
    rank = tl.reduce(before.to(tl.int32), 1, tl.standard._sum_combine)
    base_of_expert = starts + tl.load(chunk_base_ptr + chunk * num_experts + experts, mask=expert_ok, other=0)
    chosen = ids[:, None] == experts[None, :]                                  # [CHUNK, E_P2]
    base = tl.reduce(tl.where(chosen, base_of_expert[None, :], 0), 1, tl.standard._sum_combine)
    tl.store(sorted_ptr + base + rank, slots, mask=ids < num_experts)        # the slots placed on this rank

    total_rows = tl.reduce(padded, 0, tl.standard._sum_combine)
    if chunk == 0:
        pad = tl.arange(0, BLOCK_M)
        pad_rows = (starts + totals)[:, None] + pad[None, :]                   # [E_P2, BLOCK_M]
        pad_ok = expert_ok[:, None] & (pad_rows < ends[:, None])
        tl.store(sorted_ptr + pad_rows, tl.full((E_P2, BLOCK_M), 0, tl.int32) + num_slots, mask=pad_ok)
        tl.store(num_padded_ptr, total_rows)
    # the expert of block b is the number of experts whose rows end at or before b's first row
    first_block = chunk * blocks_per_program
    for tile in range(0, blocks_per_program, BLOCK_TILE):
        blocks = first_block + tile + tl.arange(0, BLOCK_TILE)
        rows = blocks * BLOCK_M
        done = (ends[None, :] <= rows[:, None]) & expert_ok[None, :]            # [BLOCK_TILE, E_P2]
        expert = tl.reduce(done.to(tl.int32), 1, tl.standard._sum_combine)
        expert = tl.where(rows < total_rows, expert, -1)
        in_share = (tile + tl.arange(0, BLOCK_TILE) < blocks_per_program) & (blocks < num_blocks)
        tl.store(block_experts_ptr + blocks, expert, mask=in_share)


def _kernel(kernel, device: torch.device):
    return interpreted(kernel) if device.type == "cpu" else kernel


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] int32 -> (sorted_slots [capacity], block_experts [capacity / block_m], num_padded [1]),
    all int32 on topk_ids' device (see the module docstring); three launches, no host sync. With `expert_map`
    [E_global] int32, `num_experts` counts the local experts and only their slots are placed."""
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a [T, top_k] int32 tensor, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if expert_map is not None and (expert_map.dtype != torch.int32 or expert_map.dim() != 1):
        raise ValueError(f"expert_map must be an [E] int32 tensor, got {tuple(expert_map.shape)} {expert_map.dtype}")
    device = topk_ids.device
    topk_ids = topk_ids.contiguous()
    num_slots = topk_ids.numel()
    capacity = align_capacity(num_slots, num_experts, block_m)
    num_blocks = capacity // block_m
    num_chunks = max(1, triton.cdiv(num_slots, CHUNK))
    e_p2 = triton.next_power_of_2(num_experts)
    chunk_counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)   # [C, E]
    chunk_base = torch.empty_like(chunk_counts)                                             # [C, E]
    totals = torch.empty(num_experts, dtype=torch.int32, device=device)                     # [E]
    sorted_slots = torch.empty(capacity, dtype=torch.int32, device=device)                  # [capacity]
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)               # [capacity / BM]
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    has_map = expert_map is not None
    map_ptr = expert_map if has_map else topk_ids          # never read without the map
    _kernel(_count_kernel, device)[(num_chunks,)](topk_ids, map_ptr, chunk_counts, num_slots, num_experts,
                                                  CHUNK=CHUNK, E_P2=e_p2, HAS_MAP=has_map)
    _kernel(_prefix_kernel, device)[(triton.cdiv(num_experts, PREFIX_EXPERTS),)](
        chunk_counts, chunk_base, totals, num_chunks, num_experts, CHUNKS=PREFIX_CHUNKS, EXPERTS=PREFIX_EXPERTS)
    _kernel(_scatter_kernel, device)[(num_chunks,)](
        topk_ids, map_ptr, chunk_base, totals, sorted_slots, block_experts, num_padded, num_slots, num_experts,
        num_blocks, triton.cdiv(num_blocks, num_chunks), CHUNK=CHUNK, E_P2=e_p2, BLOCK_M=block_m,
        BLOCK_TILE=BLOCK_TILE, HAS_MAP=has_map)
    return sorted_slots, block_experts, num_padded


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Each slot's local expert, flat [T * top_k] int64: -1 for an expert held elsewhere."""
    flat = topk_ids.flatten().long()
    return flat if expert_map is None else expert_map[flat].long()


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same layout with torch ops (a stable sort); entries past num_padded are the sentinel / -1."""
    flat = local_expert_ids(topk_ids, expert_map)
    num_slots = flat.numel()
    capacity = align_capacity(num_slots, num_experts, block_m)
    placed = flat >= 0
    counts = torch.bincount(flat[placed], minlength=num_experts)              # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(torch.where(placed, flat, num_experts), stable=True).indices[:int(placed.sum())]
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=flat.device)
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=flat.device) - first_of_expert[flat[order]]
    sorted_slots[starts[flat[order]] + rank] = order.to(torch.int32)
    num_padded = int(padded.sum())
    block_experts = torch.full((capacity // block_m,), -1, dtype=torch.int32, device=flat.device)
    block_experts[:num_padded // block_m] = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m).to(torch.int32)
    return sorted_slots, block_experts, torch.tensor([num_padded], dtype=torch.int32, device=flat.device)
