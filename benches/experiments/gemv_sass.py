"""Instructions a weight byte in the one-row GEMVs' K loop, from their SASS for sm_90 (compiled and disassembled with
Triton's bundled ptxas and nvdisasm; no GPU needed): the general kernel (ember.kernels.gemv) on bf16 and on e4m3
weights (after `round_rows`), and the word-wise e4m3 kernel (ember.kernels.gemv_fp8_words), for Llama-3.1-8B's
projections. A GEMV streaming weights at an H100's copy bandwidth has about 8 issue slots a byte at one byte a
weight (128 a cycle an SM over 3.35 TB/s / 132 SMs / 1.98 GHz = 12.8 bytes a cycle an SM), 16 at two.

    PYTHONPATH=. python benches/experiments/gemv_sass.py
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import ember.kernels.gemv as G
import ember.kernels.gemv_fp8_words as W

SMS = 132
PROJECTIONS = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (14336, 4096, True),
               "down": (4096, 14336, False)}
NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def _sass(fn, signature: dict, constexprs: dict, divisible: list[str], num_warps: int) -> str:
    names = list(signature)
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a in divisible}
    compiled = triton.compile(ASTSource(fn=triton.runtime.jit.JITFunction(fn), signature=signature,
                                        constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))
    cubin = Path("/tmp/ember_gemv_sass.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    return subprocess.run([str(NVDISASM), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def loop_ops(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body (the K loop)."""
    labels, instrs, pending = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"\.(L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if ins:
            address = int(ins.group(1), 16)
            labels.update({p: address for p in pending})
            pending = []
            instrs.append((address, ins.group(2)))
    best = []
    for address, ins in instrs:
        branch = re.search(r"BRA\s+`\(\.?(L_x_\d+)\)", ins)
        if branch and labels.get(branch.group(1), address) < address:
            body = [i for a, i in instrs if labels[branch.group(1)] <= a <= address]
            best = body if len(body) > len(best) else best
    return collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", i).group(1) for i in best)


def general(n: int, k: int, gated: bool, fp8: bool) -> tuple[collections.Counter, float]:
    c = G.gemv_config(1, n, k, SMS, 1 if fp8 else 2, gated=gated)
    names = ["x_ptr", "w_ptr", "bias_ptr", "residual_ptr", "norm_weight_ptr", "out_ptr", "M", "N", "K", "stride_xm",
             "stride_wn", "stride_rm", "stride_om", "k_per_split", "eps", "w_scale_ptr", "stride_sn", "act_scale_ptr"]
    signature = {a: "*bf16" if a.endswith("_ptr") else "i32" for a in names}
    signature.update(eps="fp32", **({"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "act_scale_ptr": "*fp32"}
                                    if fp8 else {}))
    constexprs = dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], USE_DOT=False,
                      ACC_3D=c["ACC_3D"], EVEN_K=True, PARTIAL=c["SPLIT_K"] > 1, HAS_BIAS=False,
                      HAS_RESIDUAL=False, NORM=False, GATED=gated, DOT_IN_FP32=False, IEEE_DOT=False, PDL=False,
                      W_SCALE=1 if fp8 else 0, SCALE_BN=1, SCALE_BK=1, ACT_QUANT=3 if fp8 else 0, EXACT_E4M3=False)
    divisible = [a for a in names if a.endswith("_ptr")] + ["N", "K", "stride_xm", "stride_wn", "stride_om",
                                                            "k_per_split"]
    ops = loop_ops(_sass(G._gemv_kernel.fn, signature, constexprs, divisible, c["num_warps"]))
    return ops, c["BLOCK_N"] * c["BLOCK_K"] * (2 if gated else 1) * (1 if fp8 else 2) / (32 * c["num_warps"])


def words(n: int, k: int, gated: bool) -> tuple[collections.Counter, float]:
    c = G.gemv_config(1, n, k, SMS, 1, gated=gated)
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "act_scale_ptr": "*fp32",
                 "bias_ptr": "*bf16", "residual_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32"}
    constexprs = dict(BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GATED=gated, HAS_BIAS=False, HAS_RESIDUAL=False,
                      ACT_SCALE=True, ASM=True, PDL=False)
    ops = loop_ops(_sass(W._words_kernel.fn, signature, constexprs, [a for a in signature if a != "K"] + ["K"],
                         c["num_warps"]))
    return ops, c["BLOCK_N"] * c["BLOCK_K"] * (2 if gated else 1) / (32 * c["num_warps"])


def main() -> None:
    for name, (n, k, gated) in PROJECTIONS.items():
        for label, (ops, per_thread) in (("bf16 general", general(n, k, gated, False)),
                                         ("e4m3 general", general(n, k, gated, True)),
                                         ("e4m3 words", words(n, k, gated))):
            top = ", ".join(f"{op} {count}" for op, count in ops.most_common(8))
            print(f"{name:8s} {label:13s} {sum(ops.values()):4d} instructions a step for {per_thread:4.0f} bytes a "
                  f"thread: {sum(ops.values()) / per_thread:5.2f} a byte | {top}", flush=True)


if __name__ == "__main__":
    main()
