"""ember on its default model (SmolLM2-135M-Instruct) against transformers, float32 on the CPU."""

import pytest
import torch

from ember import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"]
# relative to the largest |logit| (about 30 here): ember's CPU GEMMs (oneDNN, packed weights) sum in another order
# than transformers' (MKL); 1e-5 of the range is about a hundred float32 rounding steps, and greedy tokens must match
LOGIT_RTOL = 1e-5


@pytest.fixture(scope="module")
def models(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = str(converted["folder"])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return LLM(folder, device="cpu", max_model_len=512), hf, AutoTokenizer.from_pretrained(folder)


def test_first_step_logits_and_greedy_tokens(models):
    llm, hf, tok = models
    ids = [tok.encode(p) for p in PROMPTS]
    for p in ids:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        got = llm.engine.score(p)
        assert (got - ref).abs().max().item() <= LOGIT_RTOL * ref.abs().max().item()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(ids, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_chat_stops_at_end_of_turn(models):
    llm, _, tok = models
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=64),
                   use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == tok.eos_token_id and "<|im_end|>" not in c.text
    assert c.text.strip()


def test_stop_string_cuts_text(models):
    llm, _, _ = models
    full = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    word = full.split()[2]
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24, stop=[word]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == full[:full.index(word)]
