"""Structured output on CUDA: the bitmask kernels against the torch reference at a real vocabulary size, and the
engine with FULL decode graphs and async scheduling against eager, greedy tokens equal, with a constrained decode
step split (the forward's graph, then the tail's graph once the bitmask is put) or run whole (the bitmask put before
the one replay)."""

import gc
import re

import pytest
import torch

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.runner.sampler import Sampler, SamplingMetadata
from tests.helpers.tiny_tokenizer import save_bpe_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("llguidance")

V = 151936


def _random_bitmask(num_rows: int, g: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    words = -(-V // 32)
    allowed = [torch.randperm(V, generator=g)[:int(n)] for n in torch.randint(1, 3000, (num_rows,), generator=g)]
    bits = torch.zeros(num_rows, words * 32, dtype=torch.int64)
    for j, ids in enumerate(allowed):
        bits[j, ids] = 1
    packed = (bits.view(num_rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32), allowed


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bitmask_kernels_match_the_torch_path_and_sample_only_allowed_tokens(temperature):
    g = torch.Generator().manual_seed(0)
    n = 64
    bitmask, allowed = _random_bitmask(n, g)
    mask_index = torch.arange(1, n + 1)
    mask_index[::7] = 0                                   # rows without a grammar
    logits = (torch.randn(n, V, generator=g) * 4).cuda()
    params = [SamplingParams(temperature=temperature)] * n
    meta = SamplingMetadata.build(params, list(range(n)), [[]] * n, [[0]] * n, [()] * n, V, "cuda",
                                  bitmask=bitmask.cuda(), mask_index=mask_index.tolist())
    fused = Sampler(use_triton=True)(logits, meta).sampled_token_ids.cpu()
    reference = Sampler(use_triton=False)(logits, meta).sampled_token_ids.cpu()
    assert torch.equal(fused, reference)
    for i in range(n):
        if mask_index[i] > 0:
            assert int(fused[i]) in set(allowed[int(mask_index[i]) - 1].tolist())
    from ember.kernels.sampling import apply_token_bitmask_triton
    from ember.runner.sampler.sampler import apply_token_bitmask
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask_triton(a, meta.bitmask, meta.mask_index)
    apply_token_bitmask(b, meta.bitmask, meta.mask_index)
    assert torch.equal(a, b)


REGEX = r"[a-z]{2,6}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
          "required": ["k", "n"]}


def _requests():
    kinds = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
             StructuredOutputsParams(json=SCHEMA), None]
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(24):
        prompt = torch.randint(3, 400, (int(torch.randint(4, 300, (1,), generator=g)),), generator=g).tolist()
        out.append((prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                           structured_outputs=kinds[i % 4])))
    return out


def _tokens(llm, requests):
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_full_graphs_with_the_bitmask_give_the_eager_tokens(tmp_path):
    save_bpe_tokenizer(tmp_path, 512)
    common = dict(load_format="dummy", tokenizer=str(tmp_path), dtype="float32", max_model_len=1024,
                  max_num_seqs=32, max_num_batched_tokens=1024, gpu_memory_utilization=0.3)
    requests = _requests()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        eager = LLM("qwen3-0.6b", enforce_eager=True, **common)
        expected = _tokens(eager, requests)
        del eager
        gc.collect()
        graphs = LLM("qwen3-0.6b", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32], **common)
        assert graphs.engine.config.scheduler.async_scheduling
        runner = graphs.engine.runner
        full_replays = runner.forward_fn.num_replays
        assert all(len(t) == 32 for t in _tokens(graphs, [(p, s) for p, s in requests if s.structured_outputs is None]))
        assert runner.forward_fn.num_replays > full_replays         # no grammar rows: the one graph, nothing split
        assert not runner.split.forward.entries and not runner.split.run_tail.entries
        assert _tokens(graphs, requests) == expected
        structured = graphs.engine.structured
        stats = structured.stats
        assert stats.num_split > 0 and stats.num_before_forward == 0       # split decode steps replayed two graphs
        assert runner.split.forward.num_replays > 0 and runner.split.run_tail.num_replays > 0
        assert len(runner.split.forward.entries) == len(runner.split.run_tail.entries) > 0
        structured.split = False                        # the bitmask before the one replay, which samples with it
        split = stats.num_split
        assert _tokens(graphs, requests) == expected
        assert stats.num_before_forward > 0 and stats.num_split == split
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    tokenizer = graphs.get_tokenizer()
    for (_, params), tokens in zip(requests, expected):
        if params.structured_outputs is not None and params.structured_outputs.kind == "regex":
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            assert re.fullmatch(REGEX, text), text
