"""An fp8 (e4m3) KV cache on a GPU, bf16 queries: the Triton kernels (unified 2D, 3D split-KV with the fused write,
flash prefill and decode, TMA tiles included) against the float32 reference over the dequantized cache, and an
engine under CUDA graphs whose fp8 cache gives logits close to the bf16 cache's and greedy output that does not
depend on the batch."""

import dataclasses

import pytest
import torch
import torch.nn.functional as Fn

import ember.attention_backends.flash.kernels as F
import ember.attention_backends.triton_unified.kernels as K
from tests.helpers.greedy_runs import same_until_a_near_tie
from tests.helpers.paged_batches import BatchShape, reference_output, tolerance
from tests.unit.test_fp8_kv_cache import fp8_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPE = torch.bfloat16
SHAPES = [
    BatchShape("ragged_decode", (1,) * 8, (3, 900, 16, 470, 2048, 1, 33, 75), num_heads=32, num_kv_heads=8,
               head_size=128, block_size=64),
    BatchShape("mixed", (1, 1, 70, 300), (90, 2000, 70, 700), num_heads=16, num_kv_heads=8, head_size=128,
               block_size=64),
    BatchShape("sliding_window", (1, 1, 300, 9), (600, 70, 500, 400), sliding_window=128, num_heads=8,
               num_kv_heads=2, head_size=64, block_size=64),
    BatchShape("softcap", (1, 120, 25), (400, 300, 25), soft_cap=30.0, num_heads=8, num_kv_heads=4, head_size=128,
               block_size=64),
]


def _check(out, batch):
    ref = reference_output(batch)
    got = out[:batch.num_tokens].float()
    assert not got.isnan().any()
    err = (got - ref).abs().max().item()
    assert err <= tolerance(DTYPE), f"{batch.shape.name}: max abs error {err:.3g}"


def _kwargs(batch, scales):
    s = batch.shape
    return dict(scale=s.head_size ** -0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap, kv_scales=scales)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_unified_2d_and_flash_attend_the_dequantized_cache(shape):
    batch, scales = fp8_batch(shape, DTYPE, "cuda")
    K.write_kv(batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping, kv_scales=scales)
    layout = (batch.query, batch.kv_cache[0], batch.kv_cache[1])
    tail = (batch.block_table, batch.query_start_loc, batch.seq_lens)
    out = torch.full_like(batch.query, float("nan"))
    K.unified_attention_2d(*layout, out, *tail, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
                           config=K.TileConfig(), **_kwargs(batch, scales))
    _check(out, batch)
    out = torch.full_like(batch.query, float("nan"))
    from ember.attention_backends.flash import plan as P
    group = shape.num_heads // shape.num_kv_heads
    decode = P.decode_tiles(group, shape.head_size, torch.float8_e4m3fn, shape.block_size)
    ws = F.DecodeWorkspace(batch.num_reqs_padded, shape.num_kv_heads, shape.head_size, decode.tile_n,
                           P.decode_target_items(132, shape.num_kv_heads), "cuda")
    ws.plan(batch.seq_lens, shape.num_decodes, shape.sliding_window)
    kw = dict(_kwargs(batch, scales))
    F.flash_decode(*layout, out, *tail, workspace=ws, num_rows=batch.num_reqs_padded, tiles=decode, **kw)
    F.flash_prefill(*layout, out, *tail, num_seqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
                    tiles=P.prefill_tiles(group, shape.head_size, torch.float8_e4m3fn, shape.block_size),
                    num_decodes=ws.params[1:], **kw)
    _check(out, batch)


@pytest.mark.parametrize("shape", [SHAPES[0], dataclasses.replace(SHAPES[2], query_lens=(1,) * 4)],
                         ids=["ragged", "sliding_window"])
def test_unified_3d_fused_write_quantizes_the_new_keys(shape):
    batch, scales = fp8_batch(shape, DTYPE, "cuda")
    out = torch.full_like(batch.query, float("nan"))
    segments = 8
    n_out, n_rows = K.segment_scratch_numel(batch.num_reqs_padded, shape.num_heads, shape.head_size, segments)
    scratch = [torch.empty(n, device="cuda") for n in (n_out, n_rows, n_rows)]
    K.unified_attention_3d(batch.query, batch.kv_cache[0], batch.kv_cache[1], out, batch.block_table,
                           batch.query_start_loc, batch.seq_lens, num_seqs=batch.num_reqs_padded,
                           config=K.TileConfig(block_m=16, tile_n=64, num_warps=4, num_stages=3),
                           num_segments=segments, scratch_out=scratch[0], scratch_max=scratch[1],
                           scratch_sum=scratch[2], new_kv=(batch.key, batch.value, batch.slot_mapping),
                           **_kwargs(batch, scales))
    _check(out, batch)
    # the hardware's e4m3 conversion rounds as torch's: the written bytes equal the reference's quantization
    written = torch.stack([batch.kv_cache[h].double() * scales[h].double()[None, :, None, None] for h in (0, 1)])
    assert torch.equal(written[:, 1:].nan_to_num(0), batch.expected_cache[:, 1:].nan_to_num(0))


def test_engine_fp8_kv_cache_under_graphs():
    """Qwen3-0.6B's config with random weights, CUDA graphs and the fused decode write: the fp8 cache's logits stay
    close to the bf16 cache's, and a request's greedy output alone and in a batch agree up to a near tie."""
    from ember import LLM, SamplingParams
    prompts = [[(7 * i + 13 * j) % 5000 + 10 for j in range(300)] for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    logits = {}
    for kv in ("auto", "fp8"):
        llm = LLM("qwen3-0.6b", load_format="dummy", kv_cache_dtype=kv, gpu_memory_utilization=0.5, max_num_seqs=16)
        logits[kv] = llm.engine.score(prompts[0]).float()
        if kv == "fp8":
            together = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
            alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0] for p in prompts[:2]]
            shared = [same_until_a_near_tie(a, t) for a, t in zip(alone, together)]
            print(f"greedy tokens shared alone and in a batch: {shared} of 24")
        del llm
    a, b = logits["auto"], logits["fp8"]
    assert Fn.cosine_similarity(a, b, dim=-1).min().item() >= 0.98
