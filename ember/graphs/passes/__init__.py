"""Fusion passes: rewrite matched subgraphs of the traced model into ember's fused ops, so the model files stay
plain PyTorch. They run inside Inductor, on each piece's post-grad (aten) graph, installed by ember.graphs.compile.

    sibling_linears     linear(x, W[a:b]), linear(x, W[b:c]) -> linear(x, W[a:c]) and a split (packed siblings)
    rms_norm_prologue   linear(rms_norm(x))             -> fused_linear(x, norm_weight=w, eps=eps)
    silu_mul_epilogue   silu(gate) * up of one linear   -> fused_linear(..., gated=True)
    residual_epilogue   linear(x) + residual            -> fused_linear(..., residual=residual)
    qk_norm_rope        q/k per-head RMSNorm + rotary   -> qk_norm_rope(q, k, ...) (q and k concatenated, Qwen3)

The matchers see through views that only add or drop leading size-1 dims ([1, T, N] around a [T, N] linear, as
transformers code runs the fallback's models). Each can be turned off by name (`CompileConfig.disabled_fusions`,
`--disable-fusion NAME|all`); the start-up log counts each pass's matches. `ember::fused_linear`
(ember.kernels.fused_linear) and `ember::qk_norm_rope` (ember.kernels.qk_norm_rope) have a torch reference and a
fake implementation; the first runs as one GEMV launch for decode-sized batches on CUDA.

Nothing is imported here: the pipeline (ember.graphs.passes.pipeline) pulls in Inductor.
"""
