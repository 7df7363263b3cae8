"""Kernels per decoder layer in a batch-1 decode step, counted with the profiler on FULL-graph replays: the same
model shape with 4 and with 2 layers, so every launch outside the layers (embedding, final norm, LM head,
sampling, input preparation) cancels. Qwen3 (q/k norm + rotary) and Llama (rotary) shapes with the real head size
128: with the rotary folded into the decode attention kernel (`fused_decode_rope` on) a layer is qkv GEMV,
attention, o, gate_up and down GEMVs (the contexts are short, so the step replays the bucket's short-context graph,
with the one-pass decode kernel; split-KV adds its reduce); off, the QK-norm+RoPE kernel comes back; auto (the
default) folds rotary alone (Llama) and leaves a q/k norm (Qwen3) to its own kernel."""

import pytest
import torch

from ember.bench.commands import profile_workload, release_engine
from ember.sampling_params import SamplingParams
from tests.helpers.model_harness import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"qwen3": dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128),
          "llama": dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128)}


def _launches_per_step(tmp_path, family: str, num_layers: int, fused_rope: bool) -> float:
    from transformers import AutoModelForCausalLM
    from ember import LLM
    config = tiny_config(family, hidden_size=1024, intermediate_size=3072, num_hidden_layers=num_layers,
                         vocab_size=4096, max_position_embeddings=1024, **SHAPES[family])
    folder = tmp_path / f"{family}-{num_layers}"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
              gpu_memory_utilization=0.2, attention_backend="triton_unified",
              attention_backend_options={"fused_decode_rope": fused_rope})
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    profile = profile_workload(llm, [list(range(10, 42))], params, num_steps=10, skip_steps=3)
    release_engine(llm)
    return profile.launches


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_six_kernels_per_layer_at_batch_1(family, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    per_layer = {}
    for mode in (True, False, "auto"):
        two, four = (_launches_per_step(tmp_path / str(mode), family, n, mode) for n in (2, 4))
        per_layer[mode] = (four - two) / 2
    print(f"{family}: kernels per layer {per_layer[True]:.2f} (rope folded into attention), "
          f"{per_layer[False]:.2f} (its own kernel), {per_layer['auto']:.2f} (auto)")
    assert per_layer[True] <= 5
    assert per_layer["auto"] <= 6
    assert per_layer[False] == per_layer[True] + 1
    assert per_layer["auto"] == per_layer[False if family == "qwen3" else True]
