"""vLLM scripts run unchanged or fail clearly: the keyword arguments vLLM takes, typed prompts, decoded tokens in
logprobs, and the prompt text of chat outputs."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ember import LLM, SamplingParams
from ember.inputs import TextPrompt, TokensPrompt
from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("compat_llama")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    save_tiny_tokenizer(path, 64)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), device="cpu", tensor_parallel_size=1, trust_remote_code=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=0), r"tensor_parallel_size 0 must be at least 1"),
    (dict(quantization="awq"), r"quantization 'awq' is not supported; use 'fp8'"),
    (dict(kv_cache_dtype="int8"), r"kv_cache_dtype 'int8' is not supported; use 'auto'"),
    (dict(swap_space=4), r"'swap_space': ember preempts by recomputation"),
    (dict(max_num_seq=8), r"'max_num_seq': did you mean max_num_seqs=\?"),
    (dict(zzz=1), r"'zzz': LLM\(\) takes: .*max_num_seqs"),
])
def test_llm_refuses_what_it_cannot_honour_before_loading(folder, monkeypatch, kwargs, match):
    monkeypatch.setattr("ember.llm.Engine", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises((TypeError, ValueError), match=match):
        LLM(str(folder), device="cpu", **kwargs)


def test_unimplemented_architecture_is_refused_even_with_trust_remote_code(folder, tmp_path):
    custom = tmp_path / "custom"
    custom.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MyCustomForCausalLM"]
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\['MyCustomForCausalLM'\].*not implemented in ember.*trust_remote_code"):
        LLM(str(custom), device="cpu", trust_remote_code=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(best_of=2), r"'best_of': it was removed from vLLM's V1 engine too; use n="),
    (dict(logit_bias={1: 2.0}), r"'logit_bias'"),
    (dict(temprature=0.5), r"'temprature': did you mean temperature=\?"),
])
def test_sampling_params_names_unknown_arguments(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


def test_generate_names_unknown_arguments(llm):
    with pytest.raises(TypeError, match=r"'prompt_token_ids': pass the ids as the prompt: TokensPrompt"):
        llm.generate(None, GREEDY, prompt_token_ids=[[1, 2]])
    with pytest.raises(TypeError, match=r"'lora_request': LoRA adapters are not supported"):
        llm.generate("hello", GREEDY, lora_request=object())


def test_typed_prompts_give_the_same_tokens_as_plain_ones(llm):
    ids = llm.get_tokenizer().encode("the capital of france is")
    plain = llm.generate(["the capital of france is", ids], GREEDY, use_tqdm=False)
    typed = llm.generate([TextPrompt(prompt="the capital of france is"), TokensPrompt(prompt_token_ids=ids)],
                         GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in typed] == [o.outputs[0].token_ids for o in plain]
    assert typed[0].prompt == "the capital of france is" and typed[0].prompt_token_ids == ids


def test_logprobs_carry_the_decoded_token(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for step, chosen in zip(out.logprobs, out.token_ids):
        assert chosen in step and len(step) >= 2
        for token_id, lp in step.items():
            assert lp.decoded_token == tok.decode([token_id]) and lp.decoded_token


def test_chat_output_carries_the_rendered_prompt(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<|user|> hello <|assistant|> "
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)


def test_prompt_logprobs_match_transformers(llm, folder):
    prompt = [1, 7, 8, 9, 10, 11, 12, 5, 6, 13, 14, 15, 16, 17, 18, 19, 3, 4, 20, 21]   # spans two blocks
    k = 3
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k),
                       use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)   # [n, V]
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        row, token = expected[i], prompt[i + 1]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert t in entry and abs(entry[t].logprob - lp) < 1e-4
            if t != token:
                assert entry[t].rank == rank
        assert set(entry) <= set(top.indices.tolist()) | {token}
    # the generated tokens are those of a request without prompt logprobs
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids and plain[0].prompt_logprobs is None


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs 21 must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_structured_output_spellings_of_vllm_are_taken():
    from ember import GuidedDecodingParams, StructuredOutputsParams
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    new = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    old = SamplingParams(guided_decoding=GuidedDecodingParams(json=json.dumps(schema), backend="guidance"))
    assert new.structured_outputs == old.structured_outputs and new.structured_outputs.kind == "json"
    assert hash(new) == hash(SamplingParams(structured_outputs=StructuredOutputsParams(json=dict(schema))))
    with pytest.raises(TypeError, match=r"structured_outputs must be a StructuredOutputsParams .*got dict"):
        SamplingParams(structured_outputs={"json": schema})
    with pytest.raises(ValueError, match=r"structured_outputs or its older name guided_decoding, not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=GuidedDecodingParams(regex="b"))
    with pytest.raises(ValueError, match=r"backend 'xgrammar' is not available: ember's structured output runs on "
                                         r"llguidance; use backend='guidance'"):
        GuidedDecodingParams(regex="a", backend="xgrammar")
    with pytest.raises(ValueError, match=r"sets \['json', 'regex'\] of .*; set exactly one"):
        StructuredOutputsParams(json=schema, regex="a")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(guided_decoding_backend="xgrammar"), ValueError,
     r"guided_decoding_backend 'xgrammar' is not available: ember's structured output runs on llguidance"),
    (dict(structured_outputs_config={"backend": "xgrammar"}), TypeError,
     r"'structured_outputs_config': ember's structured output runs on llguidance and needs no configuration"),
])
def test_structured_output_settings_of_llm_are_checked_before_loading(folder, monkeypatch, kwargs, error, match):
    monkeypatch.setattr("ember.llm.Engine", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(error, match=match):
        LLM(str(folder), device="cpu", **kwargs)


def test_structured_output_in_generate_and_in_requests(llm):
    with pytest.raises(TypeError, match=r"'guided_options_request': pass SamplingParams\(structured_outputs="):
        llm.generate("hello", GREEDY, guided_options_request={"guided_json": {}})
    from ember.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for model, body, kind in [(CompletionRequest, {"prompt": "x", "guided_json": {"type": "object"}}, "json"),
                              (CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a+"}}, "regex"),
                              (CompletionRequest, {"prompt": "x", "guided_choice": ["a", "b"]}, "choice"),
                              (ChatCompletionRequest, {**chat, "response_format": {"type": "json_object"}},
                               "json_object"),
                              (ChatCompletionRequest, {**chat, "response_format": {
                                  "type": "json_schema", "json_schema": {"name": "n", "schema": {}, "strict": True}}},
                               "json")]:
        request = model.model_validate(body)
        request.check_fields()
        assert request.sampling_params(16).structured_outputs.kind == kind
    # the values that ask for nothing pass, and give nothing
    request = CompletionRequest.model_validate({"prompt": "x", "guided_json": None, "response_format": {"type": "text"}})
    request.check_fields()
    assert request.sampling_params(16).structured_outputs is None
    with pytest.raises(ApiError) as info:
        CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}).sampling_params(16)
    assert info.value.param == "guided_choice" and "each ask for structured output; give one" in info.value.message
