"""Where fp8 loses accuracy on the default model: teacher-forced top-1 agreement and mean KL over the English text
of tests/helpers/english_text.py, one quantization choice at a time, in transformers on the CPU.

The reference is the model with its weights rounded to bfloat16 (the checkpoint a bf16 run reads), computed in
float32, and every variant is computed in float32 too: what differs is the quantization alone, not bfloat16's own
arithmetic (which by itself moves 2.2% of the argmaxes of this model, and would hide a layer's share).

    PYTHONPATH=. python benches/experiments/fp8_sensitivity.py VARIANT ...

Variants:
    w:STRATEGY:LAYERS:ACTS   weights of LAYERS ("all" or q_proj,k_proj,...) per channel / tensor / block in e4m3;
                             ACTS w8 weight-only, a8 with inputs rounded per token (ember.kernels.fp8)
    kv:WHICH:SCALE           the attention's keys and/or values (WHICH kv, k or v) rounded to e4m3 after RoPE, with
                             SCALE "one" (1.0) or a headroom h: per KV head amax * h / 448, measured on the same text
    amax                     each layer's per-head key and value amax"""

from __future__ import annotations

import sys

import torch

from ember.kernels.fp8 import FP8, dequantize, quantize_blocks, quantize_rows, quantize_tensor, round_activations
from ember.models.default_model import default_model_dir
from tests.helpers.english_text import TEXT
from tests.helpers.teacher_forced import agreement

WEIGHTS = {"channel": (quantize_rows, None), "tensor": (quantize_tensor, None), "block": (quantize_blocks, (128, 128))}


def main(variants: list[str]) -> None:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    path = default_model_dir()
    ids = torch.tensor([AutoTokenizer.from_pretrained(path).encode(TEXT)])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {"kv": None, "amax": {}, "scales": {}, "acts": set()}

    def attention(module, query, key, value, attention_mask, **kwargs):
        i, mode = module.layer_idx, state["kv"]
        if mode == "record":
            amax = [t[0].abs().amax(dim=(1, 2)) for t in (key, value)]          # [Hkv] each
            old = state["amax"].get(i)
            state["amax"][i] = amax if old is None else [torch.maximum(a, b) for a, b in zip(old, amax)]
        elif mode is not None:
            k_scale, v_scale = (s[None, :, None, None] for s in state["scales"][i])
            if "k" in mode:
                key = (key / k_scale).clamp(-448, 448).to(FP8).float() * k_scale
            if "v" in mode:
                value = (value / v_scale).clamp(-448, 448).to(FP8).float() * v_scale
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fp8_study", attention)
    model.set_attn_implementation("fp8_study")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    for name, module in linears.items():
        module.register_forward_pre_hook(
            lambda m, args, name=name: (round_activations(args[0]),) if name in state["acts"] else None)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits[0].float()

    state["kv"] = "record"
    reference = run()
    state["kv"] = None
    print(f"{ids.shape[1]} tokens; reference: bf16 weights, float32 compute", flush=True)
    for variant in variants:
        kind, *spec = variant.split(":")
        if kind == "w":
            strategy, layers, acts = spec
            quantize, block = WEIGHTS[strategy]
            chosen = {n for n in linears if layers == "all" or n.split(".")[-1] in layers.split(",")}
            with torch.no_grad():
                for name in chosen:
                    q, scale = quantize(original[name + ".weight"], *(block,) if block else ())
                    linears[name].weight.copy_(dequantize(q, scale, torch.float32, block))
            state["acts"] = chosen if acts == "a8" else set()
            print(f"{variant}: {agreement(reference, run())}", flush=True)
            with torch.no_grad():
                for name in chosen:
                    linears[name].weight.copy_(original[name + ".weight"])
            state["acts"] = set()
        elif kind == "kv":
            which, scale = spec
            for i, (k_amax, v_amax) in state["amax"].items():
                state["scales"][i] = ((torch.ones_like(k_amax), torch.ones_like(v_amax)) if scale == "one" else
                                      (k_amax * float(scale) / 448, v_amax * float(scale) / 448))
            state["kv"] = which
            print(f"{variant}: {agreement(reference, run())}", flush=True)
            state["kv"] = None
        elif kind == "amax":
            for i, (k_amax, v_amax) in sorted(state["amax"].items()):
                print(f"layer {i}: key amax {[round(a, 2) for a in k_amax.tolist()]}, "
                      f"value amax {[round(a, 2) for a in v_amax.tolist()]}")


if __name__ == "__main__":
    main(sys.argv[1:])
