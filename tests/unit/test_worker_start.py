"""How tensor-parallel workers start (`ember.executor.start`): forked where the CUDA driver is untouched, else a fresh
interpreter; `EMBER_WORKER_START` chooses, and a choice that cannot be met is refused with the reason. Both ways
give the same tokens, and each worker is named `ember-rank<r>`."""

import os
import subprocess

import pytest

from ember import LLM, SamplingParams
from ember.executor import start
from tests.helpers.model_harness import random_hf_model, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7], list(range(40, 60))]


def test_the_choice_follows_the_switch_and_the_driver(monkeypatch):
    monkeypatch.delenv("EMBER_WORKER_START", raising=False)
    monkeypatch.setattr(start, "cuda_driver_initialized", lambda: False)
    assert start.start_method("cpu")[0] == "fork"
    assert start.start_method("cuda") == ("fork", "the CUDA driver is not initialized here")
    monkeypatch.setattr(start, "cuda_driver_initialized", lambda: True)
    method, why = start.start_method("cuda")
    assert method == "spawn" and "initialized the CUDA driver" in why
    assert start.start_method("cpu")[0] == "fork"           # a CPU engine's workers never touch CUDA
    monkeypatch.setenv("EMBER_WORKER_START", "fork")
    with pytest.raises(RuntimeError, match="EMBER_WORKER_START=fork cannot be met"):
        start.start_method("cuda")
    monkeypatch.setenv("EMBER_WORKER_START", "spawn")
    assert start.start_method("cpu") == ("spawn", "EMBER_WORKER_START=spawn")
    monkeypatch.setenv("EMBER_WORKER_START", "vfork")
    with pytest.raises(ValueError, match="'vfork'"):
        start.start_method("cpu")


def test_a_forked_process_reports_its_exit_code_and_its_wait_times_out():
    pid = os.fork()
    if pid == 0:
        import time
        time.sleep(0.3)
        os._exit(3)
    child = start.ForkedProcess(pid)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.05)
    assert child.wait(timeout=10.0) == 3 and child.poll() == 3
    child.kill()        # already gone: nothing happens


def _run(path, method, monkeypatch):
    monkeypatch.setenv("EMBER_WORKER_START", method)
    llm = LLM(path, device="cpu", tensor_parallel_size=2)
    try:
        (pid,) = llm.engine.runner.worker_pids.values()
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
        with open(f"/proc/{pid}/cmdline") as f:
            cmdline = f.read().replace("\0", " ")
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    return tokens, name, cmdline


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_forked_and_spawned_workers_give_the_same_tokens(tmp_path, monkeypatch):
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    forked, forked_name, forked_cmd = _run(str(tmp_path), "fork", monkeypatch)
    spawned, spawned_name, spawned_cmd = _run(str(tmp_path), "spawn", monkeypatch)
    assert forked_name == spawned_name == "ember-rank1"
    assert "ember.executor.worker" in spawned_cmd and "ember.executor.worker" not in forked_cmd
    assert forked == spawned and all(len(t) == 12 for t in forked)
