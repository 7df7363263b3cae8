"""The MoE kernels on the GPU in bfloat16 against the torch reference, on the layer shapes of Qwen3-30B-A3B and
Mixtral-8x7B, and gpt-oss-20b's with expert biases and the clamped SwiGLU; the op inside a CUDA graph and under
torch.compile; and Qwen3-MoE / Mixtral / gpt-oss (random weights of the bundled configs, trimmed) through the
engine against transformers.

Kernel tolerance, relative to the output scale s = max |float32 reference|: 2**-6 s. The kernels and the bf16
reference round the same intermediates (each projection, SiLU, the product, the weighted output) but sum in other
orders, so an intermediate may land one bf16 ulp (2**-8 relative) apart, and the sum of top_k such values a few."""

import gc
import json

import pytest
import torch

from ember.kernels import moe_op
from ember.kernels.moe_align import align_reference, moe_align
from ember.kernels.moe_configs import MoeShape, fallback_launch
from ember.kernels.moe_gemm import moe_reference
from ember.kernels.moe_router import route, route_reference
from tests.helpers.bf16_check import check_teacher_forced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}   # E, H, I, top_k
TOKENS = [1, 3, 8, 64, 512]


@pytest.fixture(scope="module", params=list(LAYERS))
def layer(request):
    num_experts, hidden, intermediate, top_k = LAYERS[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device="cuda", generator=g) / hidden ** 0.5
           ).to(torch.bfloat16)                                                                # [E, 2I, H]
    w2 = (torch.randn(num_experts, hidden, intermediate, device="cuda", generator=g) / intermediate ** 0.5
          ).to(torch.bfloat16)                                                                 # [E, H, I]
    router = (torch.randn(num_experts, hidden, device="cuda", generator=g) / hidden ** 0.5).to(torch.bfloat16)
    yield request.param, w13, w2, router, top_k
    del w13, w2
    torch.cuda.empty_cache()


def _inputs(num_tokens, hidden, router, seed=1, logits_dtype=torch.bfloat16):
    """x [T, H] bf16 and its router logits [T, E]; float32 logits have no ties (bf16 ones do: among 128 logits
    several often round to one value, and which of them top-k takes first is arbitrary)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)             # [T, H]
    return x, (x.float() @ router.float().t()).to(logits_dtype)


def _close(out, ref32):
    scale = ref32.abs().max().item()
    err = (out.float() - ref32).abs().max().item()
    assert err <= 2 ** -6 * scale, (err, scale)


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_kernels_match_the_reference_in_bf16(layer, num_tokens):
    name, w13, w2, router, top_k = layer
    num_experts, hidden = w13.shape[0], w13.shape[2]
    x, logits = _inputs(num_tokens, hidden, router, logits_dtype=torch.float32)
    weights, ids = route(logits, top_k, renormalize=True)
    ref_weights, ref_ids = route_reference(logits, top_k, True)
    assert torch.equal(ids, ref_ids) and (weights - ref_weights).abs().max().item() <= 1e-6
    # the float32 expert loop over the bf16 weights, and the bf16 loop with the kernels' roundings
    ref32 = moe_reference(x.float(), weights, ids, w13.float(), w2.float())
    _close(moe_reference(x, weights, ids, w13, w2), ref32)
    chosen = moe_op.launch_for(x, w13, top_k)
    _close(moe_op.fused_experts(x, weights, ids, w13, w2), ref32)
    # the other path gives the same within the tolerance (the table picks by speed only)
    shape = MoeShape(num_tokens, num_experts, hidden, w13.shape[1] // 2, top_k, 2, 132)
    other = fallback_launch(shape, gemv_max_tokens=0 if chosen.path == "gemv" else num_tokens)
    assert other.path != chosen.path
    _close(moe_op.fused_experts(x, weights, ids, w13, w2, other), ref32)


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_experts_with_biases_and_the_clamped_swiglu_match_the_reference(num_tokens):
    """gpt-oss-20b's layer shape (32 experts of 2880 x 2880, top 4) with expert biases and swiglu_limit 7, on both
    paths, against the float32 loop over the same bf16 weights."""
    num_experts, hidden, intermediate, top_k = 32, 2880, 2880, 4
    g = torch.Generator(device="cuda").manual_seed(5)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device="cuda", generator=g) / hidden ** 0.5
           ).to(torch.bfloat16)                                                                # [E, 2I, H]
    w2 = (torch.randn(num_experts, hidden, intermediate, device="cuda", generator=g) / intermediate ** 0.5
          ).to(torch.bfloat16)                                                                 # [E, H, I]
    b13 = torch.randn(num_experts, 2 * intermediate, device="cuda", generator=g).to(torch.bfloat16)    # [E, 2I]
    b2 = (torch.randn(num_experts, hidden, device="cuda", generator=g) * 0.1).to(torch.bfloat16)       # [E, H]
    router = (torch.randn(num_experts, hidden, device="cuda", generator=g) / hidden ** 0.5).to(torch.bfloat16)
    x, logits = _inputs(num_tokens, hidden, router, logits_dtype=torch.float32)
    weights, ids = route(logits, top_k, renormalize=True)
    bias = dict(b13=b13, b2=b2, swiglu_limit=7.0)
    ref32 = moe_reference(x.float(), weights, ids, w13.float(), w2.float(), None, b13.float(), b2.float(), 7.0)
    _close(moe_op.fused_experts(x, weights, ids, w13, w2, **bias), ref32)
    chosen = moe_op.launch_for(x, w13, top_k)
    shape = MoeShape(num_tokens, num_experts, hidden, intermediate, top_k, 2, 132)
    other = fallback_launch(shape, gemv_max_tokens=0 if chosen.path == "gemv" else num_tokens)
    _close(moe_op.fused_experts(x, weights, ids, w13, w2, other, **bias), ref32)
    _close(moe_op.moe(x, logits, w13, w2, top_k, True, None, None, b13, b2, 7.0), ref32)


def test_alignment_of_a_long_prefill_equals_the_stable_sort():
    ids = torch.stack([torch.randperm(128, device="cuda")[:8] for _ in range(8192)]).to(torch.int32)
    ids[ids == 7] = 3                         # expert 7 empty
    for block_m in (16, 64, 128):
        got = moe_align(ids, 128, block_m)
        ref = align_reference(ids, 128, block_m)
        n = int(got[2])
        assert n == int(ref[2]) and torch.equal(got[0][:n], ref[0][:n]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_op_replays_in_a_cuda_graph_and_compiles(layer, num_tokens):
    """Captured once, replayed on new routing: equal to the eager op (no host sync inside: capture would fail);
    compiled alike; close to the float32 loop."""
    name, w13, w2, router, top_k = layer
    x, logits = _inputs(num_tokens, w13.shape[2], router)
    static_x, static_logits = x.clone(), logits.clone()
    moe_op.moe(static_x, static_logits, w13, w2, top_k, True)          # compile the kernels first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_op.moe(static_x, static_logits, w13, w2, top_k, True)
    for seed in (2, 3):
        new_x, new_logits = _inputs(num_tokens, w13.shape[2], router, seed)
        static_x.copy_(new_x)
        static_logits.copy_(new_logits)
        graph.replay()
        assert torch.equal(static_out, moe_op.moe(new_x, new_logits, w13, w2, top_k, True))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: moe_op.moe(a, b, w13, w2, top_k, True), fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, logits), moe_op.moe(x, logits, w13, w2, top_k, True))
    # the whole op (the decode path routes inside its first kernel) against the float32 loop
    x, logits = _inputs(num_tokens, w13.shape[2], router, seed=4, logits_dtype=torch.float32)
    ref32 = moe_reference(x.float(), *route_reference(logits, top_k, True), w13.float(), w2.float())
    _close(moe_op.moe(x, logits, w13, w2, top_k, True), ref32)
    residual = torch.randn_like(x)                  # the add the fusion pass folds in
    _close(moe_op.moe(x, logits, w13, w2, top_k, True, residual), ref32 + residual.float())


# ---- models through the engine ----------------------------------------------------------------------------------
def _hf_folder(tmp_path_factory, name, **overrides):
    """transformers' model of a trimmed bundled config, float32 on the GPU, saved; (folder, model)."""
    from transformers import AutoModelForCausalLM

    from ember.models.bundled import bundled_config
    cfg = bundled_config(name, **overrides).to_transformers()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path), model


# 2 layers; Qwen3-MoE keeps 128 experts of its real size (top 8), Mixtral's experts shrink to fit the GPU twice
TRIMMED = {"qwen3-30b-a3b": dict(num_hidden_layers=2),
           "mixtral-8x7b": dict(num_hidden_layers=2, intermediate_size=4096),
           "gpt-oss-20b": dict(num_hidden_layers=2)}


@pytest.fixture(scope="module", params=list(TRIMMED))
def family(request, tmp_path_factory):
    path, hf = _hf_folder(tmp_path_factory, request.param, **TRIMMED[request.param])
    yield path, hf
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def _prompts(lengths=(5, 17, 33, 70)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 10000, (n,), generator=g).tolist() for n in lengths]


def test_float32_greedy_equals_transformers(family):
    from ember import LLM, SamplingParams
    path, hf = family
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = None
    try:
        llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.5, max_num_batched_tokens=64)
        prompts = _prompts()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert o.outputs[0].token_ids == ref
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_bfloat16_teacher_forced_logits(family):
    from ember import LLM
    path, hf = family
    llm = LLM(path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.5)
    # random weights leave few positions decided (a clear top-1 in float32): 2.5-5% for the Mixtral shape, so
    # about 4,500 positions give the 64 the agreement is counted over; gpt-oss's about 1% (45 of 4,688 on an H200),
    # so it scores twice the prompts (the generator goes on: new tokens, not the same prompts again)
    lengths = (128, 160, 200, 256, 300, 360, 400, 480, 96, 144, 224, 288, 320, 384, 448, 500)
    if hf.config.model_type == "gpt_oss":
        lengths = lengths * 2
    check_teacher_forced(llm, hf, _prompts(lengths), hf.config.model_type)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_full_replay_bitwise_equals_the_graph_free_forward(tmp_path):
    """The trimmed Qwen3-30B-A3B config, random weights: per step (a mixed prefill, then uniform decodes) the FULL
    replay's hidden states equal the compiled forward run without graphs at the same padded size."""
    from ember import LLM, SamplingParams
    from ember.graphs.modes import CUDAGraphMode
    from ember.models.bundled import CONFIG_DIR
    values = {**json.loads((CONFIG_DIR / "qwen3-30b-a3b.json").read_text()), "num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(values))
    llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=256, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 64, 128, 256],
              gpu_memory_utilization=0.5, cudagraph_mode="full")
    engine, runner = llm.engine, llm.engine.runner
    for prompt in _prompts((3, 9, 30, 7, 20)):          # 69 prompt tokens: bucket 128; decodes of 5: bucket 8
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seen = set()
    for _ in range(3):
        out = engine.scheduler.schedule()
        t = out.total_num_tokens
        with torch.inference_mode():
            prepared = runner.prepare_step(out.step)
            assert prepared.mode == CUDAGraphMode.FULL and prepared.desc.num_tokens > t
            no_graph, _ = runner._run(prepared.batch, CUDAGraphMode.NONE, None)
            no_graph = no_graph.clone()
            replay, tokens = runner._run(prepared.batch, CUDAGraphMode.FULL, prepared.desc)
            assert torch.equal(no_graph[:t], replay[:t])
            result = runner.sample_step(prepared, replay, tokens).result()
        seen.add(out.num_decodes == len(out.scheduled))
        engine.scheduler.update(out, result.sampled_token_ids)
    assert seen == {False, True}
