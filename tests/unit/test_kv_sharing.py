"""KV-sharing layers (`num_kv_shared_layers` on a Llama config): the last layers read an earlier layer's cache,
own none, write none, and with the prefill skip run on the logits tokens alone. The reference is transformers'
Llama with those layers attending over their source layer's keys and values (Gemma 3n's scheme)."""

from types import SimpleNamespace

import pytest
import torch

from ember.models.layers.attention import Attention
from ember.models.llama import kv_sharing_targets, prefill_skip_start
from ember.models.loader import load_model
from tests.helpers.kv_sharing_reference import share_kv_in_hf
from tests.helpers.model_harness import ModelHarness, random_hf_model, tiny_config

PROMPTS = [[5, 17, 300], list(range(40, 51)), [int(t) for t in torch.arange(23) * 13 % 320]]
LOGITS_ATOL = 1e-4      # float32, CPU: the same bound as the other families
SKIP_ATOL = 1e-5        # skip on vs off: the same arithmetic on fewer rows


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers Llama with its last 2 of 4 layers reading layer 1's KV, ember model of the same weights)."""
    config = tiny_config("llama", num_hidden_layers=4, num_kv_shared_layers=2)
    hf = random_hf_model(config)
    path = tmp_path_factory.mktemp("llama_kv_shared")
    hf.save_pretrained(path)
    share_kv_in_hf(hf, {2: 1, 3: 1})
    return hf, load_model(path, None, torch.float32, "cpu", progress=False)


def test_targets_follow_the_layer_type():
    assert kv_sharing_targets(tiny_config("llama", num_hidden_layers=4, num_kv_shared_layers=2)) == {2: 1, 3: 1}
    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    config = SimpleNamespace(num_hidden_layers=5, num_kv_shared_layers=3, sliding_window=8, layer_types=types)
    assert kv_sharing_targets(config) == {2: 0, 3: 0, 4: 1}
    assert prefill_skip_start(config) == 2
    with pytest.raises(ValueError, match="num_kv_shared_layers 4 must be between"):
        kv_sharing_targets(SimpleNamespace(num_hidden_layers=4, num_kv_shared_layers=4))


def test_sharing_layers_name_their_source(pair):
    _, model = pair
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert [a.options.kv_sharing_target for a in attns] == [None, None, "model.layers.1.self_attn.attn",
                                                            "model.layers.1.self_attn.attn"]
    assert model.skips_prefill and model.model.skip_start == 2


@torch.no_grad()
def test_logits_match_the_reference_with_the_skip_on_and_off(pair):
    hf, model = pair
    expected = [hf(torch.tensor([p])).logits[0].float() for p in PROMPTS]        # [L, V] each
    assert torch.cat(expected).std() > 0.1
    # off: every token through every layer, logits of all of them
    full = model.compute_logits(ModelHarness(model, 3).step(list(enumerate(PROMPTS))))
    assert (full - torch.cat(expected)).abs().max().item() <= LOGITS_ATOL
    # on: the sharing tail runs on each prompt's last token only
    skipped = model.compute_logits(ModelHarness(model, 3).step(list(enumerate(PROMPTS)), skip_prefill=True))
    assert skipped.shape == (3, 320)
    last = torch.stack([e[-1] for e in expected])
    assert (skipped - last).abs().max().item() <= LOGITS_ATOL
    assert (skipped - full[torch.tensor([2, 13, 36])]).abs().max().item() <= SKIP_ATOL


@torch.no_grad()
def test_chunked_prefill_and_decode_with_the_skip(pair):
    """A prefill chunk that does not complete its prompt, then a decode beside the rest of another prompt."""
    hf, model = pair
    harness = ModelHarness(model, 2)
    harness.step([(0, PROMPTS[1][:-1]), (1, PROMPTS[2][:9])], skip_prefill=True)
    logits = model.compute_logits(harness.step([(0, PROMPTS[1][-1:]), (1, PROMPTS[2][9:])], skip_prefill=True))
    expected = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS[1:]])
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


@pytest.fixture(scope="module")
def engine_pair(tmp_path_factory):
    config = tiny_config("llama", num_hidden_layers=4, num_kv_shared_layers=2)
    hf = random_hf_model(config, seed=1)
    path = tmp_path_factory.mktemp("llama_kv_shared_engine")
    hf.save_pretrained(path)
    share_kv_in_hf(hf, {2: 1, 3: 1})
    return hf, str(path)


def _reference_tokens(hf, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, n tokens, no early stop. Without a KV cache: each step runs
    the whole sequence, so the sharing layers read their source's keys of the same forward (transformers 5.24's
    generation cache gave the patched model other tokens than 5.23's, while its cache-free logits still matched)."""
    expected = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                          use_cache=False)
        expected.append(out[0, len(p):].tolist())
    return expected


def test_engine_greedy_tokens_equal_the_reference_with_the_skip_on_and_off(engine_pair):
    from ember import LLM, SamplingParams

    hf, path = engine_pair
    prompts = PROMPTS + [list(range(60, 90))]
    expected = _reference_tokens(hf, prompts)
    # 16-token steps: the 23- and 30-token prompts arrive in chunks, beside decodes
    llm = LLM(path, device="cpu", block_size=8, max_num_batched_tokens=16)
    runner = llm.engine.runner
    assert runner.skip_prefill and runner.attn.num_cache_layers == 2
    states = runner.layer_states
    assert states["model.layers.3.self_attn.attn"].kv_cache is states["model.layers.1.self_attn.attn"].kv_cache
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    on = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == expected
    runner.skip_prefill = False
    off = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in off] == expected
    # scoring needs every token's logits, so it never skips
    runner.skip_prefill = True
    scored = llm.engine.score(prompts[1])
    ref = hf(torch.tensor([prompts[1]])).logits[0].float()
    assert scored.shape == ref.shape and (scored - ref).abs().max().item() <= LOGITS_ATOL


def test_compiled_engine_skips_the_prefill_and_reloads_it(engine_pair, tmp_path, monkeypatch):
    """Under torch.compile (Inductor's C++ backend) the tail's row count is a dynamic size of its own: greedy tokens
    equal the reference, the forward returns one row per request, and a second build loads the same graph."""
    from ember import LLM, SamplingParams

    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    hf, path = engine_pair
    prompts = PROMPTS + [list(range(60, 90))]
    expected = _reference_tokens(hf, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for build in ("traced", "loaded"):
        llm = LLM(path, device="cpu", block_size=8, max_num_batched_tokens=16, compile_mode="default")
        runner = llm.engine.runner
        stats = runner.compile_stats
        assert runner.skip_prefill
        assert (stats.artifacts_loaded > 0) == (build == "loaded")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, build
        with torch.inference_mode():
            hidden, _ = runner._dummy_forward(16, 3, skip=True)
            assert hidden.shape[0] == 3
            # traced with the tail's rows: calling it without them is refused, not silently wrong
            with pytest.raises(ValueError, match="logits_indices"):
                runner.forward_fn(torch.zeros(4, dtype=torch.int64), torch.arange(4))
        # scoring needs every token's logits: the compiled tail then runs on every row
        scored = llm.engine.score(prompts[1])
        ref = hf(torch.tensor([prompts[1]])).logits[0].float()
        assert scored.shape == ref.shape and (scored - ref).abs().max().item() <= LOGITS_ATOL
