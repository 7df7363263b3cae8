"""ember with the flash backend, and with the default (auto: per_phase, prefill through flash and decode through
triton_unified, on 64-token pages), against transformers on the GPU (random weights of the Qwen3-0.6B config,
layers trimmed): float32 greedy tokens equal, eager and FULL CUDA graphs alike; bf16 teacher-forced logits within
the bound the other backends meet (see test_parity_gpu.py)."""

import gc

import pytest
import torch
from tests.helpers.bf16_check import check_teacher_forced

from ember import LLM, SamplingParams
from ember.models.bundled import bundled_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# backend name -> LLM arguments; the default engine must pick per_phase on 64-token pages by itself
BACKENDS = {"flash": dict(attention_backend="flash", block_size=64), "per_phase": {}}
COMMON = dict(max_model_len=512, gpu_memory_utilization=0.5)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    cfg = bundled_config("qwen3-0.6b", num_hidden_layers=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg.to_transformers(), dtype=torch.float32)
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _prompts(vocab, lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, min(vocab, 10000), (n,), generator=g).tolist() for n in lengths]


def _llm(path, backend, **kwargs):
    llm = LLM(path, **BACKENDS[backend], **COMMON, **kwargs)
    runner = llm.engine.runner
    assert [b.name for b in runner.attn.backends] == [backend] * len(runner.attn.groups), runner.attn.backends
    assert runner.config.cache.block_size == 64
    return llm


def _generate(path, prompts, backend, **kwargs):
    llm = _llm(path, backend, dtype="float32", **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_float32_greedy_equals_transformers_eager_and_full_graphs(qwen3, no_tf32, backend):
    path, hf = qwen3
    hf = hf.to("cuda", torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, (5, 70, 133))   # across 64-token pages
    eager = _generate(path, prompts, backend, enforce_eager=True)
    graphs = _generate(path, prompts, backend, compile_mode="none", cudagraph_mode="full")
    for p, got, replayed in zip(prompts, eager, graphs):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref
        assert replayed == ref


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_bfloat16_teacher_forced_logits(qwen3, backend):
    path, hf = qwen3
    llm = _llm(path, backend, dtype="bfloat16", enforce_eager=True)
    hf = hf.to("cuda", torch.float32).eval()
    check_teacher_forced(llm, hf, _prompts(hf.config.vocab_size, (128, 160, 200, 256)),   # 744 positions
                         f"{backend} {hf.config.model_type}")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
