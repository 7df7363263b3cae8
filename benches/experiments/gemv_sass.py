"""Instructions a weight byte in the one-row GEMVs' K loop, from their SASS for sm_90 (compiled and disassembled with
Triton's bundled ptxas and nvdisasm; no GPU needed): the general kernel (ember.kernels.gemv) on bf16 and on e4m3
weights (after `round_rows`), and the word-wise e4m3 kernel (ember.kernels.gemv_fp8_words) on `round_rows`' output
and rounding the raw row itself (dynamic and static; qkv and gate_up with the RMSNorm folded in), for Llama-3.1-8B's
projections under the launch tables' configs; "outside": the instructions before and after the loop (the row's
scale, the epilogue) over all the bytes a thread reads. A GEMV streaming weights at an H100's copy bandwidth has
about 8 issue slots a byte at one byte a weight (128 a cycle an SM over 3.35 TB/s / 132 SMs / 1.98 GHz = 12.8 bytes
a cycle an SM), 16 at two. --costs: the rounding loops again with the division, then the clamp, taken out.

    PYTHONPATH=. python benches/experiments/gemv_sass.py [--costs]
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import ember.kernels.gemv as G
import ember.kernels.gemv_fp8_words as W

SMS = 132
PROJECTIONS = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (14336, 4096, True),
               "down": (4096, 14336, False)}
NORMED = ("qkv", "gate_up")    # the projections whose input is the RMSNorm's (folded into the rounding)
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


def _instructions(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, instruction) in order and each label's address."""
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
    return instrs, labels


def _opcode(instruction: str) -> str:
    return re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", instruction).group(1)


def split_ops(sass: str) -> tuple[collections.Counter, collections.Counter]:
    """Opcodes of the longest backward branch's body (the K loop), and of the rest of the kernel."""
    instrs, labels = _instructions(sass)
    best = (0, -1)
    for address, ins in instrs:
        branch = re.search(r"BRA\s+`\(\.?(L_x_\d+)\)", ins)
        if branch and labels.get(branch.group(1), address) < address:
            start = labels[branch.group(1)]
            best = (start, address) if address - start > best[1] - best[0] else best
    inside = [i for a, i in instrs if best[0] <= a <= best[1]]
    outside = [i for a, i in instrs if not best[0] <= a <= best[1] and _opcode(i) not in ("NOP", "EXIT", "BRA")]
    return collections.Counter(map(_opcode, inside)), collections.Counter(map(_opcode, outside))


def loop_ops(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body (the K loop)."""
    return split_ops(sass)[0]


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


def words(n: int, k: int, gated: bool, act_quant: int = 0, norm: bool = False,
          outside: bool = False) -> tuple[collections.Counter, float] | tuple[collections.Counter, float, float]:
    """The word-wise kernel on `round_rows`' output (act_quant 0), or rounding the raw row itself: 1 by its amax, 2 by
    a static scale, of x * norm weight with `norm`. `outside`: also the instructions outside the loop (the row's
    scale first, the epilogue) a weight byte of the program's whole K."""
    c = G.gemv_config(1, n, k, SMS, 1, gated=gated)
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "act_scale_ptr": "*fp32",
                 "norm_weight_ptr": "*bf16", "bias_ptr": "*bf16", "residual_ptr": "*bf16", "out_ptr": "*bf16",
                 "N": "i32", "K": "i32", "eps": "fp32"}
    row_block = min(1024, triton.next_power_of_2(k))
    constexprs = dict(BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GATED=gated, HAS_BIAS=False, HAS_RESIDUAL=False,
                      ACT_SCALE=act_quant != 1, ASM=True, ROUND=act_quant, NORM=norm, ROW_BLOCK=row_block,
                      ROW_STEPS=triton.cdiv(k, row_block), EXACT_E4M3=False, PDL=False)
    ops, rest = split_ops(_sass(W._words_kernel.fn, signature, constexprs, [a for a in signature if a != "eps"],
                                c["num_warps"]))
    per_thread = c["BLOCK_N"] * c["BLOCK_K"] * (2 if gated else 1) / (32 * c["num_warps"])
    if not outside:
        return ops, per_thread
    return ops, per_thread, sum(rest.values()) / (per_thread * k / c["BLOCK_K"])


@triton.jit
def _times_reciprocal(x, scale, ROUND: tl.constexpr):
    """x times 1 / scale, saturated: not the rounding's arithmetic (x / scale), to see what the division costs."""
    return tl.minimum(tl.maximum(x.to(tl.float32) * (1.0 / scale), -448.0), 448.0)


@triton.jit
def _unsaturated(x, scale, ROUND: tl.constexpr):
    """x / scale left to the conversion's saturation (the same values but for NaN), to see what the clamp costs."""
    return x.to(tl.float32) / scale


def rounding_costs() -> None:
    """The rounding kernels' loops with the division and then the clamp taken out (not ember's arithmetic: costs)."""
    # the variants differ from the kernel only in a callee, which Triton's cache key does not see: compiled every
    # time, into a cache of their own
    triton.knobs.compilation.always_compile = True
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="ember_gemv_sass_")
    for name, (n, k, gated) in PROJECTIONS.items():
        for label, variant in (("as ember rounds", W.scale_to_e4m3), ("x * (1 / scale)", _times_reciprocal),
                               ("no clamp", _unsaturated)):
            saved, W.scale_to_e4m3 = W.scale_to_e4m3, variant
            try:
                ops, per_thread = words(n, k, gated, 1, name in NORMED)
            finally:
                W.scale_to_e4m3 = saved
            print(f"{name:8s} words dynamic, {label:16s} {sum(ops.values()):4d} instructions a step: "
                  f"{sum(ops.values()) / per_thread:5.2f} a byte", flush=True)


def main() -> None:
    if "--costs" in sys.argv:
        return rounding_costs()
    for name, (n, k, gated) in PROJECTIONS.items():
        norm = name in NORMED
        for label, (ops, per_thread, *rest) in (("bf16 general", general(n, k, gated, False)),
                                                ("e4m3 general", general(n, k, gated, True)),
                                                ("e4m3 words", words(n, k, gated, outside=True)),
                                                ("words dynamic", words(n, k, gated, 1, norm, True)),
                                                ("words static", words(n, k, gated, 2, norm, True))):
            top = ", ".join(f"{op} {count}" for op, count in ops.most_common(8))
            outside = f" (+{rest[0]:4.2f} outside)" if rest else " " * 16
            print(f"{name:8s} {label:13s} {sum(ops.values()):4d} instructions a step for {per_thread:4.0f} bytes a "
                  f"thread: {sum(ops.values()) / per_thread:5.2f} a byte{outside} | {top}", flush=True)


if __name__ == "__main__":
    main()
