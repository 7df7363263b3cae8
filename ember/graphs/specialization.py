"""Whether a compile fixed the dynamic token count to the value it was traced with.

The token count is one symbol, marked dynamic, that every piece shares: dynamo's trace and each piece's Inductor
compile use one ShapeEnv (`standalone_compile(..., dynamic_shapes="from_tracing_context")`). Code anywhere in that
chain that turns the symbol into its traced value (a Python `int()` of a size, an equality with a concrete size)
replaces it by that value for all of them. dynamo only says so when it builds its guards, after the backend has
compiled and saved every piece for that one size; a later start that loads those pieces then fails an Inductor size
assert at the first other token count. The backend checks after the trace and after each piece instead, and
refuses with where the symbol was fixed, before anything is saved.

    specialized_inputs(shape_env) -> [(input size, value, where)] of the symbolic input sizes fixed to a number
    check_not_specialized(shape_env, stage)          raises TokenCountSpecialized naming them
"""

from __future__ import annotations


class TokenCountSpecialized(ValueError):
    """The traced token count was fixed to one value during the compile; the message says where."""


def specialized_inputs(shape_env) -> list[tuple[str, int, str]]:
    """(input size, the number it became, where that happened) for each input size the trace made a symbol of
    (the marked-dynamic token count, nothing else here) that `shape_env` now replaces by a number."""
    found = []
    slocs = getattr(shape_env, "replacements_slocs", {})
    for symbol, sources in sorted(shape_env.var_to_sources.items(), key=lambda item: str(item[0])):
        if not symbol.is_integer:
            continue    # a float the trace kept symbolic (a norm's epsilon) and then fixed: not a size
        value = shape_env.replace(symbol)
        if not sources or not getattr(value, "is_number", False):
            continue
        # the location is recorded on the symbol that got the replacement: this one, or one it was unified with
        where = slocs.get(symbol) or next((slocs[s] for s in slocs if shape_env.replace(s) == value), None)
        name = sources[0].name            # a property in newer torch, a method in older ones
        found.append((name() if callable(name) else str(name), int(value), str(where) if where is not None else "unknown"))
    return found


def check_not_specialized(shape_env, stage: str) -> None:
    """Raise TokenCountSpecialized when, after `stage` (dynamo's trace, a piece's compile), some input size the
    trace kept symbolic is fixed to a number."""
    if shape_env is None:
        return
    found = specialized_inputs(shape_env)
    if found:
        fixed = "; ".join(f"{size} = {value} (at {where})" for size, value, where in found)
        raise TokenCountSpecialized(
            f"{stage} fixed the dynamic token count to the size of the first call: {fixed}. The compiled code "
            f"would run that size only, so nothing was saved; rerun with TORCH_LOGS=+dynamic to see the guard that "
            f"fixed it, and run with enforce_eager=True (compile_mode='none') meanwhile")
