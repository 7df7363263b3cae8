"""The engine core in a process of its own on CUDA (Qwen3-0.6B config, random weights): one request at a time, its
greedy tokens equal the in-process engine's; with data_parallel_size=2 each core takes its own GPU (both GPUs'
free memory drops by a KV cache), requests added together alternate between them and all complete.

    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_engine_process_gpu.py      (the second test: 2 GPUs)

Needs pyzmq and msgspec (`pip install --no-index --find-links $WHEELS pyzmq msgspec` on a machine without network).
"""

import pytest
import torch

from ember import LLM, SamplingParams

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ENGINE = dict(load_format="dummy", max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPTS = [[(37 * i + 11 * j) % 5000 + 100 for j in range(16 + 8 * i)] for i in range(8)]


def _one_at_a_time(llm) -> list[list[int]]:
    return [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_a_core_process_gives_the_in_process_tokens():
    inproc = LLM("qwen3-0.6b", **ENGINE)
    want = _one_at_a_time(inproc)
    del inproc
    torch.cuda.empty_cache()
    mp = LLM("qwen3-0.6b", engine_process=True, **ENGINE)
    try:
        got = _one_at_a_time(mp)
    finally:
        mp.shutdown()
    assert all(len(t) == 64 for t in got)
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_data_parallel_puts_each_core_on_its_own_gpu():
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    llm = LLM("qwen3-0.6b", data_parallel_size=2, **ENGINE)
    try:
        taken = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in range(2)]
        # each core reserved its own KV cache (0.3 of a GPU, less the weights) on its own device
        assert min(taken) > 0.2 * torch.cuda.get_device_properties(0).total_memory, taken
        client = llm.engine.client
        prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)] + [i + 100]} for i in range(64)]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [64] * 64
        assert client.num_routed == [32, 32]
        # the same request alone on each core: the same tokens
        twins = llm.generate([{"prompt_token_ids": PROMPTS[3]}] * 2, GREEDY, use_tqdm=False)
        assert client.num_routed == [33, 33]
        assert twins[0].outputs[0].token_ids == twins[1].outputs[0].token_ids
    finally:
        llm.shutdown()
