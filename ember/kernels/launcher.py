"""Launching ember's own Triton kernels through one C launcher of ember's, instead of Triton's per-signature ones.

Triton 3.6 generates a C launcher for each kernel signature and builds it with the system's C compiler the first time
a kernel runs: on an H100 host a cold start of the Qwen3-0.6B config built 12 of them for ember's kernels, 0.22-0.57
s each, 4.2 s in all (`benches/experiments/startup_phases.py`). ember's launcher (`csrc/launch.c`) takes the argument
types as a string with each call, so it is built once per machine (cached by Triton's build cache, like Triton's own
modules) and serves every kernel.

`launcher(fn)` returns a `KernelLauncher`: `launcher[grid](*args, **kwargs)` as `fn[grid](...)`. A launch computes a
key from its arguments that is at least as fine as Triton's specialization: for a tensor its dtype, whether its
address is 16-byte aligned and whether it lives on a GPU; for an int whether it is 1, whether it is a multiple of 16
and the integer width it needs (Triton's rules, whether or not the parameter is `do_not_specialize`); for a
constexpr parameter its value; for anything else its type and value; and the current device and every keyword
argument (constexprs and launch options) with its value. A new key compiles through `JITFunction.run(warmup=True)`
(which compiles or finds the kernel, counts compiles for `jit_counter` and answers the compile-only hook of
`precompile`, but launches nothing and builds no Triton launcher), loads the binary with Triton's own loader, and
keeps the function handle with the kernel's parameter types; every launch then goes through ember's launcher, a
programmatic dependent where the kernel was compiled for one (`launch_pdl`). Triton's per-launch check that the
globals a kernel read have not changed since it compiled is not repeated (ember's kernels read module constants).
Where Triton's compile-only hook answered a key instead (a dry launch of `precompile.compile_only`) and the hook says
it answers the same for a key (`answers_per_key`), later launches of that key return at once while that hook is set,
instead of going through Triton's binder and serializing the specialization for the hook again.

Triton's own launch path is taken instead while Triton has a launch hook, pre-run hooks, a stage-inspection hook,
debug mode or instrumentation set; for interpreted kernels (CPU tensors); for a callable grid, a keyword argument
that is not a constexpr or a launch option, or an argument that cannot be hashed; for a kernel with a parameter type
the launcher does not pack (a scalar other than i32/u32/i64/u64/fp32, a tensor descriptor) or scratch memory; for a
tensor that is not on a GPU (Triton's launcher names it in its error); after
`MAX_KEYS` keys of one kernel; where ember's launcher cannot be built; and everywhere where the `fast_launch` hook is
off (`EMBER_HOOKS=fast_launch=off`, or a Triton version it was not checked with: ember.kernels.hooks), when
`launcher(fn)` hands back `fn` itself."""

from __future__ import annotations

import functools
import logging
import operator
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ember.kernels.hooks import enabled

__all__ = ["KernelLauncher", "MAX_KEYS", "fast_launch_count", "launcher"]

logger = logging.getLogger(__name__)

MAX_KEYS = 512          # per kernel: past this, launches go through JITFunction.run (a key that varies per call)

_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg", "enable_fp_fusion",
                             "launch_cooperative_grid"})
_TYPE_CODES = {"i32": "i", "u32": "I", "i64": "l", "u64": "K", "fp32": "f", "f32": "f"}   # and "*...": "p"
_INT32 = 1 << 31
_INT64 = 1 << 63
_UINT64 = 1 << 64
_TRITON = "triton"      # a kept entry that says: this key launches through Triton's own path


@functools.cache
def _triton_runtime():
    """(knobs.runtime, knobs.compilation, driver.active) of the installed Triton."""
    from triton import knobs
    from triton.runtime.driver import driver
    return knobs.runtime, knobs.compilation, driver.active


@functools.cache
def _launch_module():
    """ember's C launcher, built (once per machine: Triton's build cache keeps it) and imported; None where it cannot
    be (no C compiler, a Triton without its build helpers, no CUDA driver)."""
    try:
        import triton.backends.nvidia.driver as nvidia
        from triton.runtime.build import compile_module_from_src
        source = (Path(__file__).parent / "csrc" / "launch.c").read_text()
        return compile_module_from_src(src=source, name="ember_launch", library_dirs=nvidia.library_dirs(),
                                       include_dirs=nvidia.include_dirs, libraries=nvidia.libraries)
    except Exception as e:        # noqa: BLE001 - any failure leaves Triton's own launchers in place
        logger.warning("ember's kernel launcher could not be built (%s: %s); Triton's launchers are used",
                       type(e).__name__, e)
        return None


def _hook_set(hook) -> bool:
    """A launch hook that would do something: a callable, or a HookChain (Triton 3.5 on) with calls in it."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set(runtime, compilation) -> bool:
    return bool(_hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook) or runtime.debug
                or getattr(runtime, "add_stages_inspection_hook", None) is not None
                or getattr(compilation, "instrumentation_mode", ""))


def _parameter_types(kernel, names: tuple[str, ...]) -> tuple[str, tuple[int, ...]] | None:
    """(type codes, parameter indices) of the compiled kernel's runtime parameters, in order, plus its scratch
    pointers; None where ember's launcher cannot pass them."""
    signature = kernel.src.signature
    codes, picks = [], []
    for i, name in enumerate(names):
        if name not in signature:
            return None
        ty = signature[name]
        if ty == "constexpr":
            continue
        code = "p" if isinstance(ty, str) and ty.startswith("*") else _TYPE_CODES.get(ty)
        if code is None:
            return None
        codes.append(code)
        picks.append(i)
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(kernel.metadata, scratch):
            if getattr(kernel.metadata, scratch):
                return None
            codes.append("p")        # passed as a null pointer
    return "".join(codes), tuple(picks)


class _Kept(NamedTuple):
    """What a key launches with."""
    function: int              # the loaded kernel's CUfunction
    codes: str                 # the runtime parameters' type codes, scratch pointers included
    pick: Callable             # the runtime parameters' values out of (positional values + tail)
    tail: tuple                # the bound values of the parameters after the positional ones
    extra: tuple               # the null scratch pointers
    num_warps: int
    shared: int
    pdl: bool
    kernel: object             # Triton's CompiledKernel, returned as `fn[grid](...)` returns it
    module: object             # ember's launcher module


def _host_tensor_among(args) -> bool:
    return any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args)


def _one(i: int, values: tuple) -> tuple:
    return (values[i],)


def _none(values: tuple) -> tuple:
    return ()


def _nothing() -> None:
    return None


class KernelLauncher:
    """`launcher[grid](*args, **kwargs)` as `fn[grid](...)`, through ember's launcher (module doc)."""

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        self._names = tuple(p.name for p in params)
        self._constexpr_positions = frozenset(i for i, p in enumerate(params) if p.is_constexpr)
        self._constexpr_names = frozenset(p.name for p in params if p.is_constexpr)
        self._defaults = {p.name: p.default for p in params if p.has_default}
        self._kept: dict[tuple, _Kept | str] = {}
        self._answered: tuple[Callable, set] = (_nothing, set())    # (compile-only hook, weakly; keys it took)
        self.fast_launches = 0          # launches through ember's launcher (for tests and benchmarks)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _slow(self, grid, args, kwargs):
        return self.fn.run(*args, grid=grid, warmup=False, **kwargs)

    def _key(self, device: int, args, kwargs) -> tuple[tuple, tuple] | None:
        """(key, launch values: the arguments with tensors as addresses), or None where the key cannot be made."""
        key = [device]
        values = []
        constexprs = self._constexpr_positions
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                ptr = a.data_ptr()
                key.append((a.dtype, (ptr & 15) == 0, a.is_cuda))
                values.append(ptr)
            elif i in constexprs:
                key.append(a)
                values.append(a)
            elif type(a) is int:
                key.append((a == 1, (a & 15) == 0, -_INT32 <= a < _INT32, a < _INT64, a < _UINT64))
                values.append(a)
            elif type(a) is float or a is None:
                key.append(type(a))
                values.append(a)
            else:
                key.append((type(a), a))
                values.append(a)
        names = self._constexpr_names
        for name, value in kwargs.items():
            if name not in names and name not in _LAUNCH_OPTIONS:
                return None
            key.append((name, value))
        return tuple(key), tuple(values)

    def _tail(self, num_args: int, kwargs) -> tuple | None:
        """The bound values of the parameters after the positional ones, in signature order (None: one is missing)."""
        tail = []
        for name in self._names[num_args:]:
            if name in kwargs:
                tail.append(kwargs[name])
            elif name in self._defaults:
                tail.append(self._defaults[name])
            else:
                return None
        return tuple(tail)

    def _prepare(self, grid, device: int, args, kwargs, active):
        """Compile (or find) the kernel for these arguments and make its `_Kept` entry; _TRITON where ember's launcher
        cannot launch it; None where Triton launched nothing (the compile-only hook answered)."""
        module = _launch_module()
        tail = self._tail(len(args), kwargs)
        if module is None or tail is None or _host_tensor_among(args):
            return _TRITON          # Triton's launcher raises on a host tensor's address; a kernel would fault on it
        kernel = self.fn.run(*args, grid=grid, warmup=True, **kwargs)
        if kernel is None:
            return None
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        metadata = kernel.metadata
        types = _parameter_types(kernel, self._names)
        if types is None or getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid",
                                                                             False):
            return _TRITON
        codes, picks = types
        binary = getattr(kernel, "kernel", None) or kernel.asm["cubin"]
        loaded = active.utils.load_binary(kernel.name, binary, metadata.shared, device)
        function = loaded[1]
        extra = (None,) * (len(codes) - len(picks))
        if len(picks) > 1:
            pick = operator.itemgetter(*picks)
        elif picks:
            pick = functools.partial(_one, picks[0])
        else:
            pick = _none
        return _Kept(function, codes, pick, tail, extra, metadata.num_warps, metadata.shared,
                     bool(getattr(metadata, "launch_pdl", False)), kernel, module)

    def _launch(self, grid, *args, **kwargs):
        runtime, compilation, active = _triton_runtime()
        if callable(grid) or self.fn.pre_run_hooks or _hooks_set(runtime, compilation):
            return self._slow(grid, args, kwargs)
        device = active.get_current_device()
        made = self._key(device, args, kwargs)
        if made is None:
            return self._slow(grid, args, kwargs)
        key, values = made
        try:
            entry = self._kept.get(key)
        except TypeError:               # an argument that cannot be hashed
            return self._slow(grid, args, kwargs)
        if entry is None:
            if len(self._kept) >= MAX_KEYS:
                return self._slow(grid, args, kwargs)
            hook = getattr(runtime, "jit_cache_hook", None)
            if hook is not None and hook is self._answered[0]() and key in self._answered[1]:
                return None             # the compile-only hook took this key already (see `answers_per_key`)
            entry = self._prepare(grid, device, args, kwargs, active)
            if entry is None:
                if getattr(hook, "answers_per_key", False):
                    if hook is not self._answered[0]():
                        self._answered = (weakref.ref(hook), set())
                    self._answered[1].add(key)
                return None
            self._kept[key] = entry
        if entry is _TRITON:
            return self._slow(grid, args, kwargs)
        function, codes, pick, tail, extra, num_warps, shared, pdl, kernel, module = entry
        n = len(grid)
        self.fast_launches += 1
        module.launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, num_warps, shared, pdl,
                      active.get_current_stream(device), function, codes, pick(values + tail) + extra)
        return kernel


_launchers: list[KernelLauncher] = []


def fast_launch_count() -> int:
    """Launches, over every kernel's launcher in this process, made through ember's launcher."""
    return sum(made.fast_launches for made in _launchers)


@functools.cache
def launcher(fn):
    """The `KernelLauncher` of a compiled @triton.jit kernel (one per kernel); anything else, such as an interpreted
    kernel for CPU tensors, is returned as it is, and so is every kernel where the `fast_launch` hook is off."""
    from triton.runtime.jit import JITFunction
    if not isinstance(fn, JITFunction) or type(fn).__name__ == "InterpretedFunction" or not enabled("fast_launch"):
        return fn
    made = KernelLauncher(fn)
    _launchers.append(made)
    return made
