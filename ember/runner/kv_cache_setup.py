"""From a built model to KV-cache groups, backends, cache tensors and metadata builders, and the cache's size
(`num_kv_blocks`, `resolve_max_model_len`)."""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ember.attention_backends.base import (AttentionBackend, AttentionLayerOptions, BuilderContext, MetadataBuilder,
                                           StepBounds)
from ember.attention_backends.op import AttentionLayerState
from ember.attention_backends.registry import BackendSelectionError, select_backend
from ember.distributed.parallel_state import agree
from ember.models.layers.attention import Attention
from ember.kv_spec import KVCacheGroup, KVCacheSpec, blocks_per_request
from ember.runner.cpu_memory import available_memory_bytes, cpu_kv_cache_bytes

logger = logging.getLogger("ember")


@dataclass
class AttentionSetup:
    """The model's attention layers grouped by KV-cache spec, each group with its chosen backend.

    Every group owns `slots_per_block` cache layers (the last group of a spec may own fewer), so that one block id
    of the shared pool means one page in each of `slots_per_block` slot tensors, whichever group holds it."""
    layers: dict[str, Attention]
    groups: list[KVCacheGroup]
    backends: list[type[AttentionBackend]]
    refused: list[dict[str, list[str]]]

    @property
    def num_cache_layers(self) -> int:
        """Layers that own a cache tensor (KV-sharing layers read another's)."""
        return sum(len(g.layer_names) - len(g.kv_sharing) for g in self.groups)

    @property
    def slots_per_block(self) -> int:
        return max(len(g.layer_names) - len(g.kv_sharing) for g in self.groups)

    def bytes_per_block(self) -> int:
        """Bytes one block id of the shared pool costs: a page in every slot tensor."""
        return self.slots_per_block * self.groups[0].spec.page_size_bytes

    def max_len_for(self, num_usable_blocks: int, chunk: int, upper: int) -> int:
        """The longest request (at most `upper` tokens) whose blocks fit in `num_usable_blocks` when it is
        prefilled `chunk` tokens per step: what the full-attention groups' cache can hold once the sliding-window
        groups have their window."""
        def fits(n: int) -> bool:
            return blocks_per_request(self.groups, n, min(chunk, n)) <= num_usable_blocks

        lo, hi = 0, upper      # fits(lo) holds; find the largest n in [lo, hi] that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def capacity_tokens(self, num_usable_blocks: int, request_len: int) -> tuple[int, int]:
        """(tokens the pool holds as requests of `request_len` tokens, tokens it would hold if every layer kept
        every token): the gain of freeing what sliding windows no longer see."""
        per_request = blocks_per_request(self.groups, request_len)
        held = num_usable_blocks * request_len // max(per_request, 1)
        block_size = self.groups[0].spec.block_size
        full_equivalent = num_usable_blocks * self.slots_per_block * block_size // self.num_cache_layers
        return held, full_equivalent


def find_attention_layers(model: nn.Module) -> dict[str, Attention]:
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
    if not layers:
        raise ValueError(f"model {type(model).__name__} has no ember Attention layers")
    return layers


def _owner_of(name: str, layers: dict[str, Attention]) -> str:
    """The layer whose cache `name` reads, following chains of KV sharing."""
    seen = [name]
    while layers[seen[-1]].options.kv_sharing_target is not None:
        target = layers[seen[-1]].options.kv_sharing_target
        if target not in layers:
            raise ValueError(f"layer {seen[-1]!r} shares the KV cache of {target!r}, which is not an attention layer")
        if target in seen:
            raise ValueError(f"KV sharing forms a cycle: {' -> '.join(seen + [target])}")
        seen.append(target)
    return seen[-1]


def group_layers(layers: dict[str, Attention], block_size: int, dtype: torch.dtype) -> list[KVCacheGroup]:
    """Groups of equally many cache-owning layers, each of one spec, in layer order; a KV-sharing layer joins the
    group of the layer whose cache it reads.

    The group size is the smallest number of layers any spec has (Gemma 3 1B: 4 global and 22 local layers make
    one global group and six local ones of four), so every block id of the shared pool costs the same."""
    def spec_of(layer: Attention) -> KVCacheSpec:
        o = layer.options
        return KVCacheSpec(block_size, o.num_kv_heads, o.head_size, dtype, o.sliding_window)

    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, layer in layers.items():
        if layer.options.kv_sharing_target is None:
            by_spec.setdefault(spec_of(layer), []).append(name)
    if not by_spec:
        raise ValueError("every attention layer shares another's KV cache; at least one must own a cache")
    page_sizes = {spec.page_size_bytes for spec in by_spec}
    if len(page_sizes) > 1:
        detail = "; ".join(f"{by_spec[s][0]} and {len(by_spec[s]) - 1} more: {s.num_kv_heads} KV heads of "
                           f"{s.head_size}" for s in by_spec)
        raise ValueError(f"attention layers with different KV page sizes ({detail}) cannot share one block pool")
    size = min(len(names) for names in by_spec.values())
    chunks = [(spec, names[i:i + size]) for spec, names in by_spec.items() for i in range(0, len(names), size)]
    chunks.sort(key=lambda c: list(layers).index(c[1][0]))
    members = [list(names) for _, names in chunks]
    sharing: list[list[tuple[str, str]]] = [[] for _ in chunks]
    group_of = {name: gi for gi, names in enumerate(members) for name in names}
    for name, layer in layers.items():
        if layer.options.kv_sharing_target is None:
            continue
        owner = _owner_of(name, layers)
        gi = group_of[owner]
        if spec_of(layer) != chunks[gi][0]:
            raise ValueError(f"layer {name!r} shares the KV cache of {owner!r} but attends differently "
                             f"({spec_of(layer)} vs {chunks[gi][0]})")
        members[gi].append(name)
        sharing[gi].append((name, owner))
    return [KVCacheGroup(tuple(names), spec, tuple(shared))
            for (spec, _), names, shared in zip(chunks, members, sharing)]


def kv_cache_dtype_of(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for `kv_cache_dtype` ("auto": the model's `dtype`; "fp8", "fp8_e4m3": float8_e4m3fn)."""
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def select_backends(model: nn.Module, block_size: int, dtype: torch.dtype, device: torch.device,
                    requested: str, kv_cache_dtype: str = "auto") -> AttentionSetup:
    """Group the model's layers and pick a backend per group (one that reads and writes the cache's dtype),
    logging every refused backend's reasons."""
    layers = find_attention_layers(model)
    groups = group_layers(layers, block_size, kv_cache_dtype_of(kv_cache_dtype, dtype))
    backends, refused = [], []
    for g in groups:
        options: list[AttentionLayerOptions] = list({layers[n].options for n in g.layer_names})
        try:
            sel = select_backend(g.spec, dtype, device, options, requested)
        except BackendSelectionError as exc:
            shown = ", ".join(g.layer_names[:4]) + (f" and {len(g.layer_names) - 4} more" if len(g.layer_names) > 4
                                                    else "")
            raise BackendSelectionError(f"layers {shown} ({g.spec.kind}"
                                        f"{'' if g.spec.sliding_window is None else f' {g.spec.sliding_window}'}): "
                                        f"{exc}") from None
        for name, reasons in sel.refused.items():
            logger.info("attention backend %s not used for %s layers: %s", name, g.spec.kind, "; ".join(reasons))
        logger.info("attention backend %s for %d %s layers", sel.backend.name, len(g.layer_names), g.spec.kind)
        backends.append(sel.backend)
        refused.append(sel.refused)
        for name in g.layer_names:
            layers[name].fuse_rope = sel.backend.takes_rope
    return AttentionSetup(layers, groups, backends, refused)


def zeroed(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled 1-D tensor. On the CPU its memory comes zeroed from the OS (calloc, through numpy) and pages
    in as the cache fills, instead of being written whole up front: torch.zeros took 3.3 s of a 28 s start-up for
    a 2 GiB cache on two cores. The start is aligned to 64 bytes, as torch's own CPU allocations are."""
    if torch.device(device).type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    offset = -raw.ctypes.data % 64
    return torch.from_numpy(raw[offset:offset + nbytes]).view(dtype)


def allocate_kv_caches(setup: AttentionSetup, num_blocks: int, device: torch.device,
                       sharing_metadata_offset: int = 0) -> dict[str, AttentionLayerState]:
    """Allocate the slot tensors of the shared pool, view each owning layer's slot in its backend's layout and
    bind every layer to an impl (a KV-sharing layer to its owner's cache and group). A KV-sharing layer reads its
    metadata at index group + `sharing_metadata_offset` (the runner puts the prefill-skipping tail's there)."""
    spec0 = setup.groups[0].spec
    page_numel = spec0.page_size_bytes // torch.empty((), dtype=spec0.dtype).element_size()
    slots = [zeroed(num_blocks * page_numel, spec0.dtype, device)
             for _ in range(setup.slots_per_block)]   # each [num_blocks * 2 * block_size * Hkv * D]
    states: dict[str, AttentionLayerState] = {}
    placements = set()
    for gi, (g, backend) in enumerate(zip(setup.groups, setup.backends)):
        s = g.spec
        shape = tuple(backend.kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads, s.head_size))
        if math.prod(shape) != num_blocks * page_numel:
            raise ValueError(f"attention backend {backend.name}'s cache shape {shape} does not hold {page_numel} "
                             f"elements per block")
        # groups hand block ids to each other, so a block must cover the same bytes in every group's layout
        placements.add(shape[:2] if shape[:2] == (2, num_blocks) else shape[:1])
        if len(placements) > 1:
            raise ValueError(f"attention backend {backend.name}'s cache shape {shape} places blocks differently "
                             f"from another group's backend; the groups cannot share one pool (pick one backend)")
        shared = dict(g.kv_sharing)
        owners = [name for name in g.layer_names if name not in shared]
        caches = {name: slots[k].view(shape) for k, name in enumerate(owners)}
        for name in g.layer_names:
            cache = caches[shared.get(name, name)]
            index = gi + sharing_metadata_offset if name in shared else gi
            impl = backend.impl_cls(setup.layers[name].options, sinks=getattr(setup.layers[name], "sinks", None))
            if s.dtype == torch.float8_e4m3fn:    # the owner's scales: it wrote the cache
                impl.kv_scales = kv_scales_of(setup.layers[shared.get(name, name)], device)
            states[name] = AttentionLayerState(impl, cache, index)
    return states


def kv_scales_of(layer: Attention, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cache's (k_scale, v_scale) for one layer, float32 [Hkv] each: the checkpoint's (`layer.kv_scales`,
    which the loader sets), else 1.0 (measured against per-head scales on the default model: docs/quantization.md)."""
    if layer.kv_scales is not None:
        return tuple(scale.to(device=device, dtype=torch.float32).contiguous() for scale in layer.kv_scales)
    ones = torch.ones(layer.options.num_kv_heads, dtype=torch.float32, device=device)
    return ones, ones.clone()


def log_capacity(attn: AttentionSetup, num_blocks: int, max_model_len: int, block_size: int,
                 dtype: torch.dtype) -> tuple[int, int]:
    """Log and return how many tokens the cache holds as requests of max_model_len tokens, beside what it would hold
    if every layer kept every token (the two differ when sliding-window groups free what they no longer see)."""
    held, full_equivalent = attn.capacity_tokens(num_blocks - 1, max_model_len)
    logger.info("KV cache: %d tokens (full-attention equivalent: %d) in %d blocks of %d tokens, %d groups%s",
                held, full_equivalent, num_blocks - 1, block_size, len(attn.groups), capacity_note(attn, held, dtype))
    return held, full_equivalent


def capacity_note(attn: AttentionSetup, held: int, dtype: torch.dtype) -> str:
    """For an fp8 cache: the tokens the same memory would hold in the model's `dtype` (for the start-up log)."""
    spec = attn.groups[0].spec
    if spec.dtype == dtype:
        return ""
    ratio = torch.empty((), dtype=spec.dtype).element_size() / torch.empty((), dtype=dtype).element_size()
    return f"; {spec.dtype} pages (in {dtype} the same memory holds {int(held * ratio)} tokens)"


def make_builders(setup: AttentionSetup, dtype: torch.dtype, device: torch.device, max_num_reqs: int,
                  max_num_tokens: int, max_model_len: int, capture_sizes: tuple[int, ...],
                  backend_options: tuple = ()) -> list[MetadataBuilder]:
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0

    def group_width(g) -> int:     # query heads per KV head, the widest of the group's layers
        return max(setup.layers[n].options.num_heads // setup.layers[n].options.num_kv_heads for n in g.layer_names)

    return [backend.builder_cls(BuilderContext(g, gi, dtype, device, max_num_reqs, max_num_tokens, max_model_len,
                                               capture_sizes, num_sms, backend_options, group_width(g)))
            for gi, (g, backend) in enumerate(zip(setup.groups, setup.backends))]


GRAPH_RESERVE_BYTES = 512 << 20  # left free for CUDA-graph pools and allocator slack


@dataclass(frozen=True)
class AttentionWorkspace:
    """The most memory the attention may allocate for itself in the largest step (`bounds`), and whose the largest
    part is: every builder's step metadata, held through the step, and the largest one layer's call declares
    (layers attend one after another, so that is set aside once)."""
    nbytes: int
    backend: str
    bounds: StepBounds

    def describe(self) -> str:
        b = self.bounds
        return (f"attention backend {self.backend} needs {_gib(self.nbytes)} GiB of workspace for its largest step "
                f"({b.num_tokens} tokens over up to {b.num_reqs} requests, against {b.context_len} tokens of "
                f"context)")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"


def attention_workspace(attn: AttentionSetup, dtype: torch.dtype, bounds: StepBounds,
                        builder_sets: int = 1) -> AttentionWorkspace:
    """What the backends declare for `bounds`: the metadata of every group's builders (`builder_sets` of them a
    group: two where KV-sharing layers have builders of their own), plus the largest one layer's call
    (`AttentionBackend.metadata_bytes`, `AttentionBackend.workspace_bytes`)."""
    metadata, call, owner = 0, 0, None
    largest_step, step_owner = 0, attn.backends[0]
    for g, backend in zip(attn.groups, attn.backends):
        layers = [attn.layers[n].options for n in g.layer_names]
        width = max(o.num_heads // o.num_kv_heads for o in layers)
        step = builder_sets * backend.metadata_bytes(bounds, g.spec, width, dtype)
        metadata += step
        if step > largest_step:
            largest_step, step_owner = step, backend
        for options in set(layers):
            nbytes = backend.workspace_bytes(bounds, g.spec, options, dtype)
            if nbytes > call:
                call, owner = nbytes, backend
    return AttentionWorkspace(metadata + call, (owner or step_owner).name, bounds)


def free_dropped_engines(device: torch.device) -> None:
    """Before a CUDA engine loads its weights: when this process already holds device memory, which may be an
    engine dropped but not yet freed (engines sit in reference cycles, and the start-up pauses the collector), run
    the cycle collector and give the freed blocks back to the device, so the new weights do not meet a device the
    dropped engine still fills. Nothing runs in a process that holds no device memory yet."""
    if device.type != "cuda" or torch.cuda.memory_reserved(device) == 0:
        return
    gc.collect()
    torch.cuda.empty_cache()


def num_kv_blocks(attn: AttentionSetup, cache_config, model: nn.Module, device: torch.device, wanted_len: int,
                  max_num_reqs: int, max_num_tokens: int, activation_peak: int,
                  workspace: AttentionWorkspace | None = None) -> int:
    """`_rank_num_kv_blocks` of this rank, made the same on every tensor-parallel rank: the fewest any rank's memory
    allows (every rank holds the same block ids)."""
    return agree([_rank_num_kv_blocks(attn, cache_config, model, device, wanted_len, max_num_reqs, max_num_tokens,
                                      activation_peak, workspace)], "min")[0]


def _rank_num_kv_blocks(attn: AttentionSetup, cache_config, model: nn.Module, device: torch.device, wanted_len: int,
                        max_num_reqs: int, max_num_tokens: int, activation_peak: int,
                        workspace: AttentionWorkspace | None = None) -> int:
    """Blocks of the shared pool, the reserved null block 0 included: `num_kv_blocks` when asked; on the CPU
    enough for `max_num_reqs` requests of `wanted_len` tokens within the CPU budget, taken from the memory the
    attention's `workspace` leaves; on CUDA what `gpu_memory_utilization` leaves after the weights, a full-size
    step's activations, the attention's workspace and the graphs' reserve. Refuses (ValueError) a workspace that
    leaves no room for a cache of one full-size step, with both figures."""
    cc = cache_config
    per_block = attn.bytes_per_block()
    reserved = 0 if workspace is None else workspace.nbytes
    if cc.num_kv_blocks is not None:
        return cc.num_kv_blocks + 1
    # a useful cache holds at least one request of a full-size step
    useful = (blocks_per_request(attn.groups, min(wanted_len, max_num_tokens)) + 1) * per_block if reserved else 0
    if device.type == "cpu":
        available = available_memory_bytes()
        if available is not None and available - reserved < useful:
            raise ValueError(f"{workspace.describe()}, and {_gib(available)} GiB of host memory is available: no "
                             f"room is left for a KV cache of one full-size step ({_gib(useful)} GiB); lower "
                             f"max_num_batched_tokens or max_model_len, or choose another attention backend")
        cap = blocks_per_request(attn.groups, wanted_len) * max_num_reqs + 1
        budget = cpu_kv_cache_bytes(None if available is None else available - reserved)
        if available is not None and reserved:
            budget = min(budget, available - reserved)      # the budget's floor never eats into the workspace
        blocks = max(2, min(cap, budget // per_block))
        logger.info("KV cache on the CPU: %.2f GiB, %d blocks of %d tokens (budget %.2f GiB: a quarter of the "
                    "available memory the attention's %.2f GiB of workspace leaves, at most 2 GiB)",
                    blocks * per_block / 2**30, blocks, cc.block_size, budget / 2**30, reserved / 2**30)
        return blocks
    # this engine may use gpu_memory_utilization of the device for weights, activations and KV cache, and never
    # more than is actually free (other engines or processes may hold the rest)
    total = torch.cuda.get_device_properties(device).total_memory
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    allowed = int(total * cc.gpu_memory_utilization) - weights
    free_now = torch.cuda.mem_get_info(device)[0]
    if free_now < allowed:
        # something else holds device memory; it may be an engine dropped in this process whose reference cycles
        # the cycle collector has not reached yet (an engine is freed only by it): collect, then look again
        gc.collect()
        torch.cuda.empty_cache()
        free_now = torch.cuda.mem_get_info(device)[0]
    left = min(allowed, free_now) - activation_peak - GRAPH_RESERVE_BYTES
    free = left - reserved
    hint = (f"raise gpu_memory_utilization ({cc.gpu_memory_utilization}) or lower max_num_batched_tokens "
            f"({max_num_tokens})")
    if free < useful <= left:       # the workspace is what leaves no useful cache
        raise ValueError(f"{workspace.describe()}, and {_gib(left)} GiB of GPU memory is left after the weights "
                         f"({_gib(weights)} GiB), a full-size step's activations ({_gib(activation_peak)} GiB) and "
                         f"the CUDA graphs' reserve: no room is left for a KV cache of one full-size step "
                         f"({_gib(useful)} GiB); {hint}, lower max_model_len, or choose another attention backend")
    if free < 2 * per_block:
        raise ValueError(f"only {max(free, 0) / 2**30:.2f} GiB of GPU memory is left for the KV cache after the "
                         f"weights ({weights / 2**30:.2f} GiB), a full-size step ({activation_peak / 2**30:.2f} "
                         f"GiB) and the attention's workspace ({reserved / 2**30:.2f} GiB) with "
                         f"{free_now / 2**30:.2f} GiB free; {hint}")
    logger.info("KV cache: %.2f GiB, %d blocks of %d tokens (%.2f GiB set aside for the attention's workspace)",
                free / 2**30, free // per_block, cc.block_size, reserved / 2**30)
    return int(free // per_block)


def resolve_max_model_len(attn: AttentionSetup, asked: int | None, model_len: int, num_blocks: int,
                          max_num_tokens: int) -> int:
    """The longest request the engine takes: `asked` when the model and the cache allow it (else ValueError), or
    the model's length lowered to what the cache holds."""
    # what one request can reach: the full-attention groups hold all its tokens, sliding-window groups their
    # window and one prefill chunk
    capacity = attn.max_len_for(num_blocks - 1, max_num_tokens, max(model_len, asked or 0))
    if asked is not None:
        if asked > model_len:
            raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings {model_len}")
        if asked > capacity:
            raise ValueError(f"max_model_len {asked} exceeds the KV cache capacity of {capacity} tokens; lower "
                             f"max_model_len or give the cache more blocks (num_kv_blocks, gpu_memory_utilization)")
        return asked
    if model_len > capacity:
        logger.warning("max_model_len lowered from the model's %d to the KV cache capacity of %d tokens",
                       model_len, capacity)
    return min(model_len, capacity)
