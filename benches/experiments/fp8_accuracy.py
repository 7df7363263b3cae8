"""FP8 accuracy on real English: teacher-forced top-1 agreement and mean KL of fp8 weights (online) and an fp8 KV
cache against the same model unquantized, and which KV-cache scale is more accurate: 1.0, or one per KV head
measured from the unquantized run's keys and values (amax / 448, the most a head's values can use of e4m3's range).

    PYTHONPATH=. python benches/experiments/fp8_accuracy.py [--model PATH] [--device cpu|cuda] [--dtype ...]

The default model on the CPU runs in float32; the text is tests/helpers/english_text.py (about 2,100 tokens)."""

from __future__ import annotations

import argparse
import gc

import torch

from ember import LLM
from tests.helpers.english_text import TEXT
from tests.helpers.teacher_forced import agreement, scored_logits


def _kv_amax(llm, token_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the largest |key| and |value| of each KV head over one teacher-forced pass."""
    seen: dict[str, list[torch.Tensor]] = {}
    for name, state in llm.engine.runner.layer_states.items():
        impl, forward = state.impl, state.impl.forward

        def recording(query, key, value, *rest, _name=name, _forward=forward):
            amax = [t[:, :, :].abs().amax(dim=(0, 2)).float() for t in (key, value)]      # [Hkv] each
            old = seen.get(_name)
            seen[_name] = amax if old is None else [torch.maximum(a, b) for a, b in zip(old, amax)]
            return _forward(query, key, value, *rest)
        impl.forward = recording
    scored_logits(llm, token_ids)
    for state in llm.engine.runner.layer_states.values():
        del state.impl.forward
    return {name: tuple(v) for name, v in seen.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    common = dict(device=args.device, dtype=args.dtype, enforce_eager=True)
    base = LLM(args.model, **common)
    ids = base.tokenizer.encode(TEXT)
    reference = scored_logits(base, ids)
    amax = _kv_amax(base, ids)
    print(f"{len(ids)} tokens; reference: {base.engine.runner.dtype}")
    del base
    gc.collect()
    runs = {"fp8 weights (online, per channel)": dict(quantization="fp8"),
            "fp8 KV cache, scale 1.0": dict(kv_cache_dtype="fp8")}
    for label, kwargs in runs.items():
        llm = LLM(args.model, **common, **kwargs)
        print(f"{label}: {agreement(reference, scored_logits(llm, ids))}")
        if "kv_cache_dtype" in kwargs:
            for name, state in llm.engine.runner.layer_states.items():
                for scale, measured in zip(state.impl.kv_scales, amax[name]):
                    scale.copy_((measured / 448.0).clamp(min=1e-12))
            print(f"fp8 KV cache, per-head amax / 448: {agreement(reference, scored_logits(llm, ids))}")
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
