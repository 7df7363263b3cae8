"""The engine end to end on tiny random-weight models (float32, CPU): same greedy tokens as transformers, and the
same tokens whatever the batching (together or one by one, chunked prefill, preemption, prefix caching)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from ember import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [200],
           [17, 250, 31, 64, 99, 12, 5, 8, 201]]


def _save(cfg, path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    return str(path), _save(cfg, path)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    cfg = Qwen3Config(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return str(path), _save(cfg, path)


def hf_greedy(model, prompt, n):
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


def generate(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
def test_greedy_tokens_equal_transformers(family, request):
    path, hf = request.getfixturevalue(family)
    llm = LLM(path, device="cpu")
    got = generate(llm)
    for prompt, tokens in zip(PROMPTS, got):
        assert len(tokens) == 32
        assert tokens == hf_greedy(hf, prompt, 32)


def test_batching_does_not_change_tokens(tiny_llama):
    path, _ = tiny_llama
    together = generate(LLM(path, device="cpu"))
    llm = LLM(path, device="cpu")
    one_by_one = [generate(llm, [p])[0] for p in PROMPTS]
    assert one_by_one == together

    chunked = LLM(path, device="cpu", max_num_batched_tokens=4, enable_prefix_caching=False)
    assert generate(chunked) == together

    # 9 usable blocks of 4 tokens: the four requests need up to 13 blocks together, so some must be preempted
    small = LLM(path, device="cpu", block_size=8, num_kv_blocks=9, max_model_len=64, enable_prefix_caching=False)
    assert generate(small) == together
    assert small.engine.stats.num_preemptions > 0
    assert small.engine.kv.num_free_blocks == 9


def test_prefix_caching_hits_and_keeps_tokens(tiny_llama):
    path, _ = tiny_llama
    shared = list(range(40, 76))                         # 36 shared tokens: 2 full blocks of 16
    prompts = [shared + [1, 2, 3], shared + [9, 8], shared + [5]]
    off = LLM(path, device="cpu", enable_prefix_caching=False)
    on = LLM(path, device="cpu", enable_prefix_caching=True)
    expected = generate(off, prompts)
    got = [generate(on, [p])[0] for p in prompts]        # one by one, so later ones find the first's blocks
    assert got == expected
    assert on.engine.stats.num_prefix_cache_hits == 2 * 32
    assert off.engine.stats.num_prefix_cache_hits == 0


def test_abort_and_stop_conditions(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(path, device="cpu")
    ref = hf_greedy(hf, PROMPTS[0], 12)
    stop_tok = ref[5]
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    first = ref.index(stop_tok)
    assert out.outputs[0].token_ids == ref[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 7
    rid = llm.engine.add_request(PROMPTS[1], GREEDY)
    llm.engine.step()
    assert llm.engine.abort(rid)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks - 1 and llm.engine.num_tracked() == 0
    final = llm.engine.step()          # the abort's final output comes with the next step
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in final] == [(rid, True, "abort")]
    assert not llm.engine.has_unfinished() and not llm.engine.abort(rid)


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, device="cpu")
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = generate(llm, [PROMPTS[0]], p)[0]
    mixed = llm.generate([{"prompt_token_ids": q} for q in PROMPTS],
                         [p if i == 2 else SamplingParams(temperature=0.8, max_tokens=10) for i in range(4)],
                         use_tqdm=False)
    reordered = generate(llm, [PROMPTS[2], PROMPTS[0]], p)
    assert reordered[1] == alone
    assert generate(llm, [PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234,
                                                      ignore_eos=True))[0] == alone
    assert len(mixed) == 4 and all(len(o.outputs[0].token_ids) >= 1 for o in mixed)


def test_logprobs_are_returned(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(path, device="cpu")
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    ref = torch.log_softmax(logits.double(), -1)
    first = c.logprobs[0]
    assert len(c.logprobs) == 3 and c.token_ids[0] in first
    assert abs(first[c.token_ids[0]].logprob - ref[c.token_ids[0]].item()) < 1e-4
    assert first[c.token_ids[0]].rank == 1
    assert abs(c.cumulative_logprob - sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids))) < 1e-6


def test_chunked_prefill_with_prefix_caching(tiny_llama):
    path, _ = tiny_llama
    shared = list(range(40, 90))                         # 50 tokens: 3 full blocks of 16
    prompts = [shared + [1, 2, 3], shared + [9, 8, 7, 6]]
    expected = generate(LLM(path, device="cpu", enable_prefix_caching=False), prompts)
    llm = LLM(path, device="cpu", max_num_batched_tokens=20, enable_prefix_caching=True)
    assert [generate(llm, [p])[0] for p in prompts] == expected
    assert llm.engine.stats.num_prefix_cache_hits == 3 * 16


@pytest.mark.parametrize("fused_write,fused_rope", [(True, True), (True, "auto"), (False, True)],
                         ids=["fused_kv_write_and_rope", "fused_kv_write_auto_rope", "write_kernel"])
def test_triton_backend_through_the_engine_matches_reference(tiny_qwen3, monkeypatch, fused_write, fused_rope):
    """The whole engine through the Triton kernels (interpreted on the CPU) gives the reference backend's tokens,
    with chunked prefill and decodes mixed in one step, then decode-only steps (whose attention launch writes the
    new K/V itself unless `fused_decode_kv_write` is off, and norms and rotates q and k where `fused_decode_rope`
    is on and the write is fused; `auto` leaves a q/k norm, as Qwen3's, to its own kernel); the top-5 logprobs of
    every step agree too (a random tiny model's greedy tokens barely depend on the context)."""
    import ember.attention_backends.triton_unified.backend as tu
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    for name in ("unified_attention_2d", "unified_attention_3d"):
        def spy(*args, _launch=getattr(tu, name), **kwargs):
            launches.append((kwargs.get("new_kv") is not None, kwargs.get("rope") is not None))
            return _launch(*args, **kwargs)
        monkeypatch.setattr(tu, name, spy)
    path, _ = tiny_qwen3
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 33, 7], list(range(3, 40)), [200])]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    ref = LLM(path, device="cpu", attention_backend="torch_ref", max_num_batched_tokens=16).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(path, device="cpu", attention_backend="triton_unified", max_num_batched_tokens=16,
              attention_backend_options={"fused_decode_kv_write": fused_write, "fused_decode_rope": fused_rope})
    assert llm.engine.runner.attn.backends[0].name == "triton_unified"
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for g, r in zip(got, ref):
        for g_step, r_step in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            assert g_step.keys() == r_step.keys()
            assert max(abs(g_step[t].logprob - r_step[t].logprob) for t in r_step) <= 1e-4
    # decode-only steps took the fused forms they were allowed, mixed steps neither
    folded = fused_rope is True
    assert (True, folded) in launches if fused_write else all(launch == (False, False) for launch in launches)
    assert (True, not folded) not in launches
    assert (False, False) in launches and (False, True) not in launches


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_llama"])
def test_a_backend_that_takes_rope_gets_raw_q_and_k_and_the_default_applies_them(family, request, monkeypatch,
                                                                                  tmp_path):
    """The plug-in contract: a backend with `takes_rope` and no `forward_rope` of its own is handed q and k before
    the model's q/k norm (Qwen3) and rotary, and the default `forward_rope` applies them before `forward`: the same
    logprobs as the model's own ops, eager and compiled. The reference compiles first into the same cache: a build
    whose layers hand over q and k traces other code, so it must not load the reference's artifacts."""
    from ember.attention_backends.base import AttentionImpl
    from ember.attention_backends.torch_ref import TorchRefBackend, TorchRefImpl
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    path, _ = request.getfixturevalue(family)
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 33, 7], list(range(3, 40)))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    ref = LLM(path, device="cpu", attention_backend="torch_ref", compile_mode="default").generate(
        prompts, params, use_tqdm=False)
    seen = []

    def forward_rope(self, query, key, value, kv_cache, metadata, out, rope):
        seen.append(rope.q_norm is not None)
        return AttentionImpl.forward_rope(self, query, key, value, kv_cache, metadata, out, rope)

    monkeypatch.setattr(TorchRefBackend, "takes_rope", True)
    monkeypatch.setattr(TorchRefImpl, "forward_rope", forward_rope)
    for compile_mode in ("none", "default"):
        seen.clear()
        got = LLM(path, device="cpu", attention_backend="torch_ref", compile_mode=compile_mode).generate(
            prompts, params, use_tqdm=False)
        assert seen and set(seen) == {family == "tiny_qwen3"}
        for g, r in zip(got, ref):
            assert g.outputs[0].token_ids == r.outputs[0].token_ids
            for g_step, r_step in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
                assert max(abs(g_step[t].logprob - r_step[t].logprob) for t in r_step) <= 1e-4


def test_fused_decode_rope_takes_on_off_or_auto(tiny_qwen3, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path, _ = tiny_qwen3
    with pytest.raises(ValueError, match="fused_decode_rope 'sometimes' is not on, off or auto"):
        LLM(path, device="cpu", attention_backend="triton_unified",
            attention_backend_options={"fused_decode_rope": "sometimes"})
    llm = LLM(path, device="cpu", attention_backend="triton_unified",
              attention_backend_options={"fused_decode_rope": "On"})
    assert {b.fused_decode_rope for b in llm.engine.runner.builders} == {True}
    # builders see the query heads per KV head of their layers (a default of theirs depends on it)
    config = llm.engine.runner.hf_config
    widths = {b.ctx.num_queries_per_kv for b in llm.engine.runner.builders}
    assert widths == {config.num_attention_heads // config.num_key_value_heads}


def test_a_misspelt_attention_backend_option_is_refused():
    with pytest.raises(ValueError, match=r"\['fused_decode_kv_wirte'\] are not read by backend 'triton_unified'"):
        LLM(None, attention_backend="triton_unified", attention_backend_options={"fused_decode_kv_wirte": False})
