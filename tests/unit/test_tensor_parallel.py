"""Tensor parallelism end to end on the CPU: two ranks (this process and a worker) over gloo, tiny random models in
float32. Greedy tokens equal one rank's over 32 tokens with chunked prefill, prefix-cache hits and preemptions;
logits within 1e-4; a KV head replicated on both ranks; a worker killed mid-run is reported, and the engine raises
instead of hanging."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from ember import LLM, SamplingParams
from tests.helpers.model_harness import random_hf_model, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7], list(range(40, 66)), list(range(40, 64)) + [9, 9]]
# chunks of 8 tokens, a pool too small for the three requests at once (preemption), prompts sharing a prefix; prompt
# logprobs of SCORED in two chunks of the LM head's rows (at most max_num_seqs a chunk), the same on both ranks
SMALL = dict(device="cpu", max_num_batched_tokens=8, block_size=8, num_kv_blocks=10, max_model_len=64,
             max_num_seqs=4)
LOGITS_ATOL = 1e-4
SCORED = list(range(100, 108))


def generate(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run_both(path, prompts=PROMPTS, params=GREEDY, **kwargs):
    """(tokens, stats, logits) of one rank and of two ranks on the same settings."""
    results = []
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, **kwargs)
        try:
            tokens = generate(llm, prompts, params)
            stats = llm.engine.stats
            results.append((tokens, (stats.num_preemptions, stats.num_prefix_cache_hits), llm.engine.score(SCORED),
                            llm.engine.prompt_logprobs(SCORED, 2)))
        finally:
            llm.engine.runner.shutdown()
    return results


def test_two_ranks_give_one_ranks_tokens_and_logits(tmp_path):
    # vocabulary 317: two ranks hold 159 and 158 ids (one padding row)
    random_hf_model(tiny_config("llama", vocab_size=317)).save_pretrained(tmp_path)
    (one, one_stats, one_logits, one_lp), (two, two_stats, two_logits, two_lp) = run_both(str(tmp_path), **SMALL)
    assert all(len(t) == 32 for t in two)
    assert two == one
    assert one_stats == two_stats and one_stats[0] > 0 and one_stats[1] > 0     # preempted, prefix-cache hits
    assert two_logits.shape == (len(SCORED), 317) and one_logits.std() > 0.1
    assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL
    # each position's logprob from the logits, the top two ids (the same on both), their logprobs within the logits'
    want = torch.log_softmax(one_logits.float(), dim=-1)[:-1]
    assert len(one_lp) == len(two_lp) == len(SCORED) and one_lp[0] is None
    for i, (a, b) in enumerate(zip(one_lp[1:], two_lp[1:])):
        assert a.keys() == b.keys() and SCORED[i + 1] in a and len(a) >= 2
        assert abs(a[SCORED[i + 1]].logprob - want[i, SCORED[i + 1]].item()) <= 1e-5
        assert max(abs(a[t].logprob - b[t].logprob) for t in a) <= 2 * LOGITS_ATOL


def test_a_kv_head_replicated_on_both_ranks(tmp_path):
    # Gemma 2 with one KV head: each rank holds it, with its two query heads; soft caps and a sliding window too
    random_hf_model(tiny_config("gemma2", num_key_value_heads=1)).save_pretrained(tmp_path)
    (one, _, one_logits, _), (two, _, two_logits, _) = run_both(str(tmp_path), PROMPTS[:2], SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True), device="cpu")
    assert two == one
    assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from ember import LLM, SamplingParams
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
    worker = llm.engine.runner.worker_pids[1]
    stream = llm.generate_stream([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    try:
        for i, out in enumerate(stream):
            if i == 2:
                os.kill(worker, signal.SIGKILL)
                killed = time.monotonic()
        print("NOT RAISED", flush=True)
    except Exception as e:
        print(f"RAISED after {time.monotonic() - killed:.1f} s: {type(e).__name__}: {e}", flush=True)
    try:
        llm.generate([[4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
        print("AGAIN NOT RAISED", flush=True)
    except Exception as e:
        print(f"AGAIN {type(e).__name__}: {e}", flush=True)
""")


def test_a_worker_killed_mid_run_is_reported_and_the_engine_raises(tmp_path):
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    raised = next(line for line in out.splitlines() if line.startswith(("RAISED", "NOT RAISED")))
    assert raised.startswith("RAISED"), out
    assert "worker rank 1" in raised and f"exited with code -{int(signal.SIGKILL)}" in raised, raised
    assert float(raised.split()[2]) < 10.0, raised          # seconds from the kill to the error
    again = next(line for line in out.splitlines() if line.startswith(("AGAIN",)))
    assert "WorkerFailure: tensor-parallel worker rank 1" in again, out     # at once: the executor stays failed
    assert time.monotonic() - start < 120


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_two_ranks_under_an_engine_core_process(tmp_path):
    # the engine core in a process of its own drives rank 0 and starts rank 1 from there; shutdown ends both
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = LLM(str(tmp_path), device="cpu")
    try:
        expected = generate(one, PROMPTS[:2], params)
    finally:
        one.shutdown()
    llm = LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, engine_process=True)
    core = llm.engine.client.procs[0]
    try:
        workers = [pid for pid in _children(core.pid) if open(f"/proc/{pid}/comm").read().strip() == "ember-rank1"]
        assert len(workers) == 1, _children(core.pid)
        assert generate(llm, PROMPTS[:2], params) == expected
    finally:
        start = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - start < 15.0
    assert core.exitcode == 0
    assert not os.path.exists(f"/proc/{workers[0]}") or open(f"/proc/{workers[0]}/stat").read().split()[2] == "Z"
