"""Speculative decoding on a GPU, through compile and CUDA graphs: float32 greedy tokens with n-gram proposals equal
plain decoding's in each graph mode (verify steps in FULL graphs of their own by request count where the backend
runs every batch in a graph, else the mixed-batch path), with proposals accepted; seeded sampling is
reproducible; a draft model (the target drafting for itself, async and sync) gives the plain tokens too; the device
n-gram kernel proposes what the host proposer does."""

import gc

import pytest
import torch

import ember.graphs.dispatcher as dispatcher_module
from ember import LLM, SamplingParams
from ember.graphs.modes import CUDAGraphMode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def prompts():
    g = torch.Generator().manual_seed(5)
    loops = [torch.randint(0, 10000, (n,), generator=g).tolist() * r for n, r in ((5, 6), (17, 3), (3, 20))]
    return loops + [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (1, 9, 200, 40)]


def run(params=GREEDY, **kw):
    """Greedy tokens, accepted proposals, and how many steps replayed a verify bucket's FULL graph."""
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="float32", max_num_seqs=16, **kw)
    runner = llm.engine.runner
    dispatch, verify_steps = runner._dispatch, []

    def counted(step):
        mode, desc = dispatch(step)
        if mode == CUDAGraphMode.FULL and not desc.uniform_decode and desc.num_reqs is not None \
                and desc.num_tokens == desc.num_reqs * (NGRAM["num_speculative_tokens"] + 1):
            verify_steps.append(desc)
        return mode, desc

    runner._dispatch = counted
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                                                         use_tqdm=False)]
    stats = llm.engine.stats
    accepted = stats.num_accepted_tokens
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return outs, accepted, len(verify_steps)


@pytest.mark.parametrize("scheduling", ["async", "sync"])
@pytest.mark.parametrize("mode", ["none", "piecewise", "full_and_piecewise", "full_and_piecewise, no verify buckets"])
def test_greedy_tokens_equal_plain_decoding(mode, scheduling, monkeypatch):
    # async: n-gram proposals made on the device, accepted counts kept there (the default on CUDA)
    buckets = not mode.endswith("no verify buckets")
    monkeypatch.setattr(dispatcher_module, "VERIFY_BUCKETS", buckets)
    mode = mode.split(",")[0]
    kw = dict(enforce_eager=True) if mode == "none" else dict(cudagraph_mode=mode)
    plain, _, _ = run(async_scheduling=False, **kw)
    spec, accepted, verify_steps = run(speculative_config=NGRAM, async_scheduling=scheduling == "async", **kw)
    assert spec == plain
    assert accepted > 0
    # the bundled CUDA backends run every batch in a graph (ALWAYS), so FULL resolves and verify buckets serve
    assert (verify_steps > 0) == (mode == "full_and_piecewise" and buckets)


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=48, ignore_eos=True)
    first, accepted, _ = run(params, speculative_config=NGRAM)
    again, _, _ = run(params, speculative_config=NGRAM)
    assert first == again and all(len(t) == 48 for t in first)


@pytest.mark.parametrize("scheduling", ["async", "sync"])
@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_draft_model_greedy_tokens_equal_plain_decoding(mode, scheduling):
    # the target drafting for itself (its own runner, cache and graphs): nearly every proposal is accepted (a
    # near tie of the random weights may flip between the draft's decode and the verify step's 5-token query).
    # async: the draft's steps launched from the target's table on the device (the default on CUDA)
    kw = dict(enforce_eager=True) if mode == "none" else dict(cudagraph_mode=mode)
    kw.update(gpu_memory_utilization=0.6)      # the draft's cache takes what the target leaves
    plain, _, _ = run(async_scheduling=False, **kw)
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="float32", max_num_seqs=16, **kw,
              async_scheduling=scheduling == "async",
              speculative_config={"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 4})
    proposer = llm.engine.scheduler.proposer
    draft_dispatch, draft_modes = proposer.runner._dispatch, []

    def counted(step):
        mode_desc = draft_dispatch(step)
        draft_modes.append((mode_desc[0], mode_desc[1].uniform_decode))
        return mode_desc

    proposer.runner._dispatch = counted
    spec = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                                                         use_tqdm=False)]
    stats = llm.engine.stats
    assert spec == plain
    assert stats.num_draft_tokens > 0 and stats.spec_summary()["acceptance_rate"] > 0.9
    assert proposer.num_free_blocks == proposer.runner.num_blocks - 1
    if mode == "full_and_piecewise":     # the draft's decode steps replay its FULL decode graphs
        assert (CUDAGraphMode.FULL, True) in draft_modes


def test_device_ngram_kernel_equals_host_proposer():
    import numpy as np
    from ember.spec_decode.ngram import NgramProposer
    from ember.spec_decode.ngram_device import propose_ngram
    from ember.speculative_config import SpeculativeConfig
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 5, (64, 6000), generator=g, dtype=torch.int32)
    rows = torch.arange(0, 64, 2)
    counts = torch.randint(1, 6000, (32,), generator=g)
    got = propose_ngram(table.cuda(), rows.cuda(), counts.cuda(), 4, 1, 4).tolist()
    host = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    for r, c, proposal in zip(rows.tolist(), counts.tolist(), got):
        want = host.propose(table[r, :c].numpy().astype(np.int64), 4).tolist()
        assert proposal == want + [-1] * (4 - len(want))
