"""Hub ids resolve through a hub cache laid out as huggingface_hub lays it out, with no network."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ember import LLM, SamplingParams
from ember.models import hub
from ember.models.default_model import resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hub_llama")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture
def hub_cache(tmp_path, folder, monkeypatch):
    """<cache>/models--tiny-org--tiny-llama/{refs/main, snapshots/<commit>/...}, offline."""
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    for commit in (COMMIT, OTHER):
        shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return repo


def test_hub_id_loads_from_the_cache_offline(hub_cache, folder):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 5, 9, 2]}
    by_id = LLM("tiny-org/tiny-llama", device="cpu").generate(prompt, params, use_tqdm=False)
    by_folder = LLM(str(folder), device="cpu").generate(prompt, params, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_folder[0].outputs[0].token_ids


def test_revision_picks_its_snapshot(hub_cache):
    assert resolve_model_path("tiny-org/tiny-llama") == hub_cache / "snapshots" / COMMIT
    assert resolve_model_path("tiny-org/tiny-llama", revision=OTHER) == hub_cache / "snapshots" / OTHER


def test_missing_id_offline_says_so(hub_cache):
    with pytest.raises(hub.HubModelError, match=r"model 'tiny-org/absent' is not in the Hugging Face cache .*"
                                                r"HF_HUB_OFFLINE is set.*huggingface-cli download tiny-org/absent"):
        LLM("tiny-org/absent", device="cpu")
    with pytest.raises(hub.HubModelError, match=r"'tiny-org/tiny-llama' at revision 'v9'"):
        resolve_model_path("tiny-org/tiny-llama", revision="v9")


def test_not_cached_and_online_downloads(hub_cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            from huggingface_hub.errors import LocalEntryNotFoundError
            raise LocalEntryNotFoundError("not cached")
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    assert hub.resolve_repo_id("tiny-org/new", revision="v1") == tmp_path
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1]["revision"] == "v1" and "*.safetensors" in calls[1]["allow_patterns"]


def test_revision_with_a_local_folder_is_refused(folder):
    with pytest.raises(ValueError, match=r"revision 'main' applies to hub ids; .* is a local folder"):
        resolve_model_path(str(folder), revision="main")
