"""Buckets, mode resolution and the step dispatcher: every requested mode x backend support level, as tables."""

import logging

import pytest
import torch

from ember.attention_backends.base import AttentionBackend, CudaGraphSupport
from ember.attention_backends.torch_ref import TorchRefBackend
from ember.config import CompileConfig
from ember.graphs.buckets import (DEFAULT_CAPTURE_SIZES, decode_capture_sizes, default_capture_sizes, pad_to_bucket,
                                  resolve_capture_sizes, validate_capture_sizes)
from ember.graphs.cuda_graph import CUDAGraphManager, CUDAGraphWrapper
import ember.graphs.dispatcher as dispatcher_module
from ember.graphs.dispatcher import CudaGraphDispatcher, min_support, resolve_modes
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode

M = CUDAGraphMode
S = CudaGraphSupport
BD = BatchDescriptor


def backend_with(support: CudaGraphSupport, name: str | None = None) -> type[AttentionBackend]:
    return type(f"Fake{support.name}", (AttentionBackend,), {"name": name or support.name.lower(),
                                                           "cudagraph_support": support})


# ---- buckets ---------------------------------------------------------------------------------------------------

def test_default_capture_sizes_shape():
    sizes = default_capture_sizes(8192)
    assert sizes[:5] == (1, 2, 4, 8, 16)
    assert sizes == DEFAULT_CAPTURE_SIZES and len(sizes) == 27
    assert sizes[3:19] == tuple(range(8, 129, 8)) and sizes[19:] == (160, 192, 224, 256, 320, 384, 448, 512)
    assert default_capture_sizes(8192, max_capture_size=1024)[-1] == 1024
    assert default_capture_sizes(8192, max_capture_size=1024)[27:] == tuple(range(576, 1025, 64))


@pytest.mark.parametrize("max_tokens, want_last, want_len", [(100, 96, 15), (8, 8, 4), (3, 2, 2), (300, 256, 23)])
def test_default_capture_sizes_bounded_by_max_tokens(max_tokens, want_last, want_len):
    sizes = default_capture_sizes(max_tokens)
    assert sizes[-1] == want_last and len(sizes) == want_len
    assert all(s <= max_tokens for s in sizes)


@pytest.mark.parametrize("num_tokens, want", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16), (17, None), (1000, None)])
def test_pad_to_bucket(num_tokens, want):
    assert pad_to_bucket(num_tokens, (1, 2, 4, 8, 16)) == want


def test_decode_sizes_cover_max_num_seqs():
    assert decode_capture_sizes((1, 2, 4, 8, 16, 24), 10) == (1, 2, 4, 8, 10)
    assert decode_capture_sizes((1, 2, 4, 8), 10) == (1, 2, 4, 8)      # nothing larger was dropped: no extra size
    assert decode_capture_sizes((1, 2, 4, 8, 16), 8) == (1, 2, 4, 8)


def test_capture_sizes_validation():
    assert validate_capture_sizes([8, 1, 8, 4], 16) == (1, 4, 8)
    assert resolve_capture_sizes(None, 16) == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="capture size 32 exceeds max_num_batched_tokens 16"):
        validate_capture_sizes([4, 32], 16)
    with pytest.raises(ValueError, match="capture size 0"):
        validate_capture_sizes([0, 4], 16)
    with pytest.raises(ValueError, match="empty"):
        validate_capture_sizes([], 16)


def test_mode_parse_and_properties():
    assert M.parse("auto") == M.FULL_AND_PIECEWISE
    assert M.parse("PIECEWISE") == M.PIECEWISE and M.parse(M.FULL) == M.FULL
    with pytest.raises(ValueError, match="'sometimes'"):
        M.parse("sometimes")
    assert [m for m in M if m.has_full] == [M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE]
    assert [m for m in M if m.has_piecewise] == [M.PIECEWISE, M.FULL_AND_PIECEWISE]
    assert hash(BD(8, 8, True)) == hash(BD(8, 8, True)) and BD(8) != BD(8, 8)
    assert BD(8).padded_num_reqs(3) == 3 and BD(8, 8, True).padded_num_reqs(3) == 8


# ---- resolution ------------------------------------------------------------------------------------------------

SUPPORTS = [S.NEVER, S.UNIFORM_SINGLE_TOKEN_DECODE, S.UNIFORM_BATCH, S.ALWAYS]
# requested mode -> resolved mode per support level (NEVER, SINGLE_TOKEN_DECODE, UNIFORM_BATCH, ALWAYS), on CUDA
RESOLVED = {
    "none":               [M.NONE, M.NONE, M.NONE, M.NONE],
    "piecewise":          [M.PIECEWISE, M.PIECEWISE, M.PIECEWISE, M.PIECEWISE],
    "full":               [M.PIECEWISE, M.FULL_AND_PIECEWISE, M.FULL_AND_PIECEWISE, M.FULL],
    "full_decode_only":   [M.NONE, M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY],
    "full_and_piecewise": [M.PIECEWISE, M.FULL_AND_PIECEWISE, M.FULL_AND_PIECEWISE, M.FULL],
    "auto":               [M.PIECEWISE, M.FULL_AND_PIECEWISE, M.FULL_AND_PIECEWISE, M.FULL],
}
# resolved mode -> runtime mode of (a uniform-decode batch of 3, a mixed batch of 5 tokens over 2 requests,
# a mixed batch beyond the largest bucket)
RUNTIME = {
    M.NONE:               (M.NONE, M.NONE, M.NONE),
    M.PIECEWISE:          (M.PIECEWISE, M.PIECEWISE, M.NONE),
    M.FULL:               (M.FULL, M.FULL, M.NONE),
    M.FULL_DECODE_ONLY:   (M.FULL, M.NONE, M.NONE),
    M.FULL_AND_PIECEWISE: (M.FULL, M.PIECEWISE, M.NONE),
}
CASES = [(req, s, RESOLVED[req][i]) for req in RESOLVED for i, s in enumerate(SUPPORTS)]


@pytest.mark.parametrize("requested, support, want", CASES, ids=[f"{r}-{s.name}" for r, s, _ in CASES])
def test_resolve_and_dispatch_every_mode_and_support(requested, support, want):
    resolved = resolve_modes(CompileConfig(compile_mode="default", cudagraph_mode=requested), "cuda",
                             [backend_with(support)])
    assert resolved.cudagraph_mode == want
    assert resolved.compile_mode == "default"
    assert bool(resolved.reasons) == (want != M.parse(requested))
    dispatcher = CudaGraphDispatcher(resolved.cudagraph_mode, (1, 2, 4, 8, 16), max_num_seqs=8, support=support)
    got = (dispatcher.dispatch(3, 3, True)[0], dispatcher.dispatch(5, 2, False)[0], dispatcher.dispatch(40, 3, False)[0])
    assert got == RUNTIME[want]


def test_reason_is_logged_with_the_backend_name(caplog):
    with caplog.at_level(logging.INFO, logger="ember"):
        resolved = resolve_modes(CompileConfig(compile_mode="default"), "cuda", [TorchRefBackend])
    assert resolved.cudagraph_mode == M.PIECEWISE
    assert resolved.reasons == ("torch_ref supports CUDA graphs NEVER: FULL_AND_PIECEWISE -> PIECEWISE",)
    assert any("torch_ref supports CUDA graphs NEVER: FULL_AND_PIECEWISE -> PIECEWISE" in r.getMessage()
               for r in caplog.records)


def test_weakest_backend_over_groups_decides():
    groups = [backend_with(S.ALWAYS, "fast"), backend_with(S.UNIFORM_BATCH, "sliding")]
    assert min_support(groups) == (S.UNIFORM_BATCH, "sliding")
    assert resolve_modes(CompileConfig(compile_mode="default"), "cuda", groups).cudagraph_mode == M.FULL_AND_PIECEWISE


@pytest.mark.parametrize("requested", ["auto", "full", "piecewise", "full_and_piecewise"])
def test_cpu_means_no_graphs(requested):
    resolved = resolve_modes(CompileConfig(cudagraph_mode=requested), "cpu", [backend_with(S.ALWAYS)])
    assert resolved.cudagraph_mode == M.NONE and resolved.compile_mode == "none"
    assert "need a CUDA device" in resolved.reasons[0]


def test_enforce_eager_turns_off_graphs_and_compile():
    resolved = resolve_modes(CompileConfig(enforce_eager=True), "cuda", [backend_with(S.ALWAYS)])
    assert (resolved.compile_mode, resolved.cudagraph_mode) == ("none", M.NONE)
    assert resolved.reasons == ("enforce_eager: FULL_AND_PIECEWISE -> NONE, no compilation",)


@pytest.mark.parametrize("support, want", [(S.NEVER, M.NONE), (S.UNIFORM_BATCH, M.FULL_DECODE_ONLY), (S.ALWAYS, M.FULL)])
def test_no_compile_downgrades_auto(support, want):
    resolved = resolve_modes(CompileConfig(compile_mode="none"), "cuda", [backend_with(support)])
    assert resolved.cudagraph_mode == want


@pytest.mark.parametrize("requested", ["piecewise", "full_and_piecewise"])
def test_no_compile_with_explicit_piecewise_raises(requested):
    with pytest.raises(ValueError, match="needs the piecewise-compiled model, but compile_mode is 'none'"):
        resolve_modes(CompileConfig(compile_mode="none", cudagraph_mode=requested), "cuda",
                      [backend_with(S.UNIFORM_BATCH)])


def test_explicit_full_with_never_support_and_no_compile_falls_to_none():
    resolved = resolve_modes(CompileConfig(compile_mode="none", cudagraph_mode="full"), "cuda",
                             [backend_with(S.NEVER)])
    assert resolved.cudagraph_mode == M.NONE
    assert len(resolved.reasons) == 2   # FULL -> PIECEWISE (support), PIECEWISE -> NONE (no pieces)


# ---- dispatch --------------------------------------------------------------------------------------------------

SIZES = (1, 2, 4, 8, 16)
# (mode, support) -> [((num_tokens, num_reqs, uniform_decode), (runtime mode, descriptor)), ...]
DISPATCH = {
    (M.FULL_AND_PIECEWISE, S.UNIFORM_BATCH): [
        ((3, 3, True), (M.FULL, BD(4, 4, True))), ((8, 8, True), (M.FULL, BD(8, 8, True))),
        ((3, 2, False), (M.PIECEWISE, BD(4))), ((12, 8, False), (M.PIECEWISE, BD(16))),
        ((17, 2, False), (M.NONE, BD(17))), ((1, 1, True), (M.FULL, BD(1, 1, True)))],
    (M.FULL, S.ALWAYS): [
        ((3, 3, True), (M.FULL, BD(4, 4, True))), ((3, 2, False), (M.FULL, BD(4, 4, False))),
        ((12, 8, False), (M.FULL, BD(16, 8, False))), ((16, 1, False), (M.FULL, BD(16, 8, False))),
        ((17, 2, False), (M.NONE, BD(17)))],
    (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE): [
        ((3, 3, True), (M.FULL, BD(4, 4, True))), ((3, 2, False), (M.NONE, BD(3))),
        ((16, 16, False), (M.NONE, BD(16)))],
    (M.PIECEWISE, S.NEVER): [
        ((3, 3, True), (M.PIECEWISE, BD(4))), ((16, 3, False), (M.PIECEWISE, BD(16))),
        ((17, 3, False), (M.NONE, BD(17)))],
    (M.NONE, S.NEVER): [((3, 3, True), (M.NONE, BD(3, None, True))), ((5, 2, False), (M.NONE, BD(5)))],
}
DISPATCH_CASES = [(m, s, step, want) for (m, s), rows in DISPATCH.items() for step, want in rows]


@pytest.mark.parametrize("mode, support, step, want", DISPATCH_CASES,
                         ids=[f"{m.name}-{s.name}-{step}" for m, s, step, _ in DISPATCH_CASES])
def test_dispatch_table(mode, support, step, want):
    dispatcher = CudaGraphDispatcher(mode, SIZES, max_num_seqs=8, support=support)
    assert dispatcher.dispatch(*step) == want


def test_uniform_decode_beyond_decode_buckets_goes_piecewise():
    dispatcher = CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=32, support=S.UNIFORM_BATCH)
    assert dispatcher.decode_sizes == SIZES
    assert dispatcher.dispatch(20, 20, True) == (M.NONE, BD(20, None, True))
    assert dispatcher.dispatch(12, 12, True) == (M.FULL, BD(16, 16, True))


def test_capture_list_largest_first():
    dispatcher = CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=4, support=S.UNIFORM_BATCH)
    captures = dispatcher.capture_list()
    assert captures == [(M.PIECEWISE, BD(16)), (M.PIECEWISE, BD(8)), (M.FULL, BD(4, 4, True)), (M.PIECEWISE, BD(4)),
                        (M.FULL, BD(2, 2, True)), (M.PIECEWISE, BD(2)), (M.FULL, BD(1, 1, True)),
                        (M.PIECEWISE, BD(1))]
    full = CudaGraphDispatcher(M.FULL, SIZES, max_num_seqs=4, support=S.ALWAYS).capture_list()
    assert len(full) == 5 + 3 and full[0] == (M.FULL, BD(16, 4, False))
    assert CudaGraphDispatcher(M.NONE, SIZES, max_num_seqs=4).capture_list() == []


def test_every_captured_descriptor_is_reachable():
    # what the runner captures is exactly what dispatch can return with a graph
    dispatcher = CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=4, support=S.UNIFORM_BATCH)
    reached = set()
    for n in range(1, 17):
        for reqs, uniform in [(n, True), (1, False)]:
            if uniform and n > 4:
                continue
            mode, desc = dispatcher.dispatch(n, reqs, uniform)
            if mode != M.NONE:
                reached.add((mode, desc))
    assert reached == set(dispatcher.capture_list())


@pytest.mark.parametrize("mode, support", [(M.FULL, S.ALWAYS), (M.FULL_AND_PIECEWISE, S.UNIFORM_BATCH)])
def test_verify_steps_take_full_graphs_by_request_count(mode, support, monkeypatch):
    monkeypatch.setattr(dispatcher_module, "VERIFY_BUCKETS", True)
    # k = 4: R requests of at most 5 query tokens run in the FULL graph of R rows (padded to a decode size) and
    # 5 R tokens; 16 tokens a step at most, so 3 rows is the largest verify bucket
    dispatcher = CudaGraphDispatcher(mode, SIZES, max_num_seqs=8, support=support, verify_query_len=5,
                                     max_num_tokens=16)
    assert dispatcher.verify_sizes == (1, 2)
    assert dispatcher.dispatch(5, 1, False, max_query_len=5) == (M.FULL, BD(5, 1, False))
    assert dispatcher.dispatch(10, 2, False, max_query_len=5) == (M.FULL, BD(10, 2, False))
    mixed = M.FULL if mode == M.FULL else M.PIECEWISE
    # fewer proposals for some request: ALWAYS runs any batch in a graph, UNIFORM_BATCH only uniform ones
    short = (M.FULL, BD(5, 1, False)) if support == S.ALWAYS else (M.PIECEWISE, BD(4))
    assert dispatcher.dispatch(3, 1, False, max_query_len=3) == short
    assert dispatcher.dispatch(6, 2, False, max_query_len=5)[1] == (BD(10, 2, False) if support == S.ALWAYS
                                                                   else BD(8))
    # a longer query (a prefill chunk), or more requests than the largest bucket: the mixed-batch path
    assert dispatcher.dispatch(6, 1, False, max_query_len=6)[0] == mixed
    assert dispatcher.dispatch(12, 3, False, max_query_len=5)[0] == mixed
    # a uniform decode keeps its decode graph
    assert dispatcher.dispatch(2, 2, True, max_query_len=1) == (M.FULL, BD(2, 2, True))
    captured = dispatcher.capture_list()
    assert (M.FULL, BD(10, 2, False)) in captured and (M.FULL, BD(5, 1, False)) in captured
    assert len(captured) == len(set(captured))


def test_verify_buckets_need_uniform_batch_support_and_the_switch(monkeypatch):
    import ember.graphs.dispatcher as dispatcher_module
    single = CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8,
                                 support=S.UNIFORM_SINGLE_TOKEN_DECODE, verify_query_len=5, max_num_tokens=16)
    assert single.verify_sizes == ()
    assert single.dispatch(5, 1, False, max_query_len=5) == (M.PIECEWISE, BD(8))
    assert CudaGraphDispatcher(M.FULL, SIZES, max_num_seqs=8, support=S.ALWAYS).verify_sizes == ()
    monkeypatch.setattr(dispatcher_module, "VERIFY_BUCKETS", False)
    off = CudaGraphDispatcher(M.FULL, SIZES, max_num_seqs=8, support=S.ALWAYS, verify_query_len=5,
                              max_num_tokens=16)
    assert off.dispatch(5, 1, False, max_query_len=5) == (M.FULL, BD(8, 8, False))


def test_dispatcher_refuses_unresolved_modes():
    with pytest.raises(ValueError, match="FULL needs attention CUDA-graph support ALWAYS, not UNIFORM_BATCH"):
        CudaGraphDispatcher(M.FULL, SIZES, max_num_seqs=8, support=S.UNIFORM_BATCH)
    with pytest.raises(ValueError, match="support is NEVER"):
        CudaGraphDispatcher(M.FULL_DECODE_ONLY, SIZES, max_num_seqs=8, support=S.NEVER)


def test_graph_wrapper_passes_through_without_a_matching_mode():
    calls = []
    wrapper = CUDAGraphWrapper(lambda x: calls.append(x) or x * 2, M.FULL, CUDAGraphManager("cpu"), "forward")
    assert wrapper(torch.ones(2)).tolist() == [2.0, 2.0]   # no forward context at all
    from ember.attention_backends.op import ForwardContext, forward_context
    with forward_context(ForwardContext({}, (), batch_descriptor=BD(2), cudagraph_runtime_mode=M.PIECEWISE)):
        assert wrapper(torch.ones(2)).tolist() == [2.0, 2.0]
    assert len(calls) == 2 and not wrapper.entries
    with pytest.raises(ValueError, match="PIECEWISE or FULL, not NONE"):
        CUDAGraphWrapper(lambda: None, M.NONE, CUDAGraphManager("cpu"), "x")


def test_lazy_wrapper_runs_a_descriptor_once_without_a_graph_before_capturing():
    calls = []
    manager = CUDAGraphManager("cpu", lazy=True)
    wrapper = CUDAGraphWrapper(lambda x: calls.append(x) or x * 2, M.FULL, manager, "forward")
    from ember.attention_backends.op import ForwardContext, forward_context
    with forward_context(ForwardContext({}, (), batch_descriptor=BD(2, 2), cudagraph_runtime_mode=M.FULL)):
        # the first step of a bucket is its warm-up: real results, no capture (no CUDA needed)
        assert wrapper(torch.ones(2)).tolist() == [2.0, 2.0]
        assert wrapper.warmed == {BD(2, 2)} and not wrapper.entries and len(calls) == 1
        if not torch.cuda.is_available():
            # the second step captures, which needs a CUDA device
            with pytest.raises((RuntimeError, AssertionError, AttributeError)):
                wrapper(torch.ones(2))
    assert not CUDAGraphManager("cpu").lazy


def test_weak_alias_views_the_same_memory():
    from ember.graphs.cuda_graph import _weak_alias
    base = torch.arange(12.0)
    view = base[2:8].view(2, 3).t()
    alias = _weak_alias(view)
    assert alias.data_ptr() == view.data_ptr() and alias.shape == view.shape and alias.stride() == view.stride()
    base[2] = 100.0
    assert alias[0, 0].item() == 100.0 and torch.equal(alias, view)


def test_piecewise_descriptors_pad_requests_for_a_skipping_tail():
    plain = CudaGraphDispatcher(M.PIECEWISE, [8, 16, 32], max_num_seqs=12)
    padded = CudaGraphDispatcher(M.PIECEWISE, [8, 16, 32], max_num_seqs=12, pad_piecewise_reqs=True)
    assert plain.dispatch(10, 3, False) == (M.PIECEWISE, BatchDescriptor(16))
    # the tail's row count is fixed per bucket: min(bucket, max_num_seqs)
    assert padded.dispatch(10, 3, False) == (M.PIECEWISE, BatchDescriptor(16, 12))
    assert padded.dispatch(5, 2, False) == (M.PIECEWISE, BatchDescriptor(8, 8))
    assert {d for _, d in padded.capture_list()} == {BatchDescriptor(8, 8), BatchDescriptor(16, 12),
                                                     BatchDescriptor(32, 12)}
    assert padded.dispatch(40, 3, False) == (M.NONE, BatchDescriptor(40, None, False))


def test_short_context_decode_graphs():
    """A decode bucket whose builders plan other kernels for short requests has a second FULL graph, taken only
    when the step's longest request fits; buckets without a bound, unknown lengths and mixed steps never take it."""
    bounds = {1: 512, 2: 512, 4: 256}
    dispatcher = CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8, support=S.UNIFORM_BATCH,
                                     short_context_len=bounds.get)
    assert dispatcher.short_decode == {1: 512, 2: 512, 4: 256} and dispatcher.short_decode_max_reqs == 4
    assert dispatcher.dispatch(1, 1, True, 512) == (M.FULL, BD(1, 1, True, 512))
    assert dispatcher.dispatch(1, 1, True, 513) == (M.FULL, BD(1, 1, True))
    assert dispatcher.dispatch(1, 1, True) == (M.FULL, BD(1, 1, True))
    assert dispatcher.dispatch(3, 3, True, 256) == (M.FULL, BD(4, 4, True, 256))
    assert dispatcher.dispatch(3, 3, True, 300) == (M.FULL, BD(4, 4, True))
    assert dispatcher.dispatch(8, 8, True, 2) == (M.FULL, BD(8, 8, True))      # no bound for this bucket
    assert dispatcher.dispatch(3, 2, False, 2) == (M.PIECEWISE, BD(4))
    captures = dispatcher.capture_list()
    assert [d for _, d in captures if d.max_seq_len] == [BD(4, 4, True, 256), BD(2, 2, True, 512),
                                                         BD(1, 1, True, 512)]
    assert len(captures) == len(CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8,
                                                    support=S.UNIFORM_BATCH).capture_list()) + 3
    reached = {dispatcher.dispatch(n, n, True, length) for n in (1, 2, 3, 4) for length in (2, 256, 600)}
    assert reached == {md for md in captures if md[1].uniform_decode and md[1].num_tokens <= 4}
    # no graphs, no short variants
    assert CudaGraphDispatcher(M.NONE, SIZES, max_num_seqs=8, short_context_len=bounds.get).short_decode == {}


@pytest.mark.parametrize("bad", [0, -4, True, 2.5])
def test_short_context_len_must_be_a_positive_length(bad):
    with pytest.raises(ValueError, match=f"short_context_len\\(1\\) returned {bad!r}"):
        CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8, support=S.UNIFORM_BATCH,
                            short_context_len=lambda n: bad)
