"""The transformers fallback (ember.models.transformers_fallback) on tiny random models of families ember has no
file for, float32 on the CPU: logits within 1e-4 of transformers' own forward, the engine's greedy tokens equal to
transformers' generate over 32 tokens with chunked prefill, a prefix-cache hit and preemption, native families
forced through it giving the native tokens, and models it cannot run refused with the reason before any weight
loads."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from ember import LLM, SamplingParams
from ember.models.layers.attention import Attention
from ember.models.loader import build_on_meta, load_model
from ember.models.registry import resolve_model_class, supported_architectures
from ember.models.fallback_packing import PackedWeights, SliceLinear
from ember.models.transformers_fallback import TransformersForCausalLM
from tests.helpers.model_harness import ModelHarness, random_hf_model, tiny_config

LOGITS_ATOL = 1e-4
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=None, pad_token_id=0,
              tie_word_embeddings=False)
# model_type -> (architecture, config overrides, sliding windows of the two layers, attention soft cap): lineages
# ember has no file for. Windows of 8 are shorter than the longer prompts, so the window matters.
FAMILIES = {
    "phi3": ("Phi3ForCausalLM", {}, [None, None], None),
    "olmo2": ("Olmo2ForCausalLM", {}, [None, None], None),
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                                           attention_multiplier=0.3, logits_scaling=0.5), [None, None], None),
    "starcoder2": ("Starcoder2ForCausalLM", dict(sliding_window=8), [8, 8], None),
    "cohere": ("CohereForCausalLM", dict(logit_scale=2.0), [None, None], None),
    "smollm3": ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0]), [None, None], None),
    "gpt_neox": ("GPTNeoXForCausalLM", dict(rotary_pct=0.5), [None, None], None),      # embed_out -> lm_head
    "vaultgemma": ("VaultGemmaForCausalLM", dict(head_dim=16, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                                 sliding_window=8, tie_word_embeddings=True,
                                                 layer_types=["sliding_attention", "full_attention"]), [8, None], 3.0),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", dict(multi_query=True), [None, None], None),  # learned positions, MQA
    # the long tail (slow)
    "cohere2": ("Cohere2ForCausalLM", dict(sliding_window=8, logit_scale=2.0,
                                           layer_types=["sliding_attention", "full_attention"]), [8, None], None),
    "exaone4": ("Exaone4ForCausalLM", dict(sliding_window=8, sliding_window_pattern=2), [8, None], None),
    "glm4": ("Glm4ForCausalLM", {}, [None, None], None),
    "helium": ("HeliumForCausalLM", dict(head_dim=16), [None, None], None),
    "phi": ("PhiForCausalLM", {}, [None, None], None),
    "nemotron": ("NemotronForCausalLM", {}, [None, None], None),
}
# packed sibling projections where a family's own layers do not pack them already
QKV = {"q_proj__k_proj__v_proj"}
PACKED = {"phi3": set(), "gpt_neox": set(), "gpt_bigcode": set(), "starcoder2": QKV, "phi": QKV, "nemotron": QKV,
          "glm4": QKV}
SLOW = {"gpt_bigcode", "cohere2", "exaone4", "glm4", "helium", "phi", "nemotron"}
PARAMS = [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in FAMILIES]
PROMPTS = [[5, 17, 300], list(range(40, 51)), [int(t) for t in torch.arange(23) * 13 % 320]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def family_config(family: str):
    arch, overrides, _, _ = FAMILIES[family]
    return transformers.AutoConfig.for_model(family, architectures=[arch], **{**COMMON, **overrides})


@pytest.fixture(scope="module", params=PARAMS)
def family(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained folder, ember's fallback model loaded from it)."""
    name = request.param
    hf = random_hf_model(family_config(name), seed=1)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    model = load_model(path, None, torch.float32, "cpu", progress=False, model_impl="transformers")
    return name, hf, str(path), model


@torch.no_grad()
def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0].float()    # [L, V]


def hf_greedy(hf, prompt: list[int], n: int = 32) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def assert_transformers_greedy(hf, prompt: list[int], tokens: list[int]) -> None:
    """`tokens` are transformers' greedy continuation of `prompt`: each is the argmax of transformers' logits over
    the prompt and the tokens before it (one forward instead of a generate loop), by a margin ten times the
    float32 differences between the two forwards (about 1e-6 here), so that the choice does not hang on them."""
    logits = hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1]                     # [len(tokens), V]
    top = logits.topk(2, dim=-1)
    assert top.indices[:, 0].tolist() == tokens
    assert (top.values[:, 0] - top.values[:, 1]).min().item() > 1e-5, "a near tie: pick another seed"


def test_layers_carry_the_window_soft_cap_and_heads(family):
    name, hf, _, model = family
    assert isinstance(model, TransformersForCausalLM)
    _, _, windows, cap = FAMILIES[name]
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert [a.options.sliding_window for a in attns] == windows
    assert {a.options.logits_soft_cap for a in attns} == {cap}
    kv_heads = {"gpt_neox": 4, "gpt_bigcode": 1}.get(name, 2)      # no GQA / multi-query / 4 heads to 2
    assert {(a.options.num_heads, a.options.num_kv_heads) for a in attns} == {(4, kv_heads)}
    # every checkpoint tensor is in, under its own name (GPT-NeoX's embed_out renamed) or as rows of a packed
    # weight of sibling projections (q/k/v, gate/up read one input)
    for param_name, expected in hf.named_parameters():
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, SliceLinear):
            got = getattr(module._owner[0], leaf)[module.start:module.end]
        else:
            got = model.get_parameter(param_name)
        assert torch.equal(got, expected), param_name
    packed = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, PackedWeights)}
    assert packed == PACKED.get(name, {"q_proj__k_proj__v_proj", "gate_proj__up_proj"})


def test_logits_match_transformers(family):
    name, hf, _, model = family
    harness = ModelHarness(model, len(PROMPTS))
    logits = model.compute_logits(harness.step(list(enumerate(PROMPTS))))     # one ragged batch of prefills
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, PROMPTS)), 320)
    expected = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert expected.std() > 0.05, "the random model must produce informative logits"
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL
    # a decode and a prefill chunk continuing cached contexts
    harness = ModelHarness(model, 2)
    harness.step([(0, PROMPTS[1][:-1]), (1, PROMPTS[2][:9])])
    logits = model.compute_logits(harness.step([(0, PROMPTS[1][-1:]), (1, PROMPTS[2][9:])]))
    expected = torch.cat([hf_logits(hf, PROMPTS[1])[-1:], hf_logits(hf, PROMPTS[2])[9:]])
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


def test_engine_greedy_equals_generate_chunked_and_cached(family):
    """Prompts of different lengths in steps of 16 tokens (chunked prefill), two of them extending the longest,
    which they find in the prefix cache once its blocks are written; 32 greedy tokens each, equal to transformers'
    generate."""
    name, hf, path, _ = family
    llm = LLM(path, device="cpu", model_impl="transformers", block_size=8, max_num_batched_tokens=16)
    prompts = PROMPTS + [PROMPTS[2] + [7, 8], PROMPTS[2][:17] + [9]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_prefix_cache_hits >= 16
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 32 for t in got) and len({tuple(t) for t in got}) == len(got)
    for prompt, tokens in zip(prompts, got):
        assert_transformers_greedy(hf, prompt, tokens)
    if name == "phi3":      # and, for one family, transformers' generate loop itself
        assert got[:2] == [hf_greedy(hf, p) for p in prompts[:2]]


@pytest.mark.parametrize("family", ["gpt_neox"], indirect=True)
def test_preemption_and_logprobs(family):
    """A cache too small for the batch preempts and recomputes; the logprobs are transformers' own."""
    name, hf, path, _ = family
    llm = LLM(path, device="cpu", model_impl="transformers", block_size=8, num_kv_blocks=9, max_model_len=64,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)   # 85 tokens in 72 slots
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 16
        assert_transformers_greedy(hf, prompt, tokens)
        ref = torch.log_softmax(hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1], -1)    # [16, V]
        for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert abs(entry[token].logprob - ref[step, token].item()) <= 1e-4


@pytest.mark.parametrize("family", ["olmo2"], indirect=True)       # q/k/v and gate/up packed (SliceLinear)
def test_compiles_whole_and_splits_only_at_attention(family):
    """dynamo traces the transformers model whole (fullgraph: a graph break fails) with a symbolic token count and
    one `ember::attention` per layer, the only split point; the compiled forward equals the eager one at two token
    counts without tracing again."""
    from ember.graphs.piecewise import is_attention_node
    _, hf, _, model = family
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=True)
    for prompts in (PROMPTS[:2], PROMPTS[1:]):
        eager = ModelHarness(model, 2).step(list(enumerate(prompts)))
        assert torch.equal(ModelHarness(compiled, 2).step(list(enumerate(prompts))), eager)
    assert len(graphs) == 1
    assert sum(is_attention_node(n) for n in graphs[0].graph.nodes) == hf.config.num_hidden_layers


@pytest.mark.parametrize("native", ["llama", "qwen3"])
def test_native_families_through_the_fallback_give_the_native_tokens(native, tmp_path):
    hf = random_hf_model(tiny_config(native), seed=2)
    hf.save_pretrained(tmp_path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    runs = {}
    for impl in ("ember", "transformers"):
        llm = LLM(str(tmp_path), device="cpu", model_impl=impl, max_num_batched_tokens=16)
        runs[impl] = (type(llm.engine.runner.model), llm.generate(prompts, params, use_tqdm=False))
    assert runs["transformers"][0] is TransformersForCausalLM
    assert resolve_model_class(hf.config, "auto") is runs["ember"][0] is not TransformersForCausalLM
    for native_out, fallback_out in zip(runs["ember"][1], runs["transformers"][1]):
        a, b = native_out.outputs[0], fallback_out.outputs[0]
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob) for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs)) <= 1e-4


def _config_only(tmp_path, model_type: str, arch: str, **overrides) -> str:
    """A model folder with a config.json and no weights: a refusal must come before the loader looks for them."""
    cfg = transformers.AutoConfig.for_model(model_type, architectures=[arch], **{**COMMON, **overrides})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    return str(tmp_path)


@pytest.mark.parametrize("model_type, arch, overrides, reason", [
    ("stablelm", "StableLmForCausalLM", {}, r"_supports_attention_backend is False"),
    ("deepseek_v3", "DeepseekV3ForCausalLM", dict(kv_lora_rank=16, q_lora_rank=16), r"multi-head latent attention"),
    ("qwen3_next", "Qwen3NextForCausalLM", {}, r"layer_types include \['linear_attention'\]"),
    ("t5", "T5ForConditionalGeneration", {}, r"encoder-decoder"),
    ("olmoe", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2), r"converts its checkpoint tensors"),
])
def test_unsupported_models_are_refused_before_loading(model_type, arch, overrides, reason, tmp_path):
    path = _config_only(tmp_path, model_type, arch, **overrides)
    with pytest.raises(ValueError, match=rf"{arch}.*not implemented in ember .*and cannot run through the "
                                         rf"transformers fallback: .*{reason}"):
        LLM(path, device="cpu")
    with pytest.raises(ValueError, match=rf"{arch}.*cannot run through the transformers fallback: .*{reason}"):
        build_on_meta(transformers.AutoConfig.from_pretrained(path), torch.float32, "transformers")


def test_attention_the_cache_cannot_hold_is_refused_at_build():
    """Only the modeling code shows it: gpt-oss hands its attention sinks to the attention function."""
    cfg = transformers.AutoConfig.for_model("gpt_oss", architectures=["GptOssForCausalLM"], **COMMON, head_dim=16,
                                            num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"GptOssAttention \(layer 0\) hands its attention function 's_aux'"):
        build_on_meta(cfg, torch.float32, model_impl="transformers")


def test_model_impl_is_checked(tmp_path):
    path = _config_only(tmp_path, "phi3", "Phi3ForCausalLM")
    with pytest.raises(ValueError, match=r"model_impl 'hf' is not known; use one of \['auto', 'ember', "
                                         r"'transformers'\]"):
        LLM(path, device="cpu", model_impl="hf")
    with pytest.raises(ValueError, match=r"\['Phi3ForCausalLM'\] .* is not implemented in ember.*'transformers'"):
        LLM(path, device="cpu", model_impl="ember")


def test_sharded_checkpoint_loads_through_the_fallback(tmp_path):
    hf = random_hf_model(family_config("phi3"), seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path, None, torch.float32, "cpu", progress=False, model_impl="transformers")
    hidden = ModelHarness(model, 1).step([(0, PROMPTS[2])])
    assert (model.compute_logits(hidden) - hf_logits(hf, PROMPTS[2])).abs().max().item() <= LOGITS_ATOL


def test_models_command_and_model_impl_flag(capsys):
    import argparse

    from ember.args import add_engine_args, engine_kwargs
    from ember.cli import main
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    native = out.split("through transformers")[0].split()
    assert [w for w in native if w.endswith("ForCausalLM")] == supported_architectures()
    assert "LlamaForCausalLM" in native and "Phi3ForCausalLM" not in native
    assert f"through transformers {transformers.__version__} (model_impl 'transformers'" in out
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["model_impl"] == "auto"
    assert engine_kwargs(parser.parse_args(["--model-impl", "transformers"]))["model_impl"] == "transformers"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-impl", "hf"])


def _post_grad(model, prompt):
    """The model's post-grad aten graph over one prompt, its parameters graph inputs (as in a compile), with the
    harness's attention metadata; and its inputs."""
    from ember.attention_backends.op import ForwardContext, forward_context
    from tests.helpers.post_grad import post_grad_graph
    harness = ModelHarness(model, 1)
    common, positions = harness._metadata([(0, prompt)])
    ctx = ForwardContext(layers=harness.layers, attn_metadata=(harness.builder.build(common),))
    inputs = (dict(model.named_parameters()), torch.tensor(prompt), positions)
    with forward_context(ctx), torch.no_grad():
        gm = post_grad_graph(lambda params, ids, pos: torch.func.functional_call(model, params, (ids, pos)), *inputs)
    return gm, inputs, ctx


def test_the_fallback_graph_fuses_like_the_native_one(tmp_path):
    """After the fusion passes, the fallback's Llama graph holds what the native one does: q/k/v and gate/up merged
    (sibling_linears), each RMSNorm in its projection's prologue, SiLU·mul and the residual adds in epilogues, seen
    through transformers' [1, T, N] views; and it computes what the unfused graph does."""
    from ember.graphs.passes.registry import PASSES
    from tests.helpers.post_grad import count_calls
    hf = random_hf_model(tiny_config("llama"), seed=4)
    hf.save_pretrained(tmp_path)
    graphs = {}
    for impl in ("ember", "transformers"):
        model = load_model(tmp_path, None, torch.float32, "cpu", progress=False, model_impl=impl)
        gm, inputs, ctx = _post_grad(model, PROMPTS[1])
        with torch.no_grad():
            unfused = gm(*inputs)
            counts = {name: fuse(gm.graph) for name, fuse in PASSES.items()}
            gm.graph.eliminate_dead_code()
            gm.recompile()
            fused = gm(*inputs)
        assert (fused - unfused).abs().max().item() <= 1e-6 * unfused.abs().max().item()
        ops = (count_calls(gm, torch.ops.ember.linear.default), count_calls(gm, torch.ops.ember.fused_linear.default))
        graphs[impl] = counts, ops
    native, fallback = graphs["ember"], graphs["transformers"]
    assert fallback[0] == {**native[0], "sibling_linears": 4} == {"sibling_linears": 4, "rms_norm_prologue": 4,
                                                                  "silu_mul_epilogue": 2, "residual_epilogue": 4,
                                                                  "residual_all_reduce": 0, "qk_norm_rope": 0}
    assert fallback[1] == native[1] == (0, 8)       # per layer: qkv, o, gate_up, down, all fused


def test_sibling_linears_merge_adjacent_rows_of_one_weight_only():
    from ember.graphs.passes.sibling_linears import fuse_sibling_linears
    from ember.kernels.linear_op import linear
    from tests.helpers.post_grad import count_calls, post_grad_graph
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(12, generator=g)

    def adjacent(x, w, b):      # rows 0:4, 4:6, 6:9 of one weight and bias: one linear and a split
        return linear(x, w[0:4], b[0:4]) * 2, linear(x, w[4:6], b[4:6]), linear(x, w[6:9], b[6:9])

    def gap(x, w, b):           # rows 0:4 and 5:8 are not adjacent, and 8:12 reads another input
        return linear(x, w[0:4]), linear(x, w[5:8]), linear(x * 2, w[8:12])

    for fn, merges, linears in ((adjacent, 1, 1), (gap, 0, 3)):
        gm = post_grad_graph(fn, x, w, b)
        expected = gm(x, w, b)
        assert fuse_sibling_linears(gm.graph) == merges
        gm.graph.eliminate_dead_code()
        gm.recompile()
        assert count_calls(gm, torch.ops.ember.linear.default) == linears
        for got, want in zip(gm(x, w, b), expected):
            assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_a_graph_break_fails_the_compile_with_the_reason(tmp_path):
    """The compile traces one graph (fullgraph): code that breaks it is refused at the first call, naming the model
    and what to do, instead of running split in places nobody chose."""
    from ember.graphs.compile import CompiledModel

    class Breaks(torch.nn.Module):
        def forward(self, input_ids, positions):
            hidden = input_ids.float()[:, None]
            torch._dynamo.graph_break()       # what untraceable model code does
            return hidden * 2

    torch._dynamo.reset()
    compiled = CompiledModel(Breaks(), cache_root=tmp_path)
    with pytest.raises(ValueError, match=r"cannot trace Breaks as one graph \(a graph break: .*enforce_eager=True"):
        compiled(torch.arange(4), torch.arange(4))


def test_tensor_parallel_is_refused_for_the_fallback():
    from ember.distributed.shard import ShardSpec
    with pytest.raises(ValueError, match=r"does not split a model over tensor-parallel ranks \(tensor_parallel_size "
                                         r"2\); run it with tensor_parallel_size=1"):
        build_on_meta(family_config("phi3"), torch.float32, None, ShardSpec(0, 2), "transformers")
