"""How to compare bfloat16 logits of random-weight models fairly.

Random weights give nearly Gaussian logits over a large vocabulary, so many positions have a top-1/top-2 gap far
smaller than bf16 rounding: there transformers' own bf16 run already disagrees with its float32 run (about 4% of
positions for Llama-3.2-1B at 4 layers). So top-1 agreement is counted over decided positions, those whose float32
gap exceeds four times the rms bf16 error of the reference, and the raw numbers are printed beside it."""

import torch

DECIDED_GAP_FACTOR = 4.0


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
        "num_positions": got.shape[0],
    }
