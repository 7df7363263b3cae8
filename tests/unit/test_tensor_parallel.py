"""Tensor parallelism end to end on the CPU: two ranks (this process and a worker) over gloo, tiny random models in
float32. A worker killed mid-run is reported, and the engine raises instead of hanging."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.helpers.model_harness import random_hf_model, tiny_config

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
