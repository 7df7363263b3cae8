"""Run models as tensor-parallel ranks without the engine: `python -m tests.helpers.tp_ranks STORE RANK SIZE OUT
SPEC...` joins a gloo group of SIZE ranks through the file STORE, loads its shard of each SPEC ("folder" or
"folder:quantization") in float32 on the CPU, and runs `rank_results` on it; rank 0 saves the results to OUT
(torch.save). `run_ranks` starts the ranks and returns rank 0's results, `rank_results` is also what one rank of one
(the whole model, in the test's own process) computes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 120, 33, 2, 64], [12, 300, 8, 77, 1, 190]]
GREEDY_TOKENS = 24


def record_slice_reads(monkeypatch) -> list[str]:
    """The names of the checkpoint tensors the loader reads as slices from now on (appended as they are read)."""
    from ember.models import loader
    sliced = []
    read_slice = loader._read_slice

    def spy(f, name, piece):
        sliced.append(name)
        return read_slice(f, name, piece)
    monkeypatch.setattr(loader, "_read_slice", spy)
    return sliced


def load(spec: str, shard=None):
    from ember.distributed.shard import ShardSpec
    from ember.models.loader import load_config, load_model
    from ember.quant import resolve_quant_config
    folder, _, quantization = spec.partition(":")
    config = load_config(folder)
    quant = resolve_quant_config(config, quantization or None, torch.float32, "cpu")
    return load_model(folder, config, torch.float32, "cpu", progress=False, quant=quant, shard=shard or ShardSpec())


@torch.inference_mode()
def rank_results(model) -> dict[str, object]:
    """Teacher-forced logits [tokens of PROMPTS, vocab] of every prompt position, and the greedy continuation of
    each prompt (GREEDY_TOKENS tokens) with the logits [GREEDY_TOKENS, prompts, vocab] that chose each token."""
    from tests.helpers.model_harness import ModelHarness
    harness = ModelHarness(model, len(PROMPTS), max_seq_len=64)
    logits = model.compute_logits(harness.step(list(enumerate(PROMPTS))))
    harness = ModelHarness(model, len(PROMPTS), max_seq_len=64)
    step = harness.last_logits(list(enumerate(PROMPTS)))
    tokens, steps = [], []
    for _ in range(GREEDY_TOKENS):
        steps.append(step)
        tokens.append(step.argmax(-1).tolist())
        step = harness.last_logits([(i, [t]) for i, t in enumerate(tokens[-1])])
    return {"logits": logits, "tokens": [list(t) for t in zip(*tokens)], "step_logits": torch.stack(steps)}


def run_ranks(specs: list[str], tmp_path: Path, size: int = 2, timeout_s: float = 300.0) -> dict[str, dict]:
    """Every spec's `rank_results` at `size` ranks (rank 0's), one process a rank."""
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.tp_ranks", str(tmp_path / "store"), str(rank),
                               str(size), str(out), *specs], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(size)]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(f"rank {r} (exit {p.returncode}):\n{log[-3000:]}"
                                                            for r, (p, log) in enumerate(zip(procs, logs))))
    return torch.load(out)


def main(store_path: str, rank: str, size: str, out: str, *specs: str) -> None:
    import torch.distributed as dist
    from ember.distributed.parallel_state import init_tensor_parallel, leave_tensor_parallel
    from ember.distributed.shard import ShardSpec
    rank, size = int(rank), int(size)
    torch.set_num_threads(1)            # two ranks on two cores
    init_tensor_parallel(rank, size, 0, "cpu", dist.FileStore(store_path, size), 120.0)
    try:
        results = {spec: rank_results(load(spec, ShardSpec(rank, size))) for spec in specs}
    finally:
        leave_tensor_parallel()
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
