"""Linear layers through oneDNN with packed weights (the CPU's float32 eager path) against transformers."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.models.layers.linear import Linear
from ember.models.layers.onednn import onednn_linear, onednn_packing_supported, pack_linear_weights, pack_weight
from ember.models.loader import load_model
from tests.helpers.model_harness import ModelHarness, greedy_generate, random_hf_model, save_tiny_llama, tiny_config

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

PROMPTS = [[5, 17, 300], list(range(40, 51)), [int(t) for t in torch.arange(23) * 13 % 320]]
LOGITS_ATOL = 1e-4


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(rows, 64)
    packed = pack_weight(weight)
    torch.testing.assert_close(onednn_linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-5, rtol=1e-5)
    # a strided input (a slice of a wider row) reads the same numbers
    wide = torch.randn(rows, 128)
    torch.testing.assert_close(onednn_linear(wide[:, :64], packed), wide[:, :64] @ weight.T, atol=1e-5, rtol=1e-5)


def test_only_decode_sized_inputs_take_the_packed_weight(monkeypatch):
    """Up to ONEDNN_MAX_ROWS rows through oneDNN, more through F.linear (oneDNN keeps a primitive per input shape);
    both give F.linear's numbers."""
    from ember.models.layers import linear as linear_module
    from ember.models.layers.onednn import ONEDNN_MAX_ROWS
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    pack_linear_weights(layer)
    calls = []
    monkeypatch.setattr(linear_module, "onednn_linear", lambda *args: calls.append(args[0].shape) or onednn_linear(*args))
    for rows in (1, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 3 * ONEDNN_MAX_ROWS):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-4,
                                   rtol=1e-5)
    assert calls == [torch.Size([1, 64]), torch.Size([ONEDNN_MAX_ROWS, 64])]


def test_packing_is_float32_on_the_cpu_only():
    assert onednn_packing_supported(torch.float32, "cpu")
    assert not onednn_packing_supported(torch.bfloat16, "cpu")
    assert not onednn_packing_supported(torch.float16, "cpu")
    assert not onednn_packing_supported(torch.float32, "meta")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_packed_model_matches_transformers(family, tmp_path):
    hf = random_hf_model(tiny_config(family))
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, None, torch.float32, "cpu", progress=False)
    layers = len(model.model.layers)
    # q/k/v, o, gate/up and down per layer, and the LM head
    assert pack_linear_weights(model) == 4 * layers + 1
    assert all(m.packed_weight is not None for m in model.modules() if isinstance(m, Linear))
    hidden = ModelHarness(model, len(PROMPTS)).step(list(enumerate(PROMPTS)))
    logits = model.compute_logits(hidden)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in PROMPTS])
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL
    got = greedy_generate(model, PROMPTS[1:], max_new_tokens=24)
    for prompt, tokens in zip(PROMPTS[1:], got):
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_onednn"))


@pytest.mark.parametrize("dtype, packs", [("float32", True), ("bfloat16", False)])
def test_engine_packs_float32_weights_on_the_cpu(tiny_llama, dtype, packs):
    llm = LLM(tiny_llama, device="cpu", dtype=dtype, num_kv_blocks=16, max_num_seqs=4)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all((m.packed_weight is not None) == packs for m in linears)
    out = llm.generate([{"prompt_token_ids": [3, 5, 7]}], SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_weights_stay_unpacked_when_their_copy_would_not_fit(tiny_llama, monkeypatch):
    import ember.runner.model_runner as model_runner
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: 1 << 10)   # 1 KiB available
    llm = LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=16, max_num_seqs=4)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is None for m in linears)
