"""Qwen3-MoE and Mixtral against transformers (float32, CPU): logits of a ragged batch, chunked prefill beside a
decode, greedy continuations, through the engine; expert weights from per-expert and stacked checkpoints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ember.models.loader import CheckpointError, load_model, random_model
from ember.models.qwen3_moe import is_sparse_layer
from tests.helpers.model_harness import ModelHarness, greedy_generate, random_hf_model, tiny_config

FAMILIES = ["qwen3_moe", "mixtral"]
PROMPTS = [[5, 17, 300], list(range(40, 51)), [int(t) for t in torch.arange(23) * 13 % 320]]
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained folder, ember model loaded from it)."""
    family = request.param
    hf = random_hf_model(tiny_config(family))
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    return family, hf, path, load_model(path, None, torch.float32, "cpu", progress=False)


@torch.no_grad()
def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0].float()    # [L, V]


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_logits_match_transformers(pair):
    family, hf, _, model = pair
    hidden = ModelHarness(model, len(PROMPTS)).step(list(enumerate(PROMPTS)))     # one ragged batch of prefills
    logits = model.compute_logits(hidden)
    expected = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert expected.std() > 0.1, "the random model must produce informative logits"
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


def test_chunked_prefill_with_decodes_matches_transformers(pair):
    family, hf, _, model = pair
    long_prompt = PROMPTS[2]
    harness = ModelHarness(model, 2)
    harness.step([(0, PROMPTS[1][:-1]), (1, long_prompt[:9])])
    hidden = harness.step([(0, PROMPTS[1][-1:]), (1, long_prompt[9:])])
    expected = torch.cat([hf_logits(hf, PROMPTS[1])[-1:], hf_logits(hf, long_prompt)[9:]])
    assert (model.compute_logits(hidden) - expected).abs().max().item() <= LOGITS_ATOL


def test_greedy_decoding_matches_generate(pair):
    family, hf, _, model = pair
    prompts = PROMPTS[1:]     # longer than Mixtral's window of 8 once decoded
    got = greedy_generate(model, prompts, max_new_tokens=32)
    assert got == [hf_greedy(hf, p, 32) for p in prompts]
    assert got[0] != got[1]


def test_layers_follow_the_config(pair):
    family, hf, _, model = pair
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    windows = [layer.self_attn.attn.options.sliding_window for layer in model.model.layers]
    if family == "qwen3_moe":      # mlp_only_layers=[1]
        assert kinds == ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"] and windows == [None] * 3
    else:
        assert kinds == ["SparseMoeBlock"] * 2 and windows == [8, 8]
    block = model.model.layers[0].mlp
    assert (block.top_k, block.renormalize, block.experts.w13.shape) == (2, True, (8, 2 * 32 if family ==
                                                                                   "qwen3_moe" else 2 * 48, 64))
    # transformers 5 holds the experts stacked as ember does: the same tensors
    experts = hf.model.layers[0].mlp.experts
    assert torch.equal(block.experts.w13, experts.gate_up_proj) and torch.equal(block.experts.w2, experts.down_proj)
    assert torch.equal(block.gate.weight, hf.model.layers[0].mlp.gate.weight)


def test_decoder_sparse_step_and_unnormalised_weights_match_transformers(tmp_path):
    config = tiny_config("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=2,
                         norm_topk_prob=False, num_experts_per_tok=3)
    hf = random_hf_model(config, seed=1)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, None, torch.float32, "cpu", progress=False)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LlamaMLP", "SparseMoeBlock"]
    assert not model.model.layers[1].mlp.renormalize
    hidden = ModelHarness(model, 2).step(list(enumerate(PROMPTS[1:])))
    expected = torch.cat([hf_logits(hf, p) for p in PROMPTS[1:]])
    assert (model.compute_logits(hidden) - expected).abs().max().item() <= LOGITS_ATOL
    steps = SimpleNamespace(num_experts=8, decoder_sparse_step=3, mlp_only_layers=[5])
    assert [i for i in range(9) if is_sparse_layer(steps, i)] == [2, 8]


def test_stacked_checkpoint_loads_identically(pair, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I], Mixtral's
    block named mlp) as a checkpoint gives the same parameters."""
    from safetensors.torch import save_file

    family, hf, path, model = pair
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    stacked = load_model(tmp_path, None, torch.float32, "cpu", progress=False)
    ours = dict(model.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in stacked.named_parameters())


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = random_hf_model(tiny_config("mixtral"))
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.w13 \(expert 5's up projection\)"):
        load_model(tmp_path, None, torch.float32, "cpu", progress=False)


def test_forward_compiles_without_graph_breaks():
    """`ember::moe` traces as one op (Mixtral's; Qwen3's attention compiles in tests/unit/test_models.py)."""
    model = random_model(tiny_config("mixtral"), torch.float32, "cpu", seed=4)
    compiled = torch.compile(model, fullgraph=True, backend="eager", dynamic=False)
    eager = ModelHarness(model, 2).step(list(enumerate(PROMPTS[:2])))
    torch._dynamo.reset()
    assert torch.equal(ModelHarness(compiled, 2).step(list(enumerate(PROMPTS[:2]))), eager)


def test_qwen3_moe_with_a_sliding_window_is_refused():
    from ember.models.qwen3_moe import Qwen3MoeForCausalLM
    config = SimpleNamespace(**tiny_config("qwen3_moe").to_dict())
    config.use_sliding_window, config.sliding_window = True, 16
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        Qwen3MoeForCausalLM(config)


@pytest.mark.parametrize("family", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "mixtral"])
def test_engine_greedy_tokens_equal_transformers(family, tmp_path):
    """Mixed prompt lengths, 16-token steps (the longer prompts prefill in chunks beside decodes)."""
    from ember import LLM, SamplingParams

    hf = random_hf_model(tiny_config(family), seed=2)
    hf.save_pretrained(tmp_path)
    prompts = [list(range(40, 63)), [5, 17, 300], [int(t) for t in torch.arange(30) * 7 % 320]]
    llm = LLM(str(tmp_path), device="cpu", block_size=8, max_num_batched_tokens=16, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("name, experts, top_k, w13, w2", [
    ("qwen3-30b-a3b", 128, 8, (128, 1536, 2048), (128, 2048, 768)),
    ("mixtral-8x7b", 8, 2, (8, 28672, 4096), (8, 4096, 14336)),
    ("gpt-oss-20b", 32, 4, (32, 5760, 2880), (32, 2880, 2880)),
])
def test_bundled_moe_configs_build(name, experts, top_k, w13, w2):
    from ember.models.bundled import bundled_config
    from ember.models.loader import build_on_meta

    config = bundled_config(name)
    model = build_on_meta(config, torch.bfloat16)
    blocks = [layer.mlp for layer in model.model.layers]
    assert len(blocks) == config.num_hidden_layers and all(hasattr(b, "experts") for b in blocks)
    assert (blocks[0].experts.num_experts, blocks[0].top_k, getattr(blocks[0], "renormalize", True)) == \
        (experts, top_k, True)
    assert (tuple(blocks[0].experts.w13.shape), tuple(blocks[0].experts.w2.shape)) == (w13, w2)
    windows = [layer.self_attn.attn.options.sliding_window for layer in model.model.layers[:2]]
    assert windows == ([128, None] if name == "gpt-oss-20b" else [None, None])


def test_fp8_experts_are_refused():
    from ember.models.loader import build_on_meta
    from ember.quant import QuantConfig, QuantConfigError

    online = QuantConfig(source="online", weight_strategy="channel", activation="dynamic")
    with pytest.raises(QuantConfigError, match="fp8 MoE experts are not supported yet.*quantization='fp8'"):
        build_on_meta(tiny_config("qwen3_moe"), torch.bfloat16, online)
    checkpoint = QuantConfig(source="fp8", weight_strategy="block", activation="dynamic", weight_block=(128, 128),
                             ignored=("lm_head", "mlp.gate"))
    with pytest.raises(QuantConfigError, match="checkpoint's fp8 quantization_config covers them"):
        build_on_meta(tiny_config("mixtral"), torch.bfloat16, checkpoint)
    # experts left in bf16 by the checkpoint: the attention layers run fp8, the experts as they are
    bf16_experts = QuantConfig(source="fp8", weight_strategy="channel", activation="dynamic",
                               ignored=("lm_head", "re:.*mlp\\.(gate$|experts\\.)"))
    model = build_on_meta(tiny_config("qwen3_moe"), torch.bfloat16, bf16_experts)
    assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "ScaledLinear"
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16


def test_the_residual_add_after_the_moe_op_folds_into_it():
    """residual_epilogue rewrites `ember::moe(...) + residual` into the op with the residual, where the add is the
    op's only user; the graph computes the same."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.graphs.passes.residual_epilogue import fuse_residual_epilogue
    from ember.kernels.moe_op import moe

    g = torch.Generator().manual_seed(0)
    x, logits, residual = torch.randn(3, 16, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, 16)
    w13, w2 = torch.randn(4, 24, 16, generator=g) * 0.2, torch.randn(4, 16, 12, generator=g) * 0.2

    def layer(x, logits, residual, w13, w2):
        return moe(x, logits, w13, w2, 2, True) + residual

    def used_twice(x, logits, residual, w13, w2):
        out = moe(x, logits, w13, w2, 2, True)
        return out + residual, out * 2

    args = (x, logits, residual, w13, w2)
    gm = make_fx(layer, tracing_mode="fake")(*args)
    assert fuse_residual_epilogue(gm.graph) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in calls] == ["ember.moe.default"] and calls[0].args[6].name == "residual_1"
    gm.recompile()
    assert torch.equal(gm(*args), layer(*args))
    twice = make_fx(used_twice, tracing_mode="fake")(*args)
    assert fuse_residual_epilogue(twice.graph) == 0


@pytest.mark.slow   # ~20 s of CPU: a plain trace of every piece
def test_qwen3_moe_pieces_are_plain():
    """With the residual folded into `ember::moe`, a Qwen3-MoE's pieces hold only ember ops and views (no Inductor),
    and they compute what the eager model does."""
    import tempfile
    from pathlib import Path

    from ember.attention_backends.op import forward_context
    from tests.helpers.model_harness import tiny_model_step
    from tests.unit.test_plain_pieces import _manifest, _run

    with tempfile.TemporaryDirectory() as root:
        plain, out = _run("qwen3_moe", Path(root), True)
        assert _manifest(plain)["plain"] == [True] * plain.stats.num_distinct
        assert plain.fusion.counts["residual_epilogue"] == 6     # o_proj in 3 layers, down in 1, the MoE op in 2
    model, ids, positions, context = tiny_model_step("qwen3_moe", torch.bfloat16, seed=0)
    with torch.inference_mode(), forward_context(context):
        assert torch.equal(out, model(ids, positions))


def test_the_residual_add_folds_into_a_call_with_expert_biases():
    """The same fold for a call with the bias and SwiGLU-limit arguments (gpt-oss): the residual takes its slot and
    the arguments after it stay; the graph computes the same."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.graphs.passes.residual_epilogue import fuse_residual_epilogue
    from ember.kernels.moe_op import moe

    g = torch.Generator().manual_seed(1)
    x, logits, residual = torch.randn(3, 16, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, 16)
    w13, w2 = torch.randn(4, 24, 16, generator=g) * 0.2, torch.randn(4, 16, 12, generator=g) * 0.2
    b13, b2 = torch.randn(4, 24, generator=g) * 0.2, torch.randn(4, 16, generator=g) * 0.2

    def layer(x, logits, residual, w13, w2, b13, b2):
        return moe(x, logits, w13, w2, 2, True, None, None, b13, b2, 1.5) + residual

    args = (x, logits, residual, w13, w2, b13, b2)
    gm = make_fx(layer, tracing_mode="fake")(*args)
    assert fuse_residual_epilogue(gm.graph) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in calls] == ["ember.moe.default"]
    assert calls[0].args[6].name == "residual_1" and calls[0].args[10] == 1.5
    gm.recompile()
    assert torch.equal(gm(*args), layer(*args))
