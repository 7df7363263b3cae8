"""How to compare bfloat16 logits of random-weight models fairly.

Random weights give nearly Gaussian logits over a large vocabulary, so many positions have a top-1/top-2 gap far
smaller than bf16 rounding: there transformers' own bf16 run already disagrees with its float32 run (about 4% of
positions for Llama-3.2-1B at 4 layers). So top-1 agreement is counted over decided positions, those whose float32
gap exceeds four times the rms bf16 error of the reference, and the raw numbers are printed beside it. Where a
model's own bf16 run strays at decided positions too (a mixture of experts: a rounding can change a token's expert),
ember passes by picking float32's top-1 there at least as often as transformers' bf16 run does."""

import copy
import json

import torch

DECIDED_GAP_FACTOR = 4.0
BF16_ERR_RATIO = 1.25     # ember's bf16 error vs fp32 over transformers' bf16 error vs fp32
TOP1_AGREEMENT = 0.98     # of the decided positions


def bf16_report(got: torch.Tensor, ref_bf16: torch.Tensor, ref_fp32: torch.Tensor) -> dict:
    """Relative errors against float32 and top-1 agreement with the bf16 reference, raw and on decided positions."""
    got, ref_bf16, ref_fp32 = got.float(), ref_bf16.float(), ref_fp32.float()
    rms_noise = (ref_bf16 - ref_fp32).pow(2).mean().sqrt()
    top2 = ref_fp32.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > DECIDED_GAP_FACTOR * rms_noise
    same = got.argmax(-1) == ref_bf16.argmax(-1)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    return {
        "rel_err_vs_fp32": rel(got, ref_fp32), "ref_rel_err_vs_fp32": rel(ref_bf16, ref_fp32),
        "rel_err_vs_bf16_ref": rel(got, ref_bf16),
        "top1_raw": same.float().mean().item(),
        "ref_top1_vs_fp32": (ref_bf16.argmax(-1) == ref_fp32.argmax(-1)).float().mean().item(),
        "top1_decided": same[decided].float().mean().item(), "num_decided": int(decided.sum()),
        "top1_decided_vs_fp32": (got.argmax(-1) == ref_fp32.argmax(-1))[decided].float().mean().item(),
        "ref_top1_decided_vs_fp32": (ref_bf16.argmax(-1) == ref_fp32.argmax(-1))[decided].float().mean().item(),
        "num_positions": got.shape[0],
    }


def check_teacher_forced(llm, hf, prompts, label: str) -> dict:
    """Teacher-forced logits of `prompts` (token-id lists) from the engine `llm` in bfloat16 against `hf` (the same
    weights, float32, on the GPU) and a bfloat16 copy of it: ember's error against float32 within BF16_ERR_RATIO of
    transformers' bfloat16 error; over at least 64 decided positions, top-1 agreement with the bfloat16 reference of
    at least TOP1_AGREEMENT, or float32's top-1 picked at least as often as the bfloat16 reference picks it. Prints
    and returns the report."""
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    got, ref16, ref32 = [], [], []
    for tokens in prompts:
        got.append(llm.engine.score(tokens))
        ids = torch.tensor([tokens], device="cuda")
        with torch.no_grad():
            ref32.append(hf(ids).logits[0].float())
            ref16.append(hf16(ids).logits[0].float())
    del hf16
    r = bf16_report(torch.cat(got), torch.cat(ref16), torch.cat(ref32))
    print(f"{label} bf16: {json.dumps(r)}")
    assert r["rel_err_vs_fp32"] <= BF16_ERR_RATIO * r["ref_rel_err_vs_fp32"]
    assert r["num_decided"] >= 64
    assert r["top1_decided"] >= TOP1_AGREEMENT or r["top1_decided_vs_fp32"] >= r["ref_top1_decided_vs_fp32"], r
    return r
