"""The small-M linear kernel (ember/kernels/gemv.py) on the CPU, interpreted, against the float32 reference; its
launch heuristic; and the `ember::linear` op under torch.compile (fullgraph, dynamic M) and its on/off switch.

CPU tensors run an interpreted copy of the kernels whatever TRITON_INTERPRET says at import time, so this module
needs no environment set-up. Tolerances, relative to the output scale s = max |reference|: float32 within 1e-5 s
(only the order of the float32 sums differs); bfloat16 within 2**-7 s, one bfloat16 ulp of the largest output: the
products are exact, the sums float32, and the one rounding is the final cast, which the interpreter does by
truncation (a GPU rounds to nearest: half that, see tests/gpu/test_gemv_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

import ember.kernels.gemv as G   # noqa: E402
import ember.kernels.gemv_config as GC   # noqa: E402
import ember.kernels.linear_op as LO   # noqa: E402

SHAPES = [(40, 72), (96, 256)]             # (N, K): neither a multiple of the blocks; 72 leaves a masked K tail
ROWS = [1, 3, 8, 16]
PATHS = ["heuristic", "cuda_cores_per_step", "tensor_cores"]
QWEN3_0_6B = {"qkv": (4096, 1024), "gate_up": (6144, 1024), "o_proj": (1024, 2048), "down": (1024, 3072)}
LLAMA_3_1_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD = {"lm_head": (151936, 1024)}
H100_SMS = 132


def _tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    scale = reference.abs().max().item()
    return {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}[dtype] * scale


def _inputs(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)           # [M, K]
    weight = torch.randn(N, K, generator=g).to(dtype)      # [N, K]
    bias = torch.randn(N, generator=g).to(dtype)           # [N]
    residual = torch.randn(M, N, generator=g).to(dtype)    # [M, N]
    return x, weight, bias, residual


def _config(path: str, M: int, N: int, K: int, element_size: int, split_k: int) -> dict:
    """The heuristic's config or one forced onto a path; split_k > 1 shrinks BLOCK_K so K spans several splits."""
    config = dict(G.gemv_config(M, N, K, G.CPU_SMS, element_size, use_dot=None if path == "heuristic"
                                else path == "tensor_cores"))
    if path == "cuda_cores_per_step":
        config["ACC_3D"] = False
    if split_k > 1:
        block_k = 16 if config["USE_DOT"] else 32
        steps = -(-K // block_k)
        per_split = -(-steps // split_k)
        config.update(BLOCK_K=block_k, K_PER_SPLIT=per_split * block_k, SPLIT_K=-(-steps // per_split))
        assert config["SPLIT_K"] > 1
    return config


@pytest.mark.parametrize("split_k", [1, 3], ids=["no_split", "split3"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("N,K", SHAPES, ids=[f"n{n}_k{k}" for n, k in SHAPES])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(dtype, M, N, K, path, split_k):
    x, weight, bias, _ = _inputs(M, N, K, dtype)
    config = _config(path, M, N, K, x.element_size(), split_k)
    out = G.gemv(x, weight, bias, config=config)
    reference = x.float() @ weight.float().T + bias.float()
    assert out.shape == (M, N) and out.dtype == dtype
    err = (out.float() - reference).abs().max().item()
    assert err <= _tolerance(dtype, reference), f"{config}: max abs error {err:.3g}"


@pytest.mark.parametrize("split_k", [1, 3], ids=["no_split", "split3"])
@pytest.mark.parametrize("path", PATHS)
def test_residual_without_bias(path, split_k):
    M, N, K = 3, 40, 72
    x, weight, _, residual = _inputs(M, N, K, torch.float32, seed=1)
    out = G.gemv(x, weight, residual=residual, config=_config(path, M, N, K, 4, split_k))
    reference = x @ weight.T + residual
    err = (out - reference).abs().max().item()
    assert err <= _tolerance(torch.float32, reference), f"max abs error {err:.3g}"


def test_strided_inputs_and_padding_columns_not_written():
    # x and residual with row strides of a wider buffer; N = 37 leaves 3 padding columns in the last block
    M, N, K = 5, 37, 64
    x_buffer, weight, bias, _ = _inputs(M, N, K + 16, torch.float32, seed=2)
    weight = weight[:, :K].contiguous()
    x = x_buffer[:, 8:8 + K]                                   # [M, K], row stride K + 16
    residual = torch.randn(M, N + 11)[:, :N]                   # [M, N], row stride N + 11
    out = G.gemv(x, weight, bias, residual)
    reference = x @ weight.T + bias + residual
    assert out.shape == (M, N)
    assert (out - reference).abs().max().item() <= _tolerance(torch.float32, reference)


@pytest.mark.parametrize("split_k", [1, 3], ids=["no_split", "split3"])
@pytest.mark.parametrize("M", [1, 3])
def test_float32_out_holds_the_rounded_products(M, split_k):
    """out_dtype float32 (the LM head's logits): the values of the bfloat16 output, stored as float32 by the kernel
    (the K split's reduce writes bfloat16, then a copy)."""
    x, weight, _, _ = _inputs(M, 40, 96, torch.bfloat16, seed=3)
    config = _config("heuristic", M, 40, 96, 2, split_k)
    out = G.gemv(x, weight, config=config, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (M, 40)
    assert torch.equal(out, G.gemv(x, weight, config=config).float())
    with pytest.raises(ValueError, match="torch.float16"):
        G.gemv(x, weight, out_dtype=torch.float16)


def test_logits_op_on_cpu_and_under_fake_tensors():
    """`ember::logits` is `F.linear(x, w).float()` where the GEMV does not apply (CPU), and a float32 [M, V] for
    the compiler."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x, weight, _, _ = _inputs(3, 40, 32, torch.bfloat16)
    out = LO.logits(x.unsqueeze(0), weight)
    assert out.shape == (1, 3, 40) and torch.equal(out[0], F.linear(x, weight).float())
    with FakeTensorMode() as mode:
        fake = torch.ops.ember.logits(mode.from_tensor(x), mode.from_tensor(weight))
    assert fake.shape == (3, 40) and fake.dtype == torch.float32


def test_logits_op_routes_like_linear(monkeypatch):
    """Where the GEMV applies and pays, `ember::logits` asks it for float32; LOGITS_ON_GEMV False or the GEMV
    switched off sends it to cuBLAS and a float32 copy."""
    calls = []

    def spy(x, weight, bias=None, out_dtype=None):
        calls.append(out_dtype)
        return F.linear(x, weight).float()

    monkeypatch.setattr(LO, "gemv_applies", lambda x, weight, bias: True)
    monkeypatch.setattr(LO, "gemv_pays", lambda x, weight, gated=False: True)
    monkeypatch.setattr(LO, "gemv", spy)
    x, weight, _, _ = _inputs(1, 24, 32, torch.bfloat16)
    assert torch.equal(torch.ops.ember.logits(x, weight), F.linear(x, weight).float()) and calls == [torch.float32]
    monkeypatch.setattr(LO, "LOGITS_ON_GEMV", False)
    torch.ops.ember.logits(x, weight)
    assert calls == [torch.float32]


def test_gemv_rejects_bad_inputs_with_the_values():
    x, weight, _, _ = _inputs(17, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="got M=17"):
        G.gemv(x, weight)
    with pytest.raises(ValueError, match="weight torch.float16"):
        G.gemv(x[:4], weight.half())
    with pytest.raises(ValueError, match=r"weight \(8, 16\)"):
        G.gemv(x[:4, :8], weight)


# ---- launch heuristic ------------------------------------------------------------------------------------------

REAL_SHAPES = {**{f"qwen3-0.6b {k}": v for k, v in QWEN3_0_6B.items()},
               **{f"llama-3.1-8b {k}": v for k, v in LLAMA_3_1_8B.items()}, **LM_HEAD}


@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_config_fills_the_gpu_with_whole_16_byte_tiles(name):
    N, K = REAL_SHAPES[name]
    for M in range(1, G.GEMV_MAX_M + 1):
        c = G.gemv_config(M, N, K, H100_SMS)
        assert c["BLOCK_M"] >= M and c["BLOCK_M"] & (c["BLOCK_M"] - 1) == 0
        for block in ("BLOCK_N", "BLOCK_K"):
            assert c[block] & (c[block] - 1) == 0, f"M={M}: {block} {c[block]} is not a power of two"
        assert K % c["BLOCK_K"] == 0, f"M={M}: BLOCK_K {c['BLOCK_K']} leaves a masked K tail of {K}"
        assert c["BLOCK_K"] * 2 >= 512, f"M={M}: a K step of {c['BLOCK_K']} is under one warp of 16-byte loads"
        tile_bytes = GC._launch_shape(M, N, K, H100_SMS, 2, False)[1]   # the constant, or a stored shape's
        assert c["BLOCK_N"] * c["BLOCK_K"] * 2 <= tile_bytes
        assert c["K_PER_SPLIT"] % c["BLOCK_K"] == 0
        assert (c["SPLIT_K"] - 1) * c["K_PER_SPLIT"] < K <= c["SPLIT_K"] * c["K_PER_SPLIT"]   # no empty split
        programs = -(-N // c["BLOCK_N"]) * c["SPLIT_K"]
        assert programs >= (1 if c["USE_DOT"] else 2) * H100_SMS, f"M={M}: {programs} programs on {H100_SMS} SMs"
        assert c["USE_DOT"] == (M >= GC.DOT_MIN_M)
        if c["ACC_3D"]:
            assert c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"] <= GC.ACC_3D_REGS * 32 * c["num_warps"]


def test_config_choices_for_qwen3_0_6b_at_batch_1(monkeypatch):
    # the constants' choices: shapes in the stored launch-shape table are tested with it (test_gemv_routing.py)
    monkeypatch.setattr(GC, "launch_shape", lambda *args: None)
    GC.cached_config.cache_clear()
    chosen = {name: G.gemv_config(1, N, K, H100_SMS) for name, (N, K) in QWEN3_0_6B.items()}
    GC.cached_config.cache_clear()
    picked = {name: (c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["ACC_3D"]) for name, c in chosen.items()}
    # two programs an SM: 4096 columns / 264 programs -> 8 columns a program, 8 KiB of W a K step
    assert picked == {"qkv": (8, 512, 1, True), "gate_up": (16, 256, 1, True), "o_proj": (2, 2048, 1, True),
                      "down": (2, 1024, 1, True)}


def test_config_splits_k_only_when_columns_leave_sms_idle():
    # tensor cores take 16 columns a program: o_proj's 1024 columns make 64 programs, so K is split
    c = G.gemv_config(16, 1024, 2048, H100_SMS)
    assert (c["BLOCK_N"], c["SPLIT_K"]) == (16, 4)     # 64 programs x 4 splits = 2 programs an SM
    assert G.gemv_config(16, 4096, 1024, H100_SMS)["SPLIT_K"] == 1
    assert G.gemv_config(1, 151936, 1024, H100_SMS)["SPLIT_K"] == 1
    # a single K step cannot be split
    assert G.gemv_config(16, 64, 128, H100_SMS)["SPLIT_K"] == 1


def test_config_fp32_keeps_16_byte_loads():
    c = G.gemv_config(1, 4096, 1024, H100_SMS, element_size=4)
    assert c["BLOCK_N"] * c["BLOCK_K"] * 4 == GC.W_TILE_BYTES and c["BLOCK_K"] % 4 == 0


@pytest.mark.parametrize("M", [0, 17, 64])
def test_config_falls_back_outside_1_to_16_rows(M):
    assert G.gemv_config(M, 4096, 1024, H100_SMS) is None


# ---- the ember::linear op --------------------------------------------------------------------------------------

def test_op_on_cpu_is_f_linear():
    x, weight, bias, _ = _inputs(4, 24, 32, torch.float32)
    assert torch.equal(torch.ops.ember.linear(x, weight, bias), F.linear(x, weight, bias))
    assert torch.equal(torch.ops.ember.linear(x, weight, None), F.linear(x, weight))
    assert not LO.gemv_applies(x, weight, bias)       # the kernel is for CUDA tensors


def test_linear_flattens_leading_dimensions():
    x = torch.randn(2, 3, 32)
    weight = torch.randn(24, 32)
    out = LO.linear(x, weight)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out, F.linear(x, weight))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_op_compiles_fullgraph_with_dynamic_rows(backend):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager
            return aot_eager(gm, example_inputs)
        return gm.forward

    def block(x, weight, bias):
        return torch.relu(LO.linear(x, weight, bias)) + 1.0

    compiled = torch.compile(block, backend=recording, fullgraph=True, dynamic=True)   # raises on a graph break
    weight, bias = torch.randn(24, 32), torch.randn(24)
    for M in (2, 5, 16, 40):       # 1 is specialised by dynamo (0/1 specialisation), so start at 2
        x = torch.randn(M, 32)
        assert torch.equal(compiled(x, weight, bias), torch.relu(F.linear(x, weight, bias)) + 1.0)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 4 row counts: M is not dynamic"
    assert not counters["graph_break"]
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(t in (torch.ops.ember.linear, torch.ops.ember.linear.default) for t in targets) == 1, targets


def test_switch_routes_the_op(monkeypatch):
    """set_gemv_enabled(False) sends the op to F.linear even where the kernel applies; True sends it back."""
    calls = []

    def spy(x, weight, bias):
        calls.append(x.shape[0])
        return F.linear(x, weight, bias)

    monkeypatch.setattr(LO, "gemv_applies", lambda x, weight, bias: True)   # as for a CUDA tensor
    monkeypatch.setattr(LO, "gemv_pays", lambda x, weight, gated=False: True)
    monkeypatch.setattr(LO, "gemv", spy)
    x, weight, bias, _ = _inputs(3, 24, 32, torch.float32)

    def run():
        before = len(calls)
        torch.testing.assert_close(torch.ops.ember.linear(x, weight, bias), F.linear(x, weight, bias))
        return len(calls) - before

    assert LO.gemv_enabled() and run() == 1
    try:
        LO.set_gemv_enabled(False)
        assert not LO.gemv_enabled() and run() == 0
    finally:
        LO.set_gemv_enabled(True)
    assert run() == 1


# ---- compiled code (no GPU needed: Triton compiles for sm_90 on the CPU) ------------------------------------------

def _compile_sm90(M, N, K, norm=False, gated=False, pdl=False, w_scale=0, act_quant=0):
    """PTX and shared memory of the kernel for an H100, the way a launch would specialise it for these shapes;
    `w_scale` 1 or 2: an e4m3 weight with row or 128x128 block scales."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    c = G.gemv_config(M, N, K, H100_SMS, 1 if w_scale else 2, gated=gated, max_block_k=128 if w_scale == 2 else None)
    names = ["x_ptr", "w_ptr", "bias_ptr", "residual_ptr", "norm_weight_ptr", "out_ptr", "M", "N", "K",
             "stride_xm", "stride_wn", "stride_rm", "stride_om", "k_per_split", "eps", "w_scale_ptr", "stride_sn", "act_scale_ptr"]
    values = dict(M=M, N=N, K=K, stride_xm=K, stride_wn=K, stride_rm=N, stride_om=N, k_per_split=c["K_PER_SPLIT"],
                  stride_sn=0)
    partial = c["SPLIT_K"] > 1
    signature = {a: ("*fp32" if a == "out_ptr" and partial else "*bf16") if a.endswith("_ptr") else "i32"
                 for a in names}
    signature["eps"] = "fp32"
    if w_scale:
        signature.update(w_ptr="*fp8e4nv", w_scale_ptr="*fp32", act_scale_ptr="*fp32")
    constexprs = dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], USE_DOT=c["USE_DOT"],
                      ACC_3D=c["ACC_3D"], EVEN_K=True, PARTIAL=partial, HAS_BIAS=False, HAS_RESIDUAL=False,
                      NORM=norm, GATED=gated, DOT_IN_FP32=False, IEEE_DOT=False, PDL=pdl, W_SCALE=w_scale,
                      SCALE_BN=128 if w_scale == 2 else 1, SCALE_BK=128 if w_scale == 2 else 1,
                      ACT_QUANT=act_quant, EXACT_E4M3=False)
    signature.update({name: "constexpr" for name in constexprs})
    # Triton marks pointers and integers divisible by 16 at launch; these shapes' strides all are
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if a.endswith("_ptr") or (a in values and values[a] % 16 == 0)}
    kernel = triton.runtime.jit.JITFunction(G._gemv_kernel.fn)   # compiled even where TRITON_INTERPRET=1
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
    return c, compiled.asm["ptx"], compiled.metadata.shared


@pytest.mark.parametrize("M,N,K", [(1, 6144, 1024), (2, 1024, 3072), (8, 4096, 1024)])
def test_sm90_code_streams_w_with_16_byte_loads(M, N, K):
    import re
    config, ptx, shared = _compile_sm90(M, N, K)
    loads = re.findall(r"(?:ld\.global|cp\.async\.c[ag]\.shared\.global)[^\n;]*", ptx)
    assert loads, "no global loads found"
    if config["USE_DOT"]:
        # every global read is a 16-byte cp.async into the pipelined shared-memory ring
        assert all(".shared.global" in line and ", 0x10," in line for line in loads), loads
    else:
        assert all(".v4." in line for line in loads), f"loads narrower than 16 bytes: {loads}"
        # W (8 KiB a step) never goes through shared memory: only the final cross-warp sums do
        assert shared <= 256, f"{shared} bytes of shared memory"


@pytest.mark.parametrize("M,N,K,w_scale", [(1, 6144, 1024, 1), (8, 4096, 1024, 1), (1, 6144, 1024, 2),
                                             (2, 1024, 3072, 2)], ids=["m1-rows", "m8-rows", "m1-blocks", "m2-blocks"])
def test_sm90_code_streams_fp8_w_with_16_byte_loads(M, N, K, w_scale):
    """e4m3 weights stream as the bf16 ones do (16 bytes a load: 16 weights); the only narrower loads are the
    float32 scales (a few per program, or one per K step with block scales)."""
    import re
    config, ptx, shared = _compile_sm90(M, N, K, w_scale=w_scale)
    loads = re.findall(r"(?:ld\.global|cp\.async\.c[ag]\.shared\.global)[^\n;]*", ptx)
    wide = [line for line in loads if ".v4." in line or ", 0x10," in line]
    narrow = [line for line in loads if line not in wide]
    assert len(wide) >= config["BLOCK_N"] * config["BLOCK_K"] // (16 * 128), loads
    assert len(narrow) <= 4 and all(re.match(r"ld\.global(\.v2)?\.b32", line) for line in narrow), narrow
    if not config["USE_DOT"]:
        assert shared <= 4096, f"{shared} bytes of shared memory"


@pytest.mark.parametrize("pdl", [False, True])
def test_sm90_code_waits_for_the_previous_kernel_only_when_launched_dependent(pdl):
    """With PDL the kernel waits on the previous grid and releases the next (griddepcontrol), so it may be launched
    early; without it there is neither. The first W tile is loaded before the wait (weights never come from the
    previous kernel), x only after it."""
    _, ptx, _ = _compile_sm90(1, 4096, 1024, pdl=pdl)
    assert ("griddepcontrol.wait" in ptx) is pdl
    assert ("griddepcontrol.launch_dependents" in ptx) is pdl
    if pdl:
        wait = ptx.index("griddepcontrol.wait")
        assert "ld.global" in ptx[:wait], "no W load is issued before the wait"
        assert "ld.global" in ptx[wait:], "x must be loaded after the wait"


@pytest.mark.parametrize("M,N,K,gated", [(1, 4096, 1024, False), (1, 3072, 1024, True), (2, 3072, 1024, True),
                                         (8, 4096, 1024, False), (8, 3072, 1024, True)])
def test_sm90_code_with_norm_prologue_keeps_16_byte_loads(M, N, K, gated):
    """Qwen3-0.6B's qkv and gate_up with the RMSNorm prologue (and SiLU·mul): x's sum of squares and every W tile
    still load 16 bytes a thread; on tensor cores only the norm weight's small tile may go narrower, once a stage."""
    import re
    config, ptx, shared = _compile_sm90(M, N, K, norm=True, gated=gated)
    plain = re.findall(r"ld\.global[^\n;]*", ptx)
    narrow = [line for line in plain if ".v4." not in line]
    if config["USE_DOT"]:
        copies = re.findall(r"cp\.async\.c[ag]\.shared\.global[^\n;]*", ptx)
        narrow += [line for line in copies if ", 0x10," not in line]
        assert copies and len(narrow) <= config["num_stages"], narrow
    else:
        assert not narrow, f"loads narrower than 16 bytes: {narrow}"
        assert shared <= 256, f"{shared} bytes of shared memory"


@pytest.mark.parametrize("M,N,K,act_quant,norm", [(1, 6144, 1024, 1, True), (8, 4096, 1024, 1, True),
                                                  (2, 1024, 3072, 2, True), (1, 1024, 2048, 1, False)],
                         ids=["m1-dynamic-norm", "m8-dynamic-norm", "m2-static-norm-split", "m1-dynamic"])
def test_sm90_fp8_gemv_rounds_x_to_e4m3_with_the_hardware(M, N, K, act_quant, norm):
    """Quantizing x (row scales): compiles for an H100, converts with cvt.rn.satfinite (round to nearest even,
    saturating, as torch's and the many-row path's conversion) and still streams W in 16-byte loads."""
    import re
    config, ptx, shared = _compile_sm90(M, N, K, norm=norm, w_scale=1, act_quant=act_quant)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    loads = re.findall(r"(?:ld\.global|cp\.async\.c[ag]\.shared\.global)[^\n;]*", ptx)
    wide = [line for line in loads if ".v4." in line or ", 0x10," in line]
    assert len(wide) >= config["BLOCK_N"] * config["BLOCK_K"] // (16 * 128), loads
