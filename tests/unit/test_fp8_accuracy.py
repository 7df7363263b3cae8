"""FP8 accuracy on ember's default model (SmolLM2-135M-Instruct) on the CPU: one teacher-forced pass over about
2,100 tokens of plain English (tests/helpers/english_text.py) with online fp8 weights, and with an fp8 KV cache,
against the same pass in bfloat16. The scaled layers round their inputs to e4m3 per token as the GPU's do, so the
weights' figure is the GPU's W8A8 (benches/experiments/fp8_accuracy.py prints the same on either device).

Measured on a 2-core CPU over 2,107 positions: fp8 weights 91.41% top-1 agreement, mean KL 0.0225 nats; fp8 KV
cache 94.35%, 0.0086 (docs/quantization.md: where the loss comes from, and why 97% and 98% are out of e4m3's reach
on this model). The bounds sit about a point under what was measured: a scale applied to the wrong rows or heads,
or a cache read without its scale, drops agreement far below them."""

from __future__ import annotations

import gc

import pytest

from tests.helpers.english_text import TEXT
from tests.helpers.teacher_forced import agreement, scored_logits

pytestmark = pytest.mark.slow      # three starts of the default model and 2,108-token passes in bfloat16: minutes


@pytest.fixture(scope="module")
def reference():
    from ember import LLM
    llm = LLM(None, device="cpu", dtype="bfloat16")
    ids = llm.tokenizer.encode(TEXT)
    logits = scored_logits(llm, ids)
    del llm
    gc.collect()
    return ids, logits


def _run(ids, **kwargs):
    from ember import LLM
    llm = LLM(None, device="cpu", dtype="bfloat16", **kwargs)
    try:
        return scored_logits(llm, ids)
    finally:
        del llm
        gc.collect()


def test_online_fp8_weights(reference):
    ids, logits = reference
    assert len(ids) - 1 >= 2000
    result = agreement(logits, _run(ids, quantization="fp8"))
    print(result)
    assert result.top1 >= 0.905 and result.mean_kl <= 0.026, result


def test_fp8_kv_cache(reference):
    ids, logits = reference
    result = agreement(logits, _run(ids, kv_cache_dtype="fp8"))
    print(result)
    assert result.top1 >= 0.935 and result.mean_kl <= 0.010, result
