"""cpu_sdpa cuts a step into pieces that each cost at most PIECE_BYTES: where they are cut, the same output as
torch_ref however small the pieces, and what a call allocates within the backend's declared workspace."""

from __future__ import annotations

import pytest
import torch

from ember.attention_backends import cpu_sdpa
from ember.attention_backends.base import BuilderContext, StepBounds
from ember.attention_backends.cpu_sdpa import CpuSdpaBackend, PieceCost, split_into_pieces
from ember.attention_backends.torch_ref import TorchRefBackend
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from tests.helpers.paged_batches import BatchShape, common_metadata, make_paged_batch, tolerance
from tests.helpers.peak_memory import PeakMemory


def _area(num_reqs: int, query_len: int, span: int) -> int:
    return num_reqs * query_len * span


@pytest.mark.parametrize("query_lens, seq_lens, budget, pieces", [
    # six decodes of one block, three to a piece
    ((1,) * 6, (16,) * 6, 48, [(0, 3, 0, 0), (3, 6, 0, 0)]),
    # a decode over the budget alone stays one piece, between runs of the others
    ((1, 1, 1, 1), (16, 100, 16, 16), 48, [(0, 1, 0, 0), (1, 2, 0, 0), (2, 4, 0, 0)]),
    # padded to 40 rows, a third prefill would take 120 rows for 44 tokens: cut
    ((40, 2, 2), (40, 2, 2), 10 ** 6, [(0, 2, 0, 0), (2, 3, 0, 0)]),
    # a prefill over the budget alone: chunks of 30 rows (30 x 160 keys), after the run before it
    ((4, 100, 5), (4, 150, 5), 30 * 160, [(0, 1, 0, 0), (1, 2, 0, 30), (1, 2, 30, 60), (1, 2, 60, 90),
                                          (1, 2, 90, 100), (2, 3, 0, 0)]),
])
def test_where_a_step_is_cut(query_lens, seq_lens, budget, pieces):
    assert split_into_pieces(list(query_lens), list(seq_lens), 16, _area, budget) == pieces


def _context(shape: BatchShape, dtype: torch.dtype) -> BuilderContext:
    spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, dtype, shape.sliding_window)
    return BuilderContext(KVCacheGroup(("layer.0",), spec), 0, dtype, torch.device("cpu"), 16, 1024, 1024,
                          num_queries_per_kv=shape.num_heads // shape.num_kv_heads)


def _run(backend, shape: BatchShape, dtype: torch.dtype, batch):
    cache = batch.kv_cache.transpose(2, 3).contiguous()     # the backends' [2, blocks, block_size, Hkv, D]
    cache[:, 0] = 0.0
    out = torch.full_like(batch.query, float("nan"))
    metadata = backend.builder_cls(_context(shape, dtype)).build(common_metadata(batch))
    backend.impl_cls(shape.options()).forward(batch.query, batch.key, batch.value, cache, metadata, out)
    return out, metadata


SHAPES = {
    "decodes_and_prefills": BatchShape("decodes_and_prefills", (1, 1, 1, 9, 4, 30), (20, 70, 7, 30, 4, 50),
                                       pad_reqs=1, pad_tokens=2),
    "long_prefill_after_context": BatchShape("long_prefill_after_context", (1, 96), (40, 200), num_heads=8,
                                             num_kv_heads=2),
    "sliding_gqa4": BatchShape("sliding_gqa4", (1, 1, 64, 3), (50, 9, 120, 3), num_heads=8, num_kv_heads=2,
                               sliding_window=24),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("step_masks", [True, False])
def test_small_pieces_give_torch_refs_output(monkeypatch, name, step_masks):
    shape, dtype = SHAPES[name], torch.float32
    monkeypatch.setattr(cpu_sdpa, "PIECE_BYTES", 400_000 + torch.get_num_threads() * cpu_sdpa.SDPA_THREAD_BYTES)
    monkeypatch.setattr(cpu_sdpa, "STEP_MASK_BYTES", 1 << 20 if step_masks else 0)
    batch = make_paged_batch(shape, dtype, "cpu", torch.Generator().manual_seed(3))
    out, metadata = _run(CpuSdpaBackend, shape, dtype, batch)
    ref, _ = _run(TorchRefBackend, shape, dtype, batch)
    assert len(metadata.parts) >= 3                  # cut beyond the ordinary decodes-and-prefills pair
    assert any(p.mask is not None for p in metadata.parts) == step_masks
    n = batch.num_tokens
    assert not out[:n].isnan().any()
    err = (out[:n] - ref[:n]).abs().max().item()
    assert err <= tolerance(dtype), f"{name}: max abs error {err:.3g}"


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_call_stays_within_the_declared_workspace(monkeypatch, kv_dtype):
    """A 512-token prefill after 512 tokens of context, 8 query heads on 2 KV heads, with pieces of 4 MiB: each
    layer call's allocations (those ops return; SDPA's own scratch is declared by thread, not seen here) and the
    step's metadata stay within what the backend declares; an e4m3 cache's pages are dequantized in each call."""
    monkeypatch.setattr(cpu_sdpa, "PIECE_BYTES", 4 << 20)
    shape, dtype = BatchShape("big", (1, 512), (600, 1024), num_heads=8, num_kv_heads=2), torch.bfloat16
    batch = make_paged_batch(shape, dtype, "cpu", torch.Generator().manual_seed(4))
    spec = KVCacheSpec(16, 2, 64, kv_dtype, None)
    bounds = StepBounds(513, 2, 1024)
    cache = batch.kv_cache.transpose(2, 3).contiguous()     # the backend's [2, blocks, block_size, Hkv, D]
    cache[:, 0] = 0.0
    cache = cache.to(kv_dtype)
    out = torch.full_like(batch.query, float("nan"))
    builder = CpuSdpaBackend.builder_cls(BuilderContext(KVCacheGroup(("layer.0",), spec), 0, dtype,
                                                        torch.device("cpu"), 16, 1024, 1024, num_queries_per_kv=4))
    impl = CpuSdpaBackend.impl_cls(shape.options())
    impl.kv_scales = (torch.full((2,), 0.5), torch.full((2,), 0.25))
    with PeakMemory() as memory:
        metadata = builder.build(common_metadata(batch))
        held = memory.live
        with memory.section():
            impl.forward(batch.query, batch.key, batch.value, cache, metadata, out)
    assert len(metadata.parts) > 2 and not out[:batch.num_tokens].isnan().any()
    assert 0 < memory.section_peaks[0] <= CpuSdpaBackend.workspace_bytes(bounds, spec, shape.options(), dtype)
    assert 0 < held <= CpuSdpaBackend.metadata_bytes(bounds, spec, 4, dtype)
    assert PieceCost.of(spec, 4, dtype)(1, 512, 1024) > 4 << 20       # one piece would have taken more
