"""Instructions a cache byte in decode attention's KV loop, from its SASS for sm_90 (compiled and disassembled with
Triton's bundled ptxas and nvdisasm; no GPU needed): the unified decode kernel the default `per_phase` backend's
uniform-decode steps launch (`triton_unified.kernels.unified_attention_kernel`, its loop `attention_core.attend_tiles`)
at GQA 32/8, head 128, 64-token pages, with the plan's 2D decode tile (`plan.decode_tile(4, 128, split=False)`: 16
rows, 128-key tiles, 4 warps, 2 stages) and its split-KV tile (32 keys; the same loop), over a bf16 cache and over an
e4m3 cache with float16 products (F16_DOT), widened by Triton's own conversion or read as int32 words
(`E4M3_WORDS`, `ember.kernels.e4m3.e4m3_words_to_f16`). Prints the loop's instructions by kind, registers, shared
memory and the programs an SM holds.

Budget: an SM issues 4 warp instructions a cycle, 128 thread slots; a cache read at copy bandwidth brings
3.35 TB/s / 132 SMs / 1.98 GHz = 12.8 bytes a cycle an SM on an H100 (about 18 on an H200), so a thread has about
10 (H100) or 7 (H200) issue slots a byte, all work included, before instructions bound the loop rather than bytes.

    PYTHONPATH=. python benches/experiments/fp8_decode_sass.py [--variants bf16 fp8 "fp8 words"] [--ops]

(another Triton: its wheel unpacked into a folder put first on PYTHONPATH.)
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 64

# a loop instruction's kind, by the first pattern its text matches
KINDS = (
    ("mma", r"^HMMA"),
    ("widen e4m3", r"^F2FP\.F16\.E4M3|^PRMT|^IMAD R\w+, R\w+, 0x100, R"),   # converts; packs bytes in pairs
    ("operand moves", r"^(IMAD\.MOV|MOV)\b"),
    ("shared memory", r"^(LDS|LDSM|STS|STSM)\b"),
    ("global loads", r"^(LDG|LDGSTS|LDGDEPBAR|DEPBAR)\b"),
    ("barriers", r"^BAR\b"),
    ("softmax", r"^(MUFU|FMNMX|FADD|FMUL|FFMA|FSEL|FSETP|SHFL|F2FP)\b"),
    ("address, masks, loop", r""),
)


def kind(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    return next(name for name, pattern in KINDS if re.search(pattern, ins))


def compile_decode(cache: str, words: bool, tile) -> tuple[str, int, int]:
    """(SASS, registers a thread, shared memory bytes a program) of the decode kernel as
    `unified_attention_2d(..., mode=MODE_DECODES)` launches it for bf16 queries over a `cache` ("bf16" or "fp8e4nv")
    cache (kv_scales for fp8; no window, soft cap, sinks), reading an e4m3 cache as `words` or byte-wise."""
    from ember.attention_backends.triton_unified.kernels.unified_attention import unified_attention_kernel
    types = dict(out_ptr="*bf16", part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32",
                 counter_ptr="*i32", q_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}",
                 block_table_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32", num_decodes_ptr="*i32",
                 sinks_ptr="*fp32", alibi_ptr="*fp32", key_ptr="*bf16", value_ptr="*bf16",
                 slot_mapping_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", q_norm_ptr="*bf16",
                 k_norm_ptr="*bf16", k_scale_ptr="*fp32", v_scale_ptr="*fp32", qk_scale="fp32", softcap="fp32",
                 norm_eps="fp32")
    names = [p.name for p in unified_attention_kernel.params if not p.is_constexpr]
    signature = {n: types.get(n, "i32") for n in names}
    fp8 = cache != "bf16"
    constexprs = dict(NUM_QUERIES_PER_KV=NUM_HEADS // NUM_KV_HEADS, HEAD_SIZE=HEAD_SIZE, HEAD_PAD=HEAD_SIZE,
                      BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=tile.block_m, BLOCK_Q=1, TILE_N=tile.tile_n, NUM_SEGMENTS=1,
                      MODE=1, LIMIT_DECODES=False, USE_WINDOW=False, USE_SOFTCAP=False, USE_SINKS=False,
                      USE_ALIBI=False, IEEE=False, UNMASKED_MIDDLE=tile.unmasked_middle, FUSED_COMBINE=False,
                      NEW_KV=False, PDL=True, ROPE=False, QK_NORM=False, FP8_KV=1 if fp8 else 0, F16_DOT=fp8,
                      E4M3_WORDS=int(words))
    signature.update({n: "constexpr" for n in constexprs})
    # what the launch's specialization sees: 16-aligned pointers, strides multiples of 16 (head 128, 64-token pages)
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n.startswith("stride_")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    compiled = triton.compile(ASTSource(fn=unified_attention_kernel, signature=signature, constexprs=constexprs,
                                        attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1)), compiled.metadata.shared


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the KV loop)."""
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
    return best


def count(label: str, tile, show_ops: bool = False) -> dict:
    """Compile one variant ("bf16", "fp8" or "fp8 words") for `tile` and print its loop's instructions a cache byte
    of a thread, by kind; returns the counts by kind."""
    cache = "bf16" if label == "bf16" else "fp8e4nv"
    sass, regs, shared = compile_decode(cache, label.endswith("words"), tile)
    body = loop_body(sass)
    threads = 32 * tile.num_warps
    # programs an SM holds: 64K registers (a warp's taken in steps of 256), 227 KiB of shared memory (1 KiB more a
    # program reserved), 64 warps
    programs = min(65536 // (tile.num_warps * -(-regs * 32 // 256) * 256), 232448 // (shared + 1024),
                   64 // tile.num_warps)
    per_thread = tile.tile_n * HEAD_SIZE * 2 * (2 if cache == "bf16" else 1) / threads   # K and V
    kinds = collections.Counter(kind(i) for i in body)
    print(f"  {label:9s} {len(body):5d} a tile / {per_thread:3.0f} bytes = {len(body) / per_thread:4.2f} a byte | "
          + ", ".join(f"{k} {n / per_thread:.2f}" for k, n in kinds.most_common()), flush=True)
    print(f"            {regs} registers, {shared / 1024:.0f} KiB shared: {programs} programs an SM", flush=True)
    if show_ops:
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split(" ")[0] for i in body)
        print("            " + ", ".join(f"{op} {n}" for op, n in ops.most_common(24)))
    return kinds


def main() -> None:
    from ember.attention_backends.triton_unified.plan import decode_tile
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8", "fp8 words"])
    p.add_argument("--ops", action="store_true", help="also each variant's commonest opcodes")
    args = p.parse_args()
    group = NUM_HEADS // NUM_KV_HEADS
    print(f"triton {triton.__version__}, sm_90, GQA {NUM_HEADS}/{NUM_KV_HEADS}, head {HEAD_SIZE}, "
          f"{BLOCK_SIZE}-token pages; instructions of the KV loop a tile (one thread), a cache byte of the thread")
    for name, tile in (("2D decode tile", decode_tile(group, HEAD_SIZE, split=False)),
                       ("3D split-KV tile", decode_tile(group, HEAD_SIZE, split=True))):
        print(f"{name}: {tile}")
        for label in args.variants:
            count(label, tile, args.ops)


if __name__ == "__main__":
    main()
