"""`LLM(tokenizer=, tokenizer_mode=, tokenizer_revision=)` as vLLM takes them: a folder or a hub id (at a revision)
is the tokenizer that encodes prompts, decodes outputs and ends them on its EOS; what ember cannot honour is refused
before anything loads."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from ember import LLM, SamplingParams
from ember.models import hub
from ember.tokenizer_args import tokenizer_folder
from tests.helpers.tiny_tokenizer import WORDS, save_tiny_tokenizer

PROMPT = "the capital of france is"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _save_reversed_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer over the same words in reverse order, with its own EOS ("<|end|>")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = (WORDS + ["<|end|>"] + [f"w{i}" for i in range(vocab_size - len(WORDS) - 1)])[::-1]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|end|>"
                            ).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny model with the tiny tokenizer; a copy of that tokenizer alone; a reversed tokenizer alone."""
    root = tmp_path_factory.mktemp("tokenizer_args")
    model = root / "model"
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model)
    save_tiny_tokenizer(model, 64)
    copy = root / "copy"
    copy.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(model / name, copy / name)
    reversed_ = root / "reversed"
    _save_reversed_tokenizer(reversed_, 64)
    return {"model": model, "copy": copy, "reversed": reversed_}


def test_a_copy_of_the_model_tokenizer_in_another_folder_gives_the_same_outputs(folders):
    own = LLM(str(folders["model"]), device="cpu").generate(PROMPT, GREEDY, use_tqdm=False)[0]
    given = LLM(str(folders["model"]), device="cpu", tokenizer=str(folders["copy"]))
    out = given.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == own.prompt_token_ids == [7, 8, 9, 10, 11]
    assert out.outputs[0].token_ids == own.outputs[0].token_ids
    assert out.outputs[0].text == own.outputs[0].text and out.outputs[0].text


def test_a_different_tokenizer_encodes_decodes_and_ends_the_outputs(folders):
    reference = AutoTokenizer.from_pretrained(str(folders["reversed"]))
    llm = LLM(str(folders["model"]), device="cpu", tokenizer=str(folders["reversed"]))
    ids = reference.encode(PROMPT)
    assert ids == [56, 55, 54, 53, 52]                     # not the model tokenizer's [7, 8, 9, 10, 11]
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    whole = reference.decode(ids + out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.outputs[0].text == whole[len(PROMPT):] and len(out.outputs[0].text) > 1
    same = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    end = reference.convert_tokens_to_ids("<|end|>")
    assert end == 43 and end in llm.engine.eos_token_ids
    tok = llm.get_tokenizer()
    assert tok.eos_token == "<|end|>" and tok.encode("hello world") == reference.encode("hello world")


@pytest.fixture
def hub_cache(tmp_path, folders, monkeypatch):
    """<cache>/models--tiny-org--tok with the model's tokenizer at COMMIT (main) and the reversed one at OTHER."""
    repo = tmp_path / "hub" / "models--tiny-org--tok"
    shutil.copytree(folders["copy"], repo / "snapshots" / COMMIT)
    shutil.copytree(folders["reversed"], repo / "snapshots" / OTHER)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return repo


def test_a_hub_id_at_a_revision_is_the_tokenizer(folders, hub_cache):
    assert tokenizer_folder("tiny-org/tok", None, None, None) == hub_cache / "snapshots" / COMMIT
    llm = LLM(str(folders["model"]), device="cpu", tokenizer="tiny-org/tok", tokenizer_revision=OTHER)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].prompt_token_ids == [56, 55, 54, 53, 52]
    with pytest.raises(hub.HubModelError, match=r"^tokenizer 'tiny-org/absent' is not in the Hugging Face cache .*"
                                                r"or pass a local tokenizer folder$"):
        LLM(str(folders["model"]), device="cpu", tokenizer="tiny-org/absent")


def test_a_hub_tokenizer_downloads_without_the_weights(monkeypatch, tmp_path, folders):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            from huggingface_hub.errors import LocalEntryNotFoundError
            raise LocalEntryNotFoundError("not cached")
        return str(folders["copy"])

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    assert tokenizer_folder("tiny-org/new", "v1", None, None, tmp_path) == folders["copy"]
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1]["revision"] == "v1" and calls[1]["cache_dir"] == tmp_path
    assert calls[1]["allow_patterns"] == ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(tokenizer_mode="mistral"), ValueError,
     "tokenizer_mode 'mistral' is not supported: mistral_common tokenizers are not supported; use "
     "tokenizer_mode='auto' with a checkpoint that ships Hugging Face tokenizer files (tokenizer.json or "
     "tokenizer_config.json)"),
    (dict(tokenizer_mode="slow"), ValueError,
     "tokenizer_mode 'slow' is not supported: ember loads tokenizers with transformers' AutoTokenizer, which picks "
     "the fast (Rust) tokenizer; use tokenizer_mode='auto'"),
    (dict(tokenizer_mode="custom"), ValueError,
     "tokenizer_mode 'custom' is not supported: custom tokenizer classes are not supported; use tokenizer_mode='auto'"),
    (dict(tokenizer_mode="fast"), ValueError,
     "tokenizer_mode 'fast' is not a tokenizer mode; use 'auto' (vLLM's 'slow', 'mistral' and 'custom' are not "
     "supported)"),
    (dict(tokenizer=7), TypeError, "tokenizer must be a folder or a hub id ('org/name'), got int 7"),
    (dict(tokenizer="no such/place/x"), ValueError,
     "tokenizer 'no such/place/x' is neither a folder nor a hub id; pass a folder with tokenizer files "
     "(tokenizer.json, tokenizer_config.json) or a hub id such as 'Qwen/Qwen3-0.6B'"),
    (dict(tokenizer_revision="v2"), ValueError,
     "tokenizer_revision 'v2' applies to a tokenizer from the hub, and the tokenizer here is that of the model "
     "'default', which is not a hub id; drop tokenizer_revision, or pass tokenizer='org/name' with it"),
])
def test_what_cannot_be_honoured_is_refused_before_loading(monkeypatch, kwargs, error, message):
    monkeypatch.setattr("ember.llm.Engine", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("ember.models.default_model.ensure_default_model",
                        lambda *a, **k: pytest.fail("the default model was fetched"))
    with pytest.raises(error) as info:
        LLM(device="cpu", **kwargs)
    assert str(info.value) == message


def test_a_folder_without_tokenizer_files_or_with_a_revision_is_refused(monkeypatch, folders, tmp_path):
    monkeypatch.setattr("ember.llm.Engine", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError) as info:
        LLM(str(folders["model"]), device="cpu", tokenizer=str(tmp_path))
    assert str(info.value) == (f"tokenizer {str(tmp_path)!r} is a folder with none of tokenizer.json, "
                               f"tokenizer_config.json, tokenizer.model; pass the folder that holds the tokenizer's "
                               f"files")
    with pytest.raises(ValueError) as info:
        LLM(str(folders["model"]), device="cpu", tokenizer=str(folders["copy"]), tokenizer_revision="main")
    assert str(info.value) == (f"tokenizer_revision 'main' applies to hub ids; tokenizer {str(folders['copy'])!r} "
                               f"is a local folder")


def test_the_command_line_passes_the_tokenizer_flags():
    import argparse
    from ember.args import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--tokenizer", "org/tok", "--tokenizer-revision", "v1"]))
    assert (kwargs["tokenizer"], kwargs["tokenizer_mode"], kwargs["tokenizer_revision"]) == ("org/tok", "auto", "v1")
    kwargs = engine_kwargs(parser.parse_args([]))
    assert (kwargs["tokenizer"], kwargs["tokenizer_mode"], kwargs["tokenizer_revision"]) == (None, "auto", None)
