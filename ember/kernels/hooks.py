"""ember's hooks into torch's and Triton's internals: which there are, the versions each was checked against, and
the one switch that turns them off (docs/hooks.md says what each buys and what it relies on).

A hook only saves time (at start-up, or per launch); with every hook off, ember computes the same results, which a
CPU test checks on the engine's parity tests (`tests/unit/test_hooks.py`). A hook whose library is at a version it
was not checked against (major.minor) turns itself off, with one log line naming it and the versions, so an
upgrade that breaks a hook costs time, never correctness.

EMBER_HOOKS, read once per process, sets them: `off` turns every hook off, `NAME=off` one of them (comma-separated,
e.g. `EMBER_HOOKS=fast_launch=off,layer_stamp=off`); `on` or `NAME=on` runs hooks on unchecked versions too (to
check a new version); unset (or `auto`), each hook runs where its versions were checked."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
from dataclasses import dataclass

logger = logging.getLogger("ember")

ENV = "EMBER_HOOKS"
SETTINGS = ("auto", "off", "on")

# the versions ember's tests pass on: torch 2.11 with Triton 3.6 on the H100 host (GPU tests, where the hooks run
# for real), torch 2.13 with Triton 3.9 on the CI's CPU (unit tests)
TORCH_CHECKED = ("2.11", "2.13")
TRITON_CHECKED = ("3.6", "3.9")


@dataclass(frozen=True)
class Hook:
    """One hook: its name (the EMBER_HOOKS key), where it lives, and the libraries whose internals it reaches into
    with the major.minor versions it was checked against."""
    name: str
    module: str
    checked: tuple[tuple[str, tuple[str, ...]], ...]


HOOKS = {hook.name: hook for hook in (
    Hook("fast_launch", "ember.kernels.launcher", (("triton", TRITON_CHECKED),)),
    Hook("triton_key", "ember.kernels.triton_key", (("triton", TRITON_CHECKED), ("torch", TORCH_CHECKED))),
    Hook("dependency_hashes", "ember.kernels.triton_key", (("triton", TRITON_CHECKED),)),
    Hook("compile_workers", "ember.kernels.precompile", (("triton", TRITON_CHECKED),)),
    Hook("layer_stamp", "ember.graphs.layer_stamp", (("torch", TORCH_CHECKED),)),
    Hook("plain_pieces", "ember.graphs.plain_pieces", (("torch", TORCH_CHECKED),)),
)}


def parse(text: str) -> dict[str, str]:
    """Each hook's setting ("auto", "off" or "on") from an EMBER_HOOKS value; ValueError for anything else."""
    chosen = dict.fromkeys(HOOKS, "auto")
    for entry in (e.strip() for e in text.split(",")):
        name, sep, value = entry.partition("=")
        if not entry:
            continue
        if not sep and name in SETTINGS:
            chosen = dict.fromkeys(HOOKS, name)
        elif sep and name.strip() in HOOKS and value.strip() in SETTINGS:
            chosen[name.strip()] = value.strip()
        else:
            raise ValueError(f"{ENV} entry {entry!r} is not understood; use off, on, or NAME=off / NAME=on "
                             f"(comma-separated) with NAME one of {', '.join(HOOKS)} (docs/hooks.md)")
    return chosen


@functools.cache
def settings() -> dict[str, str]:
    """The hooks' settings from EMBER_HOOKS, read once per process."""
    return parse(os.environ.get(ENV, ""))


def installed_version(library: str) -> str | None:
    """major.minor of an importable library, or None where it is absent."""
    try:
        version = importlib.import_module(library).__version__
    except ImportError:
        return None
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return f"{match.group(1)}.{match.group(2)}" if match else str(version)


def unchecked(hook: Hook) -> list[str]:
    """What is installed that `hook` was not checked against, one phrase a library (empty: all checked)."""
    found = []
    for library, versions in hook.checked:
        have = installed_version(library)
        if have not in versions:
            found.append(f"{library} {have or '(absent)'} (checked: {', '.join(versions)})")
    return found


@functools.cache
def enabled(name: str) -> bool:
    """Whether hook `name` runs in this process: decided once, by EMBER_HOOKS and the installed versions; a hook
    turned off by its versions says so in one log line."""
    if name not in HOOKS:
        raise ValueError(f"{name!r} is not one of ember's hooks ({', '.join(HOOKS)})")
    setting = settings()[name]
    if setting != "auto":
        return setting == "on"
    found = unchecked(HOOKS[name])
    if found:
        logger.warning("hook %s is off: it was not checked with %s; %s=%s=on runs it anyway", name,
                       " or ".join(found), ENV, name)
        return False
    return True
