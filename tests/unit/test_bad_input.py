"""Bad input raises a ValueError naming the value and the limit, before anything is scheduled; the engine keeps
working afterwards."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ember import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad_input_llama")
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), device="cpu", max_model_len=32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), r"temperature -0.5 must be"),
    (dict(top_p=0.0), r"top_p 0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p 1.5 must be in \(0, 1\]"),
    (dict(top_k=0), r"top_k 0 must be -1"),
    (dict(top_k=-2), r"top_k -2 must be -1"),
    (dict(max_tokens=0), r"max_tokens 0 must be at least 1"),
    (dict(logprobs=21), r"logprobs 21 must be in \[0, 20\]"),
    (dict(min_p=1.5), r"min_p 1.5 must be in"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ([], "prompt is empty"),
    ([1, 2, 128], r"token id 128 is outside the vocabulary \[0, 128\)"),
    ([-1], r"token id -1 is outside"),
    (list(range(40)), r"40 tokens.*max_model_len 32"),
    ({"text": "x"}, r"'prompt' or 'prompt_token_ids'"),
])
def test_bad_prompts_raise_before_scheduling_and_engine_keeps_working(llm, prompt, match):
    good = {"prompt_token_ids": [1, 2, 3]}
    bad = prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}
    with pytest.raises(ValueError, match=match):
        llm.generate([good, bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()        # the good prompt in the same call was not queued either
    out = llm.generate([good], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)


def test_max_model_len_limits(folder):
    with pytest.raises(ValueError, match="max_model_len 100 exceeds the model's max_position_embeddings 64"):
        LLM(str(folder), device="cpu", max_model_len=100)
    with pytest.raises(ValueError, match=r"max_model_len 48 exceeds the KV cache capacity of 32 tokens"):
        LLM(str(folder), device="cpu", max_model_len=48, num_kv_blocks=2, block_size=16)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=12), "block_size 12 is not supported"),
    (dict(max_num_seqs=0), "max_num_seqs 0 must be at least 1"),
    (dict(dtype="int8"), "dtype 'int8' is not supported"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization 1.5 must be in \(0, 1\]"),
    (dict(attention_backend="nope"), "attention backend 'nope' is not registered"),
])
def test_bad_engine_args(folder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), device="cpu", **kwargs)


def test_bad_folders(tmp_path, folder):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MambaForCausalLM.*LlamaForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_tiny_temperature_samples_greedily(llm):
    prompt = {"prompt_token_ids": [5, 9, 2]}
    greedy = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tiny = SamplingParams(temperature=1e-40, max_tokens=4, ignore_eos=True, seed=1)
    assert llm.generate(prompt, tiny, use_tqdm=False)[0].outputs[0].token_ids == greedy


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_stop_token_ids_outside_the_vocabulary(llm, min_tokens):
    bad = SamplingParams(max_tokens=4, min_tokens=min_tokens, stop_token_ids=[3, 128])
    good = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match=r"stop_token_ids entry 128 is outside the vocabulary \[0, 128\)"):
        llm.generate([good, good], [GREEDY, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("damage", ["empty", "truncated", "corrupt"])
def test_damaged_safetensors_name_the_file(tmp_path, folder, damage):
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    data = (folder / "model.safetensors").read_bytes()
    data = {"empty": b"", "truncated": data[:len(data) // 2], "corrupt": b"\xff" * 64 + data[64:]}[damage]
    (tmp_path / "model.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'model.safetensors'}.*(truncated or corrupt)"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]"])
def test_invalid_config_json_names_the_file(tmp_path, folder, text):
    (tmp_path / "config.json").write_text(text)
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}.* cannot be read as a model config"):
        LLM(str(tmp_path), device="cpu")


def test_token_id_list_takes_plain_ints_whole_and_converts_or_refuses_the_rest():
    import numpy as np

    from ember.engine.engine import token_id_list
    ids = [5, 0, 127]
    out = token_id_list(ids)
    assert out == [5, 0, 127] and out is not ids           # a copy: the caller's list is never held
    assert token_id_list((3, 4)) == [3, 4]
    mixed = token_id_list([np.int64(7), 2, torch.tensor(9)])
    assert mixed == [7, 2, 9] and [type(t) for t in mixed] == [int, int, int]
    with pytest.raises(TypeError, match="must be an int, got bool True"):
        token_id_list([1, True])
    with pytest.raises(TypeError, match="must be an int, got float 2.0"):
        token_id_list((1, 2.0))
