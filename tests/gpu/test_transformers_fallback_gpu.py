"""The transformers fallback on the GPU: the default model's architecture (SmolLM2-135M, a Llama) through it, greedy
tokens equal to transformers' in float32 eager and compiled with CUDA graphs; a non-native family (GPT-NeoX, Pythia-
1B's config trimmed) likewise in every CUDA-graph mode; and in bfloat16 the fallback's teacher-forced logits as close to transformers'
float32 logits as transformers' own bf16 run is, beside ember's native model of the same weights."""

import copy
import gc

import pytest
import torch
from tests.helpers.bf16_check import bf16_report

from ember import LLM, SamplingParams
from ember.models.bundled import bundled_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# SmolLM2-135M-Instruct's public config (ember's default model); used with random weights when the converted
# default model is not in the cache (a GPU host without network cannot fetch it)
SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
                    bos_token_id=1, eos_token_id=2)
BF16_ERR_RATIO = 1.25
TOP1_AGREEMENT = 0.98
MODES = {"eager": dict(enforce_eager=True), "graphs": dict(cudagraph_mode="full_and_piecewise"),
         "piecewise": dict(cudagraph_mode="piecewise"), "full": dict(cudagraph_mode="full"),
         "full_decode_only": dict(cudagraph_mode="full_decode_only")}


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _release():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """(folder, transformers model in float32): the converted default model if the cache has it, else random
    weights of its config."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ember.models.default_model import default_model_dir, is_complete
    folder = default_model_dir()
    if is_complete(folder):
        return str(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), dtype=torch.float32)
    path = tmp_path_factory.mktemp("smollm2-135m")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.fixture(scope="module")
def pythia(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(bundled_config("pythia-1b", num_hidden_layers=4).to_transformers(),
                                          dtype=torch.float32)
    path = tmp_path_factory.mktemp("pythia-1b")
    hf.save_pretrained(path)
    return str(path), hf


def _prompts(vocab, lengths=(5, 17, 33)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, min(vocab, 10000), (n,), generator=g).tolist() for n in lengths]


def _check_greedy(path, hf, mode):
    hf = hf.to("cuda", torch.float32).eval()
    llm = LLM(path, dtype="float32", model_impl="transformers", max_model_len=512, gpu_memory_utilization=0.5,
              **MODES[mode])
    runner = llm.engine.runner
    assert type(runner.model).__name__ == "TransformersForCausalLM"
    if mode != "eager":      # one piece more than attention calls: the split cuts only at ember::attention
        stats = runner.compile_stats
        assert stats.num_attention_splits == hf.config.num_hidden_layers == stats.num_pieces - 1
    prompts = _prompts(hf.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    del llm, runner
    hf.to("cpu")
    _release()


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_default_model_through_the_fallback_equals_transformers(default_model, mode, no_tf32):
    _check_greedy(*default_model, mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_gpt_neox_through_the_fallback_equals_transformers(pythia, mode, no_tf32):
    _check_greedy(*pythia, mode)


def test_bfloat16_fallback_as_close_as_native(tmp_path):
    """Llama-3.2-1B's config (4 layers), bf16 with CUDA graphs: the fallback's and the native model's teacher-forced
    logits each within BF16_ERR_RATIO of transformers' own bf16 error against float32."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(bundled_config("llama-3.2-1b", num_hidden_layers=4).to_transformers(),
                                          dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    hf = hf.to("cuda").eval()
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    prompts = _prompts(hf.config.vocab_size, (128, 160, 200, 256))
    ref16, ref32 = [], []
    with torch.no_grad():
        for tokens in prompts:
            ids = torch.tensor([tokens], device="cuda")
            ref32.append(hf(ids).logits[0].float())
            ref16.append(hf16(ids).logits[0].float())
    del hf, hf16
    _release()
    for impl in ("transformers", "ember"):
        llm = LLM(str(tmp_path), dtype="bfloat16", model_impl=impl, max_model_len=512, gpu_memory_utilization=0.5)
        got = torch.cat([llm.engine.score(tokens) for tokens in prompts])
        r = bf16_report(got, torch.cat(ref16), torch.cat(ref32))
        print(f"{impl} bf16: {r}")
        assert r["rel_err_vs_fp32"] <= BF16_ERR_RATIO * r["ref_rel_err_vs_fp32"]
        assert r["num_decided"] >= 64 and r["top1_decided"] >= TOP1_AGREEMENT
        del llm
        _release()
