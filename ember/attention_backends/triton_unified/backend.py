"""The Triton unified attention backend: one kernel for mixed prefill/decode batches, a split-KV variant for small
decode batches, CUDA-graph capturable in every mode. On a CPU it runs under TRITON_INTERPRET=1 (for tests).

Backend options (`attention_backend_options`): `split_launch` (default off) gives a mixed bucket a decode launch
and a prefill launch; `fused_decode_kv_write` (default on) lets a uniform-decode bucket's attention kernel write
the new K/V itself instead of a separate cache-write launch. The model hands this backend q and k before its
rotary and q/k norm; `fused_decode_rope` says where a uniform-decode bucket applies them: in its attention kernel
(on), in a kernel of their own (off), or `auto` (default): in the attention kernel for rotary alone, in their own
kernel where there is a q/k norm. On an H100 at batch 1 (one lease, decode tok/s, off vs on): Qwen3-0.6B (q/k norm)
1,044 / 1,079 vs 929 / 940; Llama-3.2-1B (rotary alone) 829 vs 866: the norm's reduction lengthens the short
split-KV programs more than a launch under programmatic dependent launch costs. `single_segment_tiles` (default 0:
off) has a split-KV decode launch attend a request of at most that many KV tiles in one program, which writes the
output itself (the reduce leaves it alone). Measured on an H100 at batch 1, contexts of 32-288 tokens (`ember bench
latency --batch-size 1 --input-len 32 --output-len 256`, Qwen3-0.6B config, runs interleaved in one lease): off
1,080 / 1,078 tok/s, 4 tiles 1,026 / 1,019. The profile gave the reduce 0.025 instead of 0.091 ms of the
critical path, yet the step got slower: one program a KV head walks up to 288 keys alone. So it stays off.
`split_kv` (default on) lets small decode buckets take the split-KV (3D) kernel and its reduce; off, every decode
bucket launches the 2D kernel (one launch a layer fewer at batch 1, for A/B runs and short contexts).
`short_decode_len` (0: off; default `plan.SHORT_DECODE_LEN` where query heads per KV head x head size is at most
`plan.SHORT_DECODE_MAX_WIDTH`, else off): a split-KV decode bucket also gets a short-context graph, for steps whose
requests are all at most this many tokens long, which launches the 2D kernel (see `plan.py` for the
measurements)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention_backends.base import (AttentionBackend, AttentionImpl, AttentionLayerOptions, BuilderContext,
                                           CudaGraphSupport, MetadataBuilder)
from ember.attention_backends.common import CommonAttentionMetadata
from ember.attention_backends.triton_common.device import head_major_cache_shape, triton_layer_reasons
from ember.kv_spec import KVCacheSpec

from .kernels import MODE_DECODES, segment_scratch_numel, unified_attention_2d, unified_attention_3d, write_kv
from .plan import (FUSED_COMBINE_MAX_GROUP, MAX_GROUP_3D, SHORT_DECODE_LEN, SHORT_DECODE_MAX_WIDTH, max_scratch_rows,
                   num_split_segments, plan_launch)

MIN_HEAD_SIZE, MAX_HEAD_SIZE = 16, 256
MAX_QUERIES_PER_KV = 128   # the decode tile packs one token's query heads into at most 128 rows


@dataclass(frozen=True)
class TritonUnifiedMetadata:
    """Views of the step's persistent buffers plus the bucket's (padded) sizes that pick the kernels."""
    query_start_loc: torch.Tensor   # [num_reqs_padded + 1] int32
    seq_lens: torch.Tensor          # [num_reqs_padded] int32
    block_table: torch.Tensor       # [num_reqs_padded, max_blocks_per_req] int32
    slot_mapping: torch.Tensor      # [num_tokens_padded] int64
    num_decodes: torch.Tensor       # [1] int32, live count of leading decodes, filled in place each step
    scratch_out: torch.Tensor       # [rows * head_pad] fp32, 3D partial outputs
    scratch_max: torch.Tensor       # [rows] fp32, 3D partial maxima
    scratch_sum: torch.Tensor       # [rows] fp32, 3D partial sums
    segment_counters: torch.Tensor  # [decode requests * KV heads] int32, 0 between launches
    num_reqs_padded: int
    num_tokens_padded: int
    uniform_decode: bool
    split_launch: bool
    fused_decode_kv_write: bool     # a uniform-decode bucket's attention launch writes the new K/V
    fused_decode_rope: bool | str   # ... and norms and rotates q and the new keys: True, False or "auto"
    single_segment_tiles: int       # split-KV decodes of at most this many KV tiles run in one program (0: none)
    num_sms: int                    # SMs the plan counts on: 0 plans no split-KV launch (`split_kv` off)
    num_decode_tokens: int          # live split of the batch (host ints; informational, never pick a kernel)
    num_prefill_tokens: int


_WORDS = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}


def _flag(ctx: BuilderContext, name: str, default: bool) -> bool:
    """A boolean backend option: True/False, 1/0 (as the command line gives numbers) or on/off, true/false, yes/no."""
    value = ctx.option(name, default)
    if isinstance(value, str) and value.lower() in _WORDS:
        return _WORDS[value.lower()]
    if isinstance(value, str) or value not in (True, False):      # 1 and 0 compare equal to True and False
        raise ValueError(f"{name} {value!r} is not on or off (true/false, 1/0)")
    return bool(value)


class TritonUnifiedMetadataBuilder(MetadataBuilder):
    """Owns the decode-count tensor and the 3D segment scratch (sized for the largest bucket); fills them in place.

    `build` runs outside any CUDA graph, before capture or replay: the graph reads what it wrote."""

    def __init__(self, ctx: BuilderContext):
        super().__init__(ctx)
        spec = ctx.group.spec
        self.split_launch = _flag(ctx, "split_launch", False)
        self.fused_decode_kv_write = _flag(ctx, "fused_decode_kv_write", True)
        rope = ctx.option("fused_decode_rope", "auto")
        words = {**_WORDS, "auto": "auto"}
        self.fused_decode_rope = words.get(rope.lower(), rope) if isinstance(rope, str) else rope
        if self.fused_decode_rope not in (True, False, "auto"):
            raise ValueError(f"fused_decode_rope {rope!r} is not on, off or auto")
        # split_kv off: every decode bucket plans the 2D kernel, as on a GPU of no SMs (no segment scratch either)
        self.split_kv = _flag(ctx, "split_kv", True)
        self.plan_sms = ctx.num_sms if self.split_kv else 0
        single = ctx.option("single_segment_tiles", 0)
        if isinstance(single, bool) or not isinstance(single, int) or single < 0:
            raise ValueError(f"single_segment_tiles {single!r} is not a non-negative number of KV tiles")
        self.single_segment_tiles = single
        short = ctx.option("short_decode_len", None)
        if short is not None and (isinstance(short, bool) or not isinstance(short, int) or short < 0):
            raise ValueError(f"short_decode_len {short!r} is not a non-negative number of tokens (0: off)")
        if short is None:   # the default: short-context graphs for query tiles narrow enough to gain from them
            short = SHORT_DECODE_LEN if ctx.num_queries_per_kv * spec.head_size <= SHORT_DECODE_MAX_WIDTH else 0
        self.short_decode_len = short
        self.num_decodes = torch.zeros(1, dtype=torch.int32, device=ctx.device)   # [1]
        self._num_decodes_value = 0     # what num_decodes holds: a steady decode batch writes it once, not per step
        max_decodes = min(ctx.max_num_reqs, ctx.max_num_tokens)
        rows = max_scratch_rows(max_decodes, spec.num_kv_heads, self.plan_sms)
        num_out, _ = segment_scratch_numel(rows, 1, spec.head_size, 1)
        self.scratch_out = torch.empty(num_out, dtype=torch.float32, device=ctx.device)   # [rows * head_pad]
        self.scratch_max = torch.empty(rows, dtype=torch.float32, device=ctx.device)      # [rows]
        self.scratch_sum = torch.empty(rows, dtype=torch.float32, device=ctx.device)      # [rows]
        # one arrival count per (decode request, KV head) for the fused combine; each launch leaves them at 0
        self.segment_counters = torch.zeros(max_decodes * spec.num_kv_heads, dtype=torch.int32, device=ctx.device)

    def short_context_len(self, num_reqs_padded: int) -> int | None:
        """`short_decode_len` for a decode bucket that plans split-KV: there the 2D kernel serves short requests
        in one launch a layer fewer."""
        # the builder does not see the query heads: a group too wide for split-KV (the plan's other condition) gets
        # a short graph that launches what its other graph does
        heads = self.ctx.group.spec.num_kv_heads
        if not self.short_decode_len or num_split_segments(num_reqs_padded, heads, 1, self.plan_sms) <= 1:
            return None
        return self.short_decode_len

    def build(self, common: CommonAttentionMetadata) -> TritonUnifiedMetadata:
        bound = common.max_seq_len_bound
        short = bound is not None and self.short_decode_len and bound <= self.short_decode_len
        if common.num_decodes != self._num_decodes_value:
            self.num_decodes.fill_(common.num_decodes)
            self._num_decodes_value = common.num_decodes
        i = self.ctx.group_index
        return TritonUnifiedMetadata(
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens, block_table=common.block_tables[i],
            slot_mapping=common.slot_mappings[i], num_decodes=self.num_decodes, scratch_out=self.scratch_out,
            scratch_max=self.scratch_max, scratch_sum=self.scratch_sum, segment_counters=self.segment_counters,
            num_reqs_padded=common.num_reqs_padded,
            num_tokens_padded=common.num_tokens_padded, uniform_decode=common.uniform_decode,
            split_launch=self.split_launch, fused_decode_kv_write=self.fused_decode_kv_write,
            fused_decode_rope=self.fused_decode_rope, single_segment_tiles=self.single_segment_tiles,
            num_sms=0 if short else self.plan_sms, num_decode_tokens=common.num_decode_tokens,
            num_prefill_tokens=common.num_prefill_tokens)


class TritonUnifiedImpl(AttentionImpl):
    """Runs the launches `plan_launch` picks for the bucket. The new K/V go into the cache first, by the cache-write
    kernel, except in a uniform-decode bucket with `fused_decode_kv_write`: there the decode launch is the only one,
    every token is its request's newest, and the attention kernel attends it from `key`/`value` and writes it
    (one launch fewer per layer). A KV-sharing layer writes nothing: its target layer wrote the cache."""

    def forward(self, query, key, value, kv_cache, metadata: TritonUnifiedMetadata, out) -> None:
        self._launch(query, key, value, kv_cache, metadata, out, None)

    def forward_rope(self, query, key, value, kv_cache, metadata: TritonUnifiedMetadata, out, rope) -> None:
        """The uniform-decode launch that writes the new K/V also norms and rotates q and the new keys (a
        power-of-two head, where `fused_decode_rope` allows); any other step norms and rotates them first, in a
        kernel of their own."""
        head_size, fold = self.options.head_size, metadata.fused_decode_rope
        if fold == "auto":
            fold = rope.q_norm is None
        if fold and head_size >= 16 and not head_size & (head_size - 1) and \
                self._fused_write(self._plan(metadata), metadata):
            self._launch(query, key, value, kv_cache, metadata, out, rope)
        else:
            super().forward_rope(query, key, value, kv_cache, metadata, out, rope)

    def _plan(self, metadata: TritonUnifiedMetadata):
        o = self.options
        return plan_launch(metadata.num_tokens_padded, metadata.num_reqs_padded, metadata.uniform_decode,
                           o.num_heads, o.num_kv_heads, o.head_size, metadata.num_sms, metadata.split_launch)

    def _fused_write(self, plan, metadata: TritonUnifiedMetadata) -> bool:
        # a pure function of the bucket and the options, like the plan: a captured graph replays the same choice
        return self.options.kv_sharing_target is None and metadata.fused_decode_kv_write and \
            plan.decode is not None and plan.rest is None

    def _launch(self, query, key, value, kv_cache, metadata: TritonUnifiedMetadata, out, rope) -> None:
        o = self.options
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        plan = self._plan(metadata)
        writes = o.kv_sharing_target is None
        fused = self._fused_write(plan, metadata)
        if writes and not fused:
            write_kv(key, value, key_cache, value_cache, metadata.slot_mapping, pdl=True, kv_scales=self.kv_scales)
        new_kv = (key, value, metadata.slot_mapping) if fused else None
        sinks = None if self.sinks is None else self.sinks.float().contiguous()
        slopes = None if self.alibi_slopes is None else self.alibi_slopes.float().contiguous()
        layout = (query, key_cache, value_cache, out, metadata.block_table, metadata.query_start_loc,
                  metadata.seq_lens)
        options = dict(scale=o.scale, sliding_window=o.sliding_window, soft_cap=o.logits_soft_cap, sinks=sinks,
                       alibi_slopes=slopes, kv_scales=self.kv_scales)
        decode_count = metadata.num_decodes if plan.decode_count_on_device else None
        decode_rope = None if rope is None else rope.as_tuple()
        if plan.decode is not None and plan.num_segments > 1:
            unified_attention_3d(*layout, num_seqs=plan.num_decode_seqs, config=plan.decode,
                                 num_segments=plan.num_segments, scratch_out=metadata.scratch_out,
                                 scratch_max=metadata.scratch_max, scratch_sum=metadata.scratch_sum,
                                 num_decodes=decode_count, new_kv=new_kv, rope=decode_rope, **options,
                                 single_segment_tiles=metadata.single_segment_tiles, counters=metadata.segment_counters
                                 if o.num_heads // o.num_kv_heads <= FUSED_COMBINE_MAX_GROUP else None)
        elif plan.decode is not None:
            unified_attention_2d(*layout, num_seqs=plan.num_decode_seqs, num_tokens=metadata.num_tokens_padded,
                                 config=plan.decode, mode=MODE_DECODES, num_decodes=decode_count, new_kv=new_kv,
                                 rope=decode_rope, **options)
        if plan.rest is not None:
            self._launch_rest(layout, metadata, plan, options)

    def _launch_rest(self, layout, metadata: TritonUnifiedMetadata, plan, options) -> None:
        """The launch over the requests the decode launch left (all of them where it made none)."""
        unified_attention_2d(*layout, num_seqs=metadata.num_reqs_padded, num_tokens=metadata.num_tokens_padded,
                             config=plan.rest, mode=plan.rest_mode, num_decodes=metadata.num_decodes, **options)


class TritonUnifiedBackend(AttentionBackend):
    """Triton kernels over a [2, num_blocks, num_kv_heads, block_size, head_size] cache; every option, every
    CUDA-graph mode. CUDA, or CPU under TRITON_INTERPRET=1. No workspace (`workspace_bytes` 0): the kernels write
    into the step's arguments and the split-KV scratch the builder allocates once, before the cache is sized."""
    name = "triton_unified"
    priority = 10
    cudagraph_support = CudaGraphSupport.ALWAYS
    builder_cls = TritonUnifiedMetadataBuilder
    impl_cls = TritonUnifiedImpl
    option_names = ("split_launch", "fused_decode_kv_write", "fused_decode_rope", "single_segment_tiles", "split_kv",
                    "short_decode_len")
    takes_rope = True

    kv_cache_shape = staticmethod(head_major_cache_shape)

    @classmethod
    def supports(cls, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device,
                 options: AttentionLayerOptions | None = None) -> list[str]:
        return triton_layer_reasons(spec, dtype, device, options, MIN_HEAD_SIZE, MAX_HEAD_SIZE, MAX_QUERIES_PER_KV)


__all__ = ["TritonUnifiedBackend", "TritonUnifiedMetadataBuilder", "TritonUnifiedImpl", "TritonUnifiedMetadata",
           "MAX_GROUP_3D"]
