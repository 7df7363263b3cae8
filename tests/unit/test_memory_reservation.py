"""Start-up sets aside the attention's worst case: the KV cache is sized from the memory the selected backend's
declared workspace leaves (docs/memory.md), the largest steps then fit within it, and a workspace that leaves no
useful cache is refused with both figures. On the CPU, under a memory budget too small for torch_ref's whole score
matrix of a 2,048-token prefill (16 heads: 256 MiB a copy; the math before chunks held two or three at once)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Qwen3Config

from ember import LLM
from ember.attention_backends import torch_ref
from ember.attention_backends.base import StepBounds
from ember.attention_backends.torch_ref import TorchRefBackend
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from ember.runner import kv_cache_setup
from ember.runner.cpu_memory import cpu_kv_cache_bytes
from ember.runner.kv_cache_setup import GRAPH_RESERVE_BYTES, AttentionWorkspace, num_kv_blocks
from tests.helpers.peak_memory import PeakMemory

MiB, GiB = 1 << 20, 1 << 30
CONTEXT = 2048          # max_model_len = max_num_batched_tokens: the largest step is one whole prompt
MAX_NUM_SEQS = 128
BUDGET = 512 * MiB      # the host memory the engine is told is available


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("workspace_model")
    Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=16,
                num_key_value_heads=8, head_dim=16, max_position_embeddings=CONTEXT, tie_word_embeddings=True,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 2**20 scores (4 MiB) keep the steps short on a CPU; the declaration follows the constant."""
    monkeypatch.setattr(torch_ref, "SCORE_CHUNK_ELEMENTS", 1 << 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # on a small shared CPU, torch's thread pool spins on every small op
    yield
    torch.set_num_threads(threads)


def _llm(model_folder, monkeypatch, available: int) -> LLM:
    monkeypatch.setattr(kv_cache_setup, "available_memory_bytes", lambda: available)
    return LLM(model_folder, load_format="dummy", device="cpu", attention_backend="torch_ref", dtype="float32",
               max_num_batched_tokens=CONTEXT, max_num_seqs=MAX_NUM_SEQS)


def test_the_cache_leaves_room_for_the_largest_steps(model_folder, monkeypatch):
    runner = _llm(model_folder, monkeypatch, BUDGET).engine.runner
    workspace = runner.attention_workspace
    spec = runner.attn.groups[0].spec
    options = next(iter(runner.attn.layers.values())).options
    assert workspace.backend == "torch_ref"
    assert workspace.nbytes == TorchRefBackend.workspace_bytes(StepBounds(CONTEXT, MAX_NUM_SEQS, CONTEXT), spec,
                                                               options, torch.float32)
    assert 8 * MiB < workspace.nbytes < 16 * MiB          # two 4 MiB chunks of scores, and the rest
    # a quarter of what the workspace leaves (the cap of 128 requests of 2,048 tokens is larger)
    per_block = runner.attn.bytes_per_block()
    assert runner.num_blocks == cpu_kv_cache_bytes(BUDGET - workspace.nbytes) // per_block
    assert runner.max_model_len == CONTEXT
    kv_bytes = runner.num_blocks * per_block
    upload = runner.upload
    sizes = [upload._ring[0][0].numel(), upload._ring[1][0].numel(), upload._device_buf.numel()]

    # the largest prefill (a whole 2,048-token prompt), then 128 decodes at the longest context; null blocks stand
    # for the context, which the cache could not hold for all 128
    steps = {"prefill": ([CONTEXT], 0), "decodes": ([1] * MAX_NUM_SEQS, CONTEXT - 1)}
    for name, (lens, context_len) in steps.items():
        with torch.inference_mode(), PeakMemory() as step:
            _each_attention_call_in(step.section, monkeypatch)
            hidden, _ = runner._dummy_forward(sum(lens), len(lens), lens=lens, context_len=context_len)
        assert hidden.shape[0] == sum(lens) and not hidden.isnan().any()
        assert len(step.section_peaks) == 1        # the one layer's attention call
        assert 0 < step.section_peaks[0] <= workspace.nbytes, name
        # the whole step, its activations included (on the CPU they come out of what the cache leaves)
        assert kv_bytes + step.peak <= BUDGET, (name, kv_bytes, step.peak)

    # the decodes as a whole step (their 128 rows of 2,048 tokens written into the request table, then sampled);
    # here and above, the table's writes go in pieces, and the upload keeps the size start-up gave it
    from ember.runner.step_input import null_block_step
    from ember.runner.warmup import GREEDY
    assert MAX_NUM_SEQS * CONTEXT > runner.table.write_piece      # more than one piece of token ids
    step = null_block_step("__long", [1] * MAX_NUM_SEQS, [GREEDY] * MAX_NUM_SEQS, runner.config.cache.block_size,
                           len(runner.attn.groups), CONTEXT - 1)
    with PeakMemory() as whole:
        out = runner.execute(step)
    for new in step.new_requests:
        runner.table.remove(new.req_id)
    assert len(out.sampled_token_ids) == MAX_NUM_SEQS
    assert [upload._ring[0][0].numel(), upload._ring[1][0].numel(), upload._device_buf.numel()] == sizes
    assert kv_bytes + whole.peak <= BUDGET, (kv_bytes, whole.peak)


def _each_attention_call_in(section, monkeypatch) -> None:
    """Run torch_ref's attention calls each inside `section()`."""
    forward = torch_ref.TorchRefImpl.forward

    def measured(self, *args, **kwargs):
        with section():
            return forward(self, *args, **kwargs)

    monkeypatch.setattr(torch_ref.TorchRefImpl, "forward", measured)


def test_a_workspace_that_leaves_no_useful_cache_is_refused(model_folder, monkeypatch):
    with pytest.raises(ValueError) as refused:
        _llm(model_folder, monkeypatch, 10 * MiB)
    message = str(refused.value)
    assert "attention backend torch_ref needs 0.01 GiB of workspace" in message
    assert "2048 tokens over up to 128 requests, against 2048 tokens of context" in message
    assert "0.01 GiB of host memory is available" in message


def _gpu_blocks(monkeypatch, workspace: int) -> int:
    """num_kv_blocks on a stubbed 80 GiB device with 75 GiB free (more than the 72 GiB gpu_memory_utilization
    allows), a weightless model and a 1 GiB activation peak, for one group of 16-token blocks of 1 MiB."""
    cuda = kv_cache_setup.torch.cuda
    monkeypatch.setattr(cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (75 * GiB, 80 * GiB))
    spec = KVCacheSpec(16, 8, 128, torch.bfloat16, None)
    attn = types.SimpleNamespace(groups=[KVCacheGroup(("layer.0",), spec)], bytes_per_block=lambda: MiB)
    cache = types.SimpleNamespace(num_kv_blocks=None, gpu_memory_utilization=0.9, block_size=16)
    bounds = StepBounds(8192, 256, 40960)
    return num_kv_blocks(attn, cache, torch.nn.Module(), torch.device("cuda"), 40960, 256, 8192,
                         activation_peak=GiB, workspace=AttentionWorkspace(workspace, "torch_ref", bounds))


def test_on_cuda_the_workspace_comes_off_the_cache_or_is_refused(monkeypatch):
    left = 72 * GiB - GiB - GRAPH_RESERVE_BYTES
    assert _gpu_blocks(monkeypatch, 0) == left // MiB
    assert _gpu_blocks(monkeypatch, 4 * GiB) == (left - 4 * GiB) // MiB
    # one request of a full-size step (8,192 tokens) takes 512 blocks and the null block: a workspace that leaves
    # room for fewer is refused
    useful = 513 * MiB
    assert _gpu_blocks(monkeypatch, left - useful) == 513
    with pytest.raises(ValueError) as refused:
        _gpu_blocks(monkeypatch, left - useful + 1)
    message = str(refused.value)
    assert f"attention backend torch_ref needs {(left - useful + 1) / GiB:.2f} GiB of workspace" in message
    assert "8192 tokens over up to 256 requests, against 40960 tokens of context" in message
    assert "70.50 GiB of GPU memory is left after the weights" in message
    assert "a KV cache of one full-size step (0.50 GiB)" in message
