"""Triton kernels compiled for an H100 on the CPU (no GPU needed), to check the code the interpreter does not."""

from __future__ import annotations

import inspect

FLOATS = ("qk_scale", "softcap", "norm_eps", "softcap_log2")


def compile_for_sm90(fn, dtypes: dict, constexprs: dict, floats=FLOATS, num_warps: int = 4, num_stages: int = 3):
    """The compiled kernel of the Python function `fn` behind a @triton.jit: pointers typed by `dtypes` (else
    bf16), the `floats` fp32, other arguments i32; `constexprs` plus every constexpr parameter's default for the
    ones it leaves out, so a flag added with a default keeps these checks compiling the code they meant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    constexprs = dict(constexprs)
    for name, param in inspect.signature(fn).parameters.items():
        if name not in constexprs and param.default is not inspect.Parameter.empty and "constexpr" in str(
                param.annotation):
            constexprs[name] = param.default
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    signature = {name: "constexpr" if name in constexprs else dtypes.get(name, "*bf16")
                 if name.endswith("_ptr") or name.endswith("_desc") else "fp32" if name in floats else "i32"
                 for name in names}
    kernel = triton.runtime.jit.JITFunction(fn)       # compiled even where TRITON_INTERPRET=1
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
