"""ember against transformers on the GPU, random weights of real public configs (layers trimmed to keep it quick).

float32 with TF32 off: greedy tokens equal. bfloat16: teacher-forced logits no further from transformers' float32
logits than transformers' own bf16 run is (times 1.25), and top-1 agreement with transformers' bf16 run on at least
98% of decided positions (see bf16_check.py: random weights make near-ties that bf16 rounding flips)."""

import gc

import pytest
import torch
from tests.helpers.bf16_check import check_teacher_forced

from ember import LLM, SamplingParams
from ember.models.bundled import bundled_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _folder(tmp_path_factory, name, num_layers=4):
    from transformers import AutoModelForCausalLM
    cfg = bundled_config(name, num_hidden_layers=num_layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg.to_transformers(), dtype=torch.float32)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module", params=["qwen3-0.6b", "llama-3.2-1b"])
def family(request, tmp_path_factory):
    return _folder(tmp_path_factory, request.param)


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _prompts(vocab, lengths=(5, 17, 33)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, min(vocab, 10000), (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["torch_ref", "auto"])
def test_float32_greedy_equals_transformers(family, backend, no_tf32):
    path, hf = family
    hf = hf.to("cuda", torch.float32).eval()
    llm = LLM(path, dtype="float32", attention_backend=backend, enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.5)
    prompts = _prompts(hf.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", ["torch_ref", "auto"])
def test_bfloat16_teacher_forced_logits(family, backend):
    path, hf = family
    llm = LLM(path, dtype="bfloat16", attention_backend=backend, enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.5)
    hf = hf.to("cuda", torch.float32).eval()
    check_teacher_forced(llm, hf, _prompts(hf.config.vocab_size, (128, 160, 200, 256)),   # 744 positions
                         f"{backend} {hf.config.model_type}")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
