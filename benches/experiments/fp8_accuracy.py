"""FP8 accuracy on real English, as ember runs it: teacher-forced top-1 agreement and mean KL of online fp8 weights
and of an fp8 KV cache against the same model and the same pass in bfloat16, and which KV-cache scale is more
accurate: 1.0, or one per KV head measured from the reference pass's keys and values (amax / 448 times a headroom,
an optimistic calibration: the same text).

    PYTHONPATH=. python benches/experiments/fp8_accuracy.py [--model PATH] [--device cpu|cuda] [--dtype bfloat16]

The text is tests/helpers/english_text.py (about 2,100 tokens); the default model is SmolLM2-135M-Instruct. On the
CPU the scaled layers round activations to e4m3 as the GPU's do (ember.kernels.fp8.round_activations)."""

from __future__ import annotations

import argparse
import gc

import torch

from ember import LLM
from tests.helpers.english_text import TEXT
from tests.helpers.teacher_forced import agreement, scored_logits


def kv_amax(llm, token_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the largest |key| and |value| of each KV head [Hkv] over one teacher-forced pass."""
    seen: dict[str, list[torch.Tensor]] = {}
    for name, state in llm.engine.runner.layer_states.items():
        impl, forward = state.impl, state.impl.forward

        def recording(query, key, value, *rest, _name=name, _forward=forward):
            amax = [t.abs().amax(dim=(0, 2)).float() for t in (key, value)]      # [Hkv] each
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
    p.add_argument("--dtype", default="bfloat16", help="the reference's dtype and the fp8 runs' compute dtype")
    p.add_argument("--headroom", type=float, nargs="*", default=[1.0, 2.0],
                   help="per-head KV scales amax * headroom / 448 to try")
    args = p.parse_args()
    common = dict(device=args.device, dtype=args.dtype, enforce_eager=True)
    base = LLM(args.model, **common)
    ids = base.tokenizer.encode(TEXT)
    reference = scored_logits(base, ids)
    amax = kv_amax(base, ids)
    print(f"{len(ids)} tokens; reference: the same pass in {base.engine.runner.dtype} on {args.device}", flush=True)
    del base
    gc.collect()
    runs = {"fp8 weights (online, per channel; per-token activations)": dict(quantization="fp8"),
            "fp8 KV cache, scale 1.0": dict(kv_cache_dtype="fp8")}
    for label, kwargs in runs.items():
        llm = LLM(args.model, **common, **kwargs)
        print(f"{label}: {agreement(reference, scored_logits(llm, ids))}", flush=True)
        if "kv_cache_dtype" in kwargs:
            for headroom in args.headroom:
                for name, state in llm.engine.runner.layer_states.items():
                    for scale, measured in zip(state.impl.kv_scales, amax[name]):
                        scale.copy_((measured * headroom / 448.0).clamp(min=1e-12))
                print(f"fp8 KV cache, per-head amax x {headroom:g} / 448: "
                      f"{agreement(reference, scored_logits(llm, ids))}", flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
