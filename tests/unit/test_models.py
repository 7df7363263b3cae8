"""Every model family against transformers: same logits for a ragged batch, same greedy continuations."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ember.models.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from ember.models.loader import load_model, random_model
from ember.models.registry import get_model_class, supported_architectures
from tests.helpers.model_harness import ModelHarness, greedy_generate, random_hf_model, tiny_config

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]
PROMPTS = [[5, 17, 300], list(range(40, 51)), [int(t) for t in torch.arange(23) * 13 % 320]]
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, transformers model, ember model loaded from its save_pretrained folder)."""
    family = request.param
    hf = random_hf_model(tiny_config(family))
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    return family, hf, load_model(path, None, torch.float32, "cpu", progress=False)


@torch.no_grad()
def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0].float()    # [L, V]


def test_logits_match_transformers(pair):
    family, hf, model = pair
    harness = ModelHarness(model, len(PROMPTS))
    hidden = harness.step(list(enumerate(PROMPTS)))           # one ragged batch of prefills
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, PROMPTS)), 320)
    expected = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert expected.std() > 0.1, "the random model must produce informative logits"
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


def test_chunked_prefill_with_decodes_matches_transformers(pair):
    """A decode and two prefill chunks in one step, continuing cached contexts, attend over the right tokens."""
    family, hf, model = pair
    long_prompt = PROMPTS[2]
    harness = ModelHarness(model, 2)
    harness.step([(0, PROMPTS[1][:-1]), (1, long_prompt[:9])])
    hidden = harness.step([(0, PROMPTS[1][-1:]), (1, long_prompt[9:])])
    logits = model.compute_logits(hidden)
    expected = torch.cat([hf_logits(hf, PROMPTS[1])[-1:], hf_logits(hf, long_prompt)[9:]])
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


def test_greedy_decoding_matches_generate(pair):
    family, hf, model = pair
    prompts = PROMPTS[1:]     # both longer than the window of 8 (Mistral, Gemma 2 and 3) once decoded
    got = greedy_generate(model, prompts, max_new_tokens=32)
    for prompt, tokens in zip(prompts, got):
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()
    assert got[0] != got[1]


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = random_hf_model(tiny_config("llama"), seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model = load_model(tmp_path, None, torch.float32, "cpu", progress=False)
    hidden = ModelHarness(model, 1).step([(0, PROMPTS[2])])
    assert (model.compute_logits(hidden) - hf_logits(hf, PROMPTS[2])).abs().max().item() <= LOGITS_ATOL


def test_packed_parameters_hold_the_checkpoint_shards(pair):
    family, hf, model = pair
    attn, ref = model.model.layers[1].self_attn, hf.model.layers[1].self_attn
    expected = torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight])
    assert torch.equal(attn.qkv_proj.weight, expected)
    mlp, ref_mlp = model.model.layers[0].mlp, hf.model.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight]))
    names = {n for n, _ in model.named_parameters()}
    assert ("lm_head.weight" in names) == (not hf.config.tie_word_embeddings)


def test_attention_layers_are_named_and_configured(pair):
    family, hf, model = pair
    from ember.models.layers.attention import Attention
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert [a.layer_name for a in attns] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    cfg = hf.config
    o = attns[0].options
    assert (o.num_heads, o.num_kv_heads) == (cfg.num_attention_heads, cfg.num_key_value_heads)
    # Gemma 2 and 3 interleave a local layer and a global one; Mistral's window covers every layer
    windows = {"mistral": [8, 8], "gemma2": [8, None], "gemma3": [8, None]}.get(family, [None, None])
    assert [a.options.sliding_window for a in attns] == windows
    assert math.isclose(o.scale, getattr(cfg, "query_pre_attn_scalar", o.head_size) ** -0.5)
    assert o.logits_soft_cap == (3.0 if family == "gemma2" else None)


def test_forward_compiles_without_graph_breaks(pair):
    family, hf, model = pair
    compiled = torch.compile(model, fullgraph=True, backend="eager", dynamic=False)
    prompts = PROMPTS[:2]
    eager = ModelHarness(model, 2).step(list(enumerate(prompts)))
    harness = ModelHarness(compiled, 2)
    torch._dynamo.reset()
    hidden = harness.step(list(enumerate(prompts)))
    assert torch.equal(hidden, eager)
    logits = torch.compile(model.compute_logits, fullgraph=True, backend="eager")(hidden)
    assert torch.equal(logits, model.compute_logits(eager))


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "mscale": 1.0,
     "mscale_all_dim": 0.5},
], ids=["default", "linear", "llama3", "yarn", "yarn_mscale"])
def test_rotary_tables_match_transformers(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_theta": 50000.0, **(rope or {"rope_type": "default"})}
    config = tiny_config("llama", head_dim=32, rope_scaling=dict(params))
    positions = torch.tensor([0, 1, 7, 31, 63, 200, 255])
    rotary = RotaryEmbedding(rope_parameters_from_config(config, 32))
    rotary.init_buffers(torch.device("cpu"))
    cos, sin = rotary(positions)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos, ref_cos[0, :, :16], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, ref_sin[0, :, :16], atol=1e-5, rtol=0)
    # the transformers 4.x layout (rope_theta on the config, scaling in rope_scaling) gives the same table
    legacy = SimpleNamespace(rope_theta=50000.0, rope_scaling=rope, max_position_embeddings=256)
    legacy_rotary = RotaryEmbedding(rope_parameters_from_config(legacy, 32))
    legacy_rotary.init_buffers(torch.device("cpu"))
    assert torch.equal(legacy_rotary.cos_sin_cache[:256], rotary.cos_sin_cache[:256])


def test_unsupported_rope_type_is_named():
    config = SimpleNamespace(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, rope_theta=1e4,
                             max_position_embeddings=64)
    with pytest.raises(ValueError, match="'dynamic'"):
        rope_parameters_from_config(config, 16)


def test_random_model_is_seeded_and_usable():
    config = tiny_config("qwen3")
    a = random_model(config, torch.float32, "cpu", seed=1)
    b = random_model(config, torch.float32, "cpu", seed=1)
    c = random_model(config, torch.float32, "cpu", seed=2)
    wa, wb, wc = (m.model.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.015 < wa.std().item() < 0.025
    assert torch.equal(a.model.norm.weight, torch.ones(64))
    hidden = ModelHarness(a, 1).step([(0, PROMPTS[1])])
    assert torch.isfinite(a.compute_logits(hidden)).all()


def test_random_model_weights_do_not_depend_on_the_thread_count():
    config = tiny_config("llama")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = random_model(config, torch.float32, "cpu", seed=3)
        torch.set_num_threads(2)
        parallel = random_model(config, torch.float32, "cpu", seed=3)
    finally:
        torch.set_num_threads(threads)
    pairs = list(zip(serial.state_dict().items(), parallel.state_dict().items()))
    assert len(pairs) > 10
    for (name, a), (other, b) in pairs:
        assert name == other and torch.equal(a, b), name
    weights = [p for p in serial.parameters() if p.dim() == 2]
    assert not torch.equal(weights[0][:4, :4], weights[1][:4, :4])   # each parameter draws a stream of its own


def test_random_model_from_bundled_config():
    from ember.models.bundled import bundled_config

    config = bundled_config("llama-3.2-1b")
    config.num_hidden_layers, config.vocab_size = 1, 512   # keep the CPU test small
    model = random_model(config, torch.bfloat16, "cpu", seed=0)
    rope = model.model.rotary_emb
    assert rope.params.rope_type == "llama3" and rope.params.theta == 500000.0
    assert rope.cos_sin_cache.shape == (131072, 64)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in model.parameters())
    assert model.lm_head.tied


def test_random_gemma3_from_bundled_config():
    """The public Gemma-3-1B config (transformers 4.x rope keys): five local layers of window 512 to one global,
    a 10k rope base on local layers and 1M on global ones."""
    from ember.models.bundled import bundled_config

    config = bundled_config("gemma-3-1b", num_hidden_layers=6, vocab_size=512)
    model = random_model(config, torch.bfloat16, "cpu", seed=0)
    windows = [layer.self_attn.attn.options.sliding_window for layer in model.model.layers]
    assert windows == [512] * 5 + [None]
    assert model.model.layers[0].self_attn.attn.options.scale == 256 ** -0.5
    thetas = {key: rotary.params.theta for key, rotary in model.model.rotary_embs.items()}
    assert thetas == {"sliding_attention": 10000.0, "full_attention": 1000000.0}
    assert model.model.rope_keys == ["sliding_attention"] * 5 + ["full_attention"]
    hidden = ModelHarness(model, 1, dtype=torch.bfloat16).step([(0, PROMPTS[1])])
    assert torch.isfinite(model.compute_logits(hidden)).all()


def test_registry_maps_architectures():
    assert get_model_class(tiny_config("mistral")).__name__ == "MistralForCausalLM"
    assert set(supported_architectures()) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                              "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                                              "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                                              "GptOssForCausalLM"}
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM"):
        get_model_class(SimpleNamespace(architectures=["FalconForCausalLM"]))
