"""CUDA graphs around the piecewise-compiled toy decoder: FULL and PIECEWISE capture at several buckets, replays
bitwise equal to the same compiled code run without graphs at the padded size, live batches smaller than a bucket,
and graph counts."""

import pytest
import torch

from ember.attention_backends.base import CudaGraphSupport
from ember.attention_backends.op import forward_context
from ember.graphs.compile import compile_cache_key, compile_model
from ember.graphs.cuda_graph import CUDAGraphManager, CUDAGraphWrapper
from ember.graphs.dispatcher import CudaGraphDispatcher
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode
from tests.helpers.toy_decoder import ToyDecoder, toy_forward_context

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

M = CUDAGraphMode
BD = BatchDescriptor
NUM_LAYERS = 2
SIZES = (1, 2, 4, 8, 16)
MAX_TOKENS = 32
TOY = {"model": "ToyDecoder", "num_layers": NUM_LAYERS, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "device": "cuda"}


class Harness:
    """The toy model with persistent input buffers, run the way the model runner runs a step."""

    def __init__(self, model: ToyDecoder):
        self.model = model
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device="cuda")   # [max_tokens]
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.long, device="cuda")   # [max_tokens]

    def fill(self, num_live: int, seed: int) -> None:
        """Live tokens first, zero padding after (what the runner writes for padding rows)."""
        gen = torch.Generator().manual_seed(seed)
        self.input_ids.zero_()
        self.positions.zero_()
        self.input_ids[:num_live] = torch.randint(0, 64, (num_live,), generator=gen)
        self.positions[:num_live] = torch.randint(0, 4096, (num_live,), generator=gen)

    def run(self, forward, num_tokens: int, mode: CUDAGraphMode, desc: BatchDescriptor | None) -> torch.Tensor:
        with forward_context(toy_forward_context(self.model, desc, mode)):
            out = forward(self.input_ids[:num_tokens], self.positions[:num_tokens])
        return out.clone()

    def eager(self, num_live: int) -> torch.Tensor:
        """The uncompiled model on the live tokens only."""
        with forward_context(toy_forward_context(self.model)):
            return self.model(self.input_ids[:num_live], self.positions[:num_live])


def make_toy() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(num_layers=NUM_LAYERS).cuda().eval()


@pytest.fixture(scope="module")
def full_setup():
    """FULL graphs (attention support ALWAYS) of the compiled toy at every bucket, for mixed batches."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_toy()
    compiled = compile_model(model, "default", cache_key=compile_cache_key(TOY, torch.float32))
    calls = []

    def counted(input_ids, positions):
        calls.append(input_ids.shape[0])
        return compiled(input_ids, positions)

    manager = CUDAGraphManager("cuda", debug_check_addresses=True)
    forward = manager.wrap_full(counted)
    harness = Harness(model)
    dispatcher = CudaGraphDispatcher(M.FULL, SIZES, max_num_seqs=MAX_TOKENS, support=CudaGraphSupport.ALWAYS)
    captures = [(m, d) for m, d in dispatcher.capture_list() if not d.uniform_decode]
    with torch.inference_mode():
        harness.fill(MAX_TOKENS, seed=0)
        harness.run(forward, MAX_TOKENS, M.NONE, None)      # compiles, at more than 1 token
        report = manager.capture_all(lambda mode, desc: harness.run(forward, desc.num_tokens, mode, desc), captures)
    return model, compiled, forward, manager, harness, calls, report


def test_full_graph_counts(full_setup):
    model, compiled, forward, manager, harness, calls, report = full_setup
    assert manager.graphs_captured[M.FULL] == len(SIZES)
    assert manager.num_descriptors(M.FULL) == len(SIZES)
    assert manager.graphs_captured[M.PIECEWISE] == 0
    assert report.graphs == {"FULL": len(SIZES)} and report.num_descriptors == len(SIZES)
    assert sorted(d.num_tokens for d in forward.entries) == list(SIZES)
    assert compiled.stats.num_graphs == 1 and compiled.stats.num_pieces == NUM_LAYERS + 1


@pytest.mark.parametrize("bucket", SIZES)
def test_full_replay_is_bitwise_equal_to_the_compiled_run(full_setup, bucket):
    model, compiled, forward, manager, harness, calls, report = full_setup
    desc = BD(bucket, bucket, False)
    with torch.inference_mode():
        harness.fill(bucket, seed=bucket)
        want = harness.run(compiled, bucket, M.NONE, None)
        num_calls = len(calls)
        got = harness.run(forward, bucket, M.FULL, desc)
    assert len(calls) == num_calls, "a captured descriptor must replay, not call the forward"
    assert torch.equal(got, want)


@pytest.mark.parametrize("live, bucket", [(3, 4), (5, 8), (9, 16), (1, 16)])
def test_full_replay_with_a_smaller_live_batch(full_setup, live, bucket):
    model, compiled, forward, manager, harness, calls, report = full_setup
    with torch.inference_mode():
        harness.fill(live, seed=100 + live)
        want_padded = harness.run(compiled, bucket, M.NONE, None)
        got = harness.run(forward, bucket, M.FULL, BD(bucket, bucket, False))
        eager = harness.eager(live)
    assert torch.equal(got, want_padded)
    # padding sits after the live tokens, so causal attention keeps the live rows as an unpadded run computes them
    torch.testing.assert_close(got[:live], eager, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def mixed_setup():
    """FULL_AND_PIECEWISE as the dispatcher plans it: FULL graphs for uniform decode up to 4 requests, PIECEWISE
    graphs of every compiled piece at every bucket."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_toy()
    manager = CUDAGraphManager("cuda", debug_check_addresses=True)
    compiled = compile_model(model, "default", cache_key=compile_cache_key(TOY, torch.float32), graph_manager=manager)
    forward = manager.wrap_full(compiled)
    harness = Harness(model)
    dispatcher = CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=4,
                                     support=CudaGraphSupport.UNIFORM_BATCH)
    with torch.inference_mode():
        harness.fill(MAX_TOKENS, seed=0)
        harness.run(forward, MAX_TOKENS, M.NONE, None)
        report = manager.capture_all(lambda mode, desc: harness.run(forward, desc.num_tokens, mode, desc),
                                     dispatcher.capture_list(), num_warmups=2)
    return model, compiled, forward, manager, harness, dispatcher, report


def piece_wrappers(compiled) -> list[CUDAGraphWrapper]:
    return [v for v in vars(compiled.split_module).values() if isinstance(v, CUDAGraphWrapper)]


def test_mixed_graph_counts(mixed_setup):
    model, compiled, forward, manager, harness, dispatcher, report = mixed_setup
    num_pieces = NUM_LAYERS + 1
    assert manager.graphs_captured[M.FULL] == 3                      # uniform decode at 1, 2, 4
    assert manager.graphs_captured[M.PIECEWISE] == num_pieces * len(SIZES)
    assert manager.num_descriptors(M.PIECEWISE) == len(SIZES)
    assert report.graphs == {"FULL": 3, "PIECEWISE": num_pieces * len(SIZES)}
    pieces = piece_wrappers(compiled)
    assert len(pieces) == num_pieces
    assert all(sorted(d.num_tokens for d in w.entries) == list(SIZES) for w in pieces)


# (num_tokens, num_reqs, uniform_decode) -> expected runtime mode
STEPS = [((1, 1, True), M.FULL), ((3, 3, True), M.FULL), ((4, 4, True), M.FULL), ((3, 2, False), M.PIECEWISE),
         ((6, 2, False), M.PIECEWISE), ((13, 4, False), M.PIECEWISE), ((16, 1, False), M.PIECEWISE),
         ((20, 2, False), M.NONE)]


@pytest.mark.parametrize("step, want_mode", STEPS, ids=[str(s) for s, _ in STEPS])
def test_dispatched_replay_is_bitwise_equal_to_the_compiled_run(mixed_setup, step, want_mode):
    model, compiled, forward, manager, harness, dispatcher, report = mixed_setup
    mode, desc = dispatcher.dispatch(*step)
    assert mode == want_mode
    live = step[0]
    pieces = piece_wrappers(compiled)
    with torch.inference_mode():
        harness.fill(live, seed=live)
        want = harness.run(compiled, desc.num_tokens, M.NONE, None)
        full_replays, piece_replays = forward.num_replays, sum(w.num_replays for w in pieces)
        got = harness.run(forward, desc.num_tokens, mode, desc)
        eager = harness.eager(live)
    assert torch.equal(got, want)
    torch.testing.assert_close(got[:live], eager, rtol=1e-4, atol=1e-4)
    assert forward.num_replays - full_replays == (1 if mode == M.FULL else 0)
    assert sum(w.num_replays for w in pieces) - piece_replays == (len(pieces) if mode == M.PIECEWISE else 0)
    # nothing new was captured by a step
    assert manager.graphs_captured[M.FULL] == 3 and manager.graphs_captured[M.PIECEWISE] == len(pieces) * len(SIZES)


def test_capture_warms_up_once_per_kind_of_step():
    """One NONE warm-up run before the first capture of each (mode, uniform decode) kind, none before the rest;
    `warmup_each` runs one before every capture."""
    model = make_toy()
    for warmup_each in (False, True):
        manager = CUDAGraphManager("cuda")
        compiled = compile_model(model, "default", cache_key=compile_cache_key(TOY, torch.float32),
                                 graph_manager=manager)
        forward = manager.wrap_full(compiled)
        harness = Harness(model)
        dispatcher = CudaGraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=4,
                                         support=CudaGraphSupport.UNIFORM_BATCH)
        captures = dispatcher.capture_list()
        runs = []

        def run_step(mode, desc):
            runs.append((mode, desc))
            return harness.run(forward, desc.num_tokens, mode, desc)
        with torch.inference_mode():
            harness.fill(MAX_TOKENS, seed=0)
            harness.run(forward, MAX_TOKENS, M.NONE, None)
            manager.capture_all(run_step, captures, warmup_each=warmup_each)
        warmups = [d for m, d in runs if m == M.NONE]
        kinds = {(m, d.uniform_decode) for m, d in captures}
        assert len(warmups) == (len(captures) if warmup_each else len(kinds)), (len(warmups), kinds)
        assert len(runs) - len(warmups) == len(captures)
