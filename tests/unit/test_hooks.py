"""ember's hooks into torch and Triton internals (ember/kernels/hooks.py): EMBER_HOOKS turns each off, a version it
was not checked against turns it off with one log line, each hook's code obeys its switch, docs/hooks.md lists
them, and the engine's parity tests pass in a process with every hook off."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ember.kernels import hooks

ROOT = Path(__file__).resolve().parents[2]


def test_ember_hooks_parses_off_on_and_names():
    names = list(hooks.HOOKS)
    assert hooks.parse("") == dict.fromkeys(names, "auto")
    assert hooks.parse("off") == dict.fromkeys(names, "off")
    assert hooks.parse(" on ") == dict.fromkeys(names, "on")
    chosen = hooks.parse("fast_launch=off, layer_stamp = off,plain_pieces=on")
    assert chosen == {**dict.fromkeys(names, "auto"), "fast_launch": "off", "layer_stamp": "off",
                      "plain_pieces": "on"}
    assert hooks.parse("off,triton_key=on") == {**dict.fromkeys(names, "off"), "triton_key": "on"}


@pytest.mark.parametrize("text", ["0", "fast_launch", "fast_lunch=off", "layer_stamp=0", "off=layer_stamp"])
def test_a_misspelt_ember_hooks_entry_is_refused_with_the_hook_names(text):
    with pytest.raises(ValueError, match=re.escape(repr(text.split(",")[0].strip()))) as error:
        hooks.parse(text)
    assert "fast_launch, triton_key" in str(error.value)


def test_an_unknown_hook_name_is_refused():
    with pytest.raises(ValueError, match="'fast_lunch' is not one of ember's hooks"):
        hooks.enabled("fast_lunch")


def test_the_recorded_versions_are_those_tests_pass_on():
    for hook in hooks.HOOKS.values():
        for library, versions in hook.checked:
            assert (library, versions) in (("torch", ("2.11", "2.13")), ("triton", ("3.6", "3.9")))
    assert {lib for hook in hooks.HOOKS.values() for lib, _ in hook.checked} == {"torch", "triton"}


def test_an_unchecked_version_turns_a_hook_off_with_one_log_line(hooks_env, monkeypatch, caplog):
    installed = {"torch": "2.14", "triton": "3.9"}
    monkeypatch.setattr(hooks, "installed_version", lambda library: installed[library])
    hooks_env("")
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert hooks.enabled("layer_stamp") is False and hooks.enabled("layer_stamp") is False
        assert hooks.enabled("fast_launch") is True           # Triton 3.9 was checked
        assert hooks.enabled("triton_key") is False           # it reaches into torch's Inductor too
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == ("hook layer_stamp is off: it was not checked with torch 2.14 (checked: 2.11, 2.13); "
                        "EMBER_HOOKS=layer_stamp=on runs it anyway")
    assert lines[1].startswith("hook triton_key is off: it was not checked with torch 2.14")
    hooks_env("layer_stamp=on")
    assert hooks.enabled("layer_stamp") is True
    installed["triton"] = None                                 # absent
    hooks_env("")
    assert hooks.enabled("fast_launch") is False and "triton (absent)" in caplog.records[-1].getMessage()


def test_here_every_hook_is_on_by_default_and_off_with_ember_hooks_off(hooks_env):
    """This CI's torch and Triton are among the checked versions."""
    hooks_env("")
    assert [n for n in hooks.HOOKS if not hooks.enabled(n)] == []
    hooks_env("off")
    assert [n for n in hooks.HOOKS if hooks.enabled(n)] == []


def test_triton_key_off_leaves_tritons_key_alone(hooks_env, tmp_path):
    import triton.runtime.cache as cache

    from ember.kernels import triton_key
    hooks_env("triton_key=off")
    before = cache.triton_key
    assert triton_key.install(tmp_path) is None
    assert cache.triton_key is before and not any(tmp_path.iterdir())


def test_dependency_hashes_off_puts_no_order_in_place(hooks_env, monkeypatch):
    from triton.runtime.jit import DependenciesFinder

    from ember.kernels import triton_key

    def tritons_own(self, func):
        return None
    monkeypatch.setattr(DependenciesFinder, "_update_hash", tritons_own)
    hooks_env("dependency_hashes=off")
    assert triton_key.order_dependency_hashes() is False and DependenciesFinder._update_hash is tritons_own
    hooks_env("")
    assert triton_key.order_dependency_hashes() is True and DependenciesFinder._update_hash.ember_ordered


def test_compile_workers_off_starts_no_worker(hooks_env, monkeypatch):
    from ember.kernels import triton_key
    from ember.runner import warmup

    class GoesOn(Exception):
        pass

    def marker(runner):
        raise GoesOn
    monkeypatch.setattr(triton_key, "pin_ptxas", lambda: None)
    monkeypatch.setattr(warmup, "_marker", marker)     # the first step past the switches
    runner = types.SimpleNamespace(device=torch.device("cuda"), tp=types.SimpleNamespace(size=1),
                                   config=types.SimpleNamespace(compile=types.SimpleNamespace(triton_compile_workers=4)))
    hooks_env("compile_workers=off")
    assert warmup.precompile(runner) == 0.0
    hooks_env("")
    with pytest.raises(GoesOn):
        warmup.precompile(runner)
    runner.tp.size = 2      # tensor parallel: no workers, the hook on or not
    assert warmup.precompile(runner) == 0.0


@pytest.mark.parametrize("setting", ["", "plain_pieces=off", "layer_stamp=off"])
def test_the_compiled_model_takes_the_plain_pieces_and_layer_stamp_switches(hooks_env, tmp_path, setting):
    from ember.graphs.compile import CompiledModel
    hooks_env(setting)
    compiled = CompiledModel(torch.nn.Linear(2, 2), cache_key="k", cache_root=tmp_path)
    plain = setting != "plain_pieces=off"
    assert compiled.backend.plain_pieces is plain and compiled.cache_dir.name.endswith("-plain") is plain
    assert compiled.stamp_layers is (setting != "layer_stamp=off")


def test_docs_list_every_hook_with_its_checked_versions():
    text = (ROOT / "docs" / "hooks.md").read_text()
    section = text[text.index("## The hooks"):text.index("## Internals that are not hooks")]
    rows = {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `(\w+)` \|", line))}
    assert sorted(rows) == sorted(hooks.HOOKS)
    for name, hook in hooks.HOOKS.items():
        for library, versions in hook.checked:
            assert f"{'Triton' if library == 'triton' else library} {', '.join(versions)}" in rows[name], name


# the engine's parity tests that run with every hook off: greedy tokens against transformers (eager), and logprobs of
# eager and compiled runs against a compiled reference (its pieces go to Inductor where plain pieces are off)
PARITY_TESTS = (
    "tests/unit/test_engine.py::test_greedy_tokens_equal_transformers[tiny_qwen3]",
    "tests/unit/test_engine.py::test_a_backend_that_takes_rope_gets_raw_q_and_k_and_the_default_applies_them"
    "[tiny_qwen3]",
)

# runs the tests, then reports what the hooks left: whether any is on, Triton's build key replaced, Triton's
# dependency hashing reordered
CHILD = """
import sys
import pytest
code = pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]])
from triton.runtime.jit import DependenciesFinder
from ember.kernels import hooks, triton_key
print("HOOKS ON", [n for n in hooks.HOOKS if hooks.enabled(n)], "KEY", triton_key.installed_key() is not None,
      "ORDERED", getattr(DependenciesFinder._update_hash, "ember_ordered", False))
sys.exit(code)
"""


def test_engine_parity_tests_pass_with_every_hook_off(tmp_path):
    env = {**os.environ, "EMBER_HOOKS": "off", "EMBER_CACHE": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", CHILD, *PARITY_TESTS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(rf"\b{len(PARITY_TESTS)} passed\b", out), out[-2000:]
    assert "HOOKS ON [] KEY False ORDERED False" in out, out[-2000:]
