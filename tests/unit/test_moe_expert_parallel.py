"""Expert parallelism (float32, CPU): attention tensor-parallel, rank r of two holding experts [4r, 4r + 4) of 8 at full
width. Each rank reads only its experts' tensors (per-expert and stacked checkpoints); the ranks' shares sum to the
whole block's output, also when every token routes to one rank's experts; the residual add stays after the one
all-reduce and the fusion passes keep the expert map; what cannot run is refused at start-up with the values; the
launch table is looked up by a rank's shape and the roofline counts a rank's experts; and,
over gloo in two processes, Qwen3-MoE and Mixtral give one rank's greedy tokens and logits with chunked prefill,
with layer 0 routing every token to rank 0's experts (rank 1's get none)."""

from __future__ import annotations

import types

import pytest
import torch

from ember.distributed.shard import ShardSpec
from ember.models import loader
from ember.models.loader import build_on_meta, load_model
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.unit.test_tensor_parallel import LOGITS_ATOL, PROMPTS, SCORED, SMALL, generate

FAMILIES = ["qwen3_moe", "mixtral"]


def one_sided_router(hf, layer: int = 0) -> None:
    """Make layer `layer`'s router send every token to experts 0-3 (rank 0's): their rows are u, -u, w, -w, so two
    of their logits are positive for any input, while experts 4-7 have zero rows and logits."""
    name = next(n for n in hf.state_dict() if n.startswith(f"model.layers.{layer}.") and n.endswith("gate.weight"))
    gate = hf.get_parameter(name)
    g = torch.Generator().manual_seed(11)
    u, w = torch.randn(2, gate.shape[1], generator=g)
    with torch.no_grad():
        gate.copy_(torch.stack([u, -u, w, -w, *[torch.zeros_like(u)] * (gate.shape[0] - 4)]))


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, folder, HF model, whole ember model) of a tiny random model (8 experts, top 2), layer 0's router
    one-sided."""
    path = tmp_path_factory.mktemp(f"moe_ep_{request.param}")
    hf = random_hf_model(tiny_config(request.param))
    one_sided_router(hf)
    hf.save_pretrained(path)
    return request.param, path, hf, load_model(path, None, torch.float32, "cpu", progress=False)


def _shards(path, monkeypatch):
    """Both ranks' expert-parallel shards, and the expert tensors each loaded."""
    loaded = []
    load_tensor = loader._load_tensor

    def spy(model, name, *args):
        loaded.append(name)
        return load_tensor(model, name, *args)
    monkeypatch.setattr(loader, "_load_tensor", spy)
    shards = []
    for rank in range(2):
        loaded.clear()
        shard = load_model(path, None, torch.float32, "cpu", progress=False, shard=ShardSpec(rank, 2, True))
        shards.append((shard, [n for n in loaded if ".experts." in n]))
    return shards


def test_each_rank_loads_only_its_whole_experts(checkpoint, monkeypatch):
    family, path, _, whole = checkpoint
    moe_layers = [i for i, layer in enumerate(whole.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe_layers == ([0, 2] if family == "qwen3_moe" else [0, 1])
    for rank, (shard, read) in enumerate(_shards(path, monkeypatch)):
        for i in moe_layers:
            ours, ref = shard.model.layers[i].mlp, whole.model.layers[i].mlp
            full = ref.experts.intermediate_size
            assert (ours.experts.num_local_experts, ours.experts.first_expert) == (4, 4 * rank)
            assert ours.experts.w13.shape == (4, 2 * full, 64) and ours.experts.w2.shape == (4, 64, full)
            assert torch.equal(ours.experts.w13, ref.experts.w13[4 * rank:4 * rank + 4])
            assert torch.equal(ours.experts.w2, ref.experts.w2[4 * rank:4 * rank + 4])
            assert torch.equal(ours.gate.weight, ref.gate.weight)                       # the router: replicated
            assert ours.experts.expert_map.tolist() == [e - 4 * rank if 4 * rank <= e < 4 * rank + 4 else -1
                                                        for e in range(8)]
        if family == "qwen3_moe":      # mlp_only_layers=[1]: the dense MLP stays column/row-parallel
            dense, ref = shard.model.layers[1].mlp, whole.model.layers[1].mlp
            assert torch.equal(dense.down_proj.weight, ref.down_proj.weight[:, rank * 48:(rank + 1) * 48])
        # gate, up and down of its 4 experts a layer, nothing of the other rank's
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read}
        assert len(read) == len(moe_layers) * 4 * 3 and experts == set(range(4 * rank, 4 * rank + 4))


def test_a_stacked_checkpoint_is_read_by_each_ranks_expert_range(checkpoint, tmp_path, monkeypatch):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]): a rank
    reads the slice of its experts along dim 0."""
    from safetensors.torch import save_file
    family, path, hf, whole = checkpoint
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    sliced = []
    read_slice = loader._read_slice
    monkeypatch.setattr(loader, "_read_slice", lambda f, name, piece: sliced.append((name, piece)) or
                        read_slice(f, name, piece))
    for rank in range(2):
        experts = load_model(tmp_path, None, torch.float32, "cpu", progress=False,
                             shard=ShardSpec(rank, 2, True)).model.layers[0].mlp.experts
        ref = whole.model.layers[0].mlp.experts
        assert torch.equal(experts.w13, ref.w13[4 * rank:4 * rank + 4])
        assert torch.equal(experts.w2, ref.w2[4 * rank:4 * rank + 4])
    expert_slices = {(p.dim, p.start, p.length, p.full) for n, p in sliced if ".experts." in n}
    assert expert_slices == {(0, 0, 4, 8), (0, 4, 4, 8)}


def test_the_ranks_shares_sum_to_the_whole_block(checkpoint, monkeypatch):
    """Layer 2 / 1 routes freely: both ranks hold some of the chosen experts. Layer 0 routes every token to rank 0's
    experts: rank 1's share is exactly zero and rank 0's is the whole output. One all-reduce a block and rank."""
    from ember.models.layers import moe as moe_layer
    family, path, _, whole = checkpoint
    (rank0, _), (rank1, _) = _shards(path, monkeypatch)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    reduced = []
    monkeypatch.setattr(moe_layer, "all_reduce", lambda out, group: reduced.append(group) or out)
    free = 2 if family == "qwen3_moe" else 1
    with torch.no_grad():
        for layer in (free, 0):
            expected = whole.model.layers[layer].mlp(x)
            parts = [shard.model.layers[layer].mlp(x) for shard in (rank0, rank1)]
            assert expected.abs().max() > 0.01
            assert (parts[0] + parts[1] - expected).abs().max().item() <= 1e-5
            if layer == 0:
                assert torch.equal(parts[1], torch.zeros_like(parts[1]))
            else:
                assert parts[0].abs().max() > 0.01 and parts[1].abs().max() > 0.01
        chosen = torch.topk(whole.model.layers[0].mlp.gate(torch.randn(500, 64)), 2).indices
        assert chosen.max().item() <= 3                                  # the one-sided router, on any input
    assert reduced == ["tp"] * 4


def test_the_fusion_passes_keep_the_expert_map(monkeypatch):
    """The residual add after the reduce goes into rank 0's op (which keeps its map), and rank 1's add goes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.distributed.ops import all_reduce
    from ember.graphs.passes import residual_all_reduce as RAR
    from ember.graphs.passes.residual_epilogue import fuse_residual_epilogue
    from ember.kernels.moe_op import moe
    x, logits, residual = torch.randn(3, 16), torch.randn(3, 8), torch.randn(3, 16)
    w13, w2, expert_map = torch.randn(4, 24, 16), torch.randn(4, 16, 12), torch.arange(8, dtype=torch.int32) - 4

    def layer(x, logits, residual, w13, w2, expert_map):
        return all_reduce(moe(x, logits, w13, w2, 2, True, None, expert_map), "tp") + residual

    for rank in (0, 1):
        gm = make_fx(layer, tracing_mode="fake")(x, logits, residual, w13, w2, expert_map)
        assert fuse_residual_epilogue(gm.graph) == 0                   # not past the reduce
        monkeypatch.setattr(RAR, "tensor_parallel", lambda: types.SimpleNamespace(rank=rank, size=2))
        assert RAR.fuse_residual_into_all_reduce(gm.graph) == 1
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert [str(n.target) for n in calls] == ["ember.moe.default", "ember.all_reduce.default"]
        args = calls[0].args
        assert len(args) == 8 and args[7].name == "expert_map_1"
        assert (args[6] is not None and args[6].name == "residual_1") == (rank == 0)


# ---- refusals ------------------------------------------------------------------------------------------------------
def test_expert_parallelism_on_one_rank_is_refused():
    from ember.config import ParallelConfig
    with pytest.raises(ValueError, match="enable_expert_parallel .* tensor_parallel_size is 1; set "
                                         "tensor_parallel_size to 2 or more"):
        ParallelConfig(1, enable_expert_parallel=True).validate("cpu")
    with pytest.raises(ValueError, match="enable_expert_parallel 'yes' must be True or False"):
        ParallelConfig(2, enable_expert_parallel="yes").validate("cpu")


def test_a_model_without_experts_is_refused(tmp_path):
    from ember import LLM
    message = "enable_expert_parallel .* and LlamaForCausalLM has no experts; leave expert parallelism off"
    with pytest.raises(ValueError, match=message):
        build_on_meta(tiny_config("llama"), torch.float32, None, ShardSpec(0, 2, True))
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):             # before any worker starts
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size is 1"):
        LLM(str(tmp_path), device="cpu", enable_expert_parallel=True)


@pytest.mark.parametrize("family, field", [("mixtral", "num_local_experts"), ("qwen3_moe", "num_experts")])
def test_an_expert_count_the_ranks_cannot_split_is_refused(family, field, tmp_path):
    from ember import LLM
    message = (r"the MoE layer's 5 experts cannot be split evenly over tensor_parallel_size 2 ranks "
               r"\(enable_expert_parallel\); choose a tensor_parallel_size that divides 5")
    with pytest.raises(ValueError, match=message):
        build_on_meta(tiny_config(family, **{field: 5}), torch.float32, None, ShardSpec(1, 2, True))
    random_hf_model(tiny_config(family, **{field: 5})).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    # the same model splits its experts' intermediate dimension under plain tensor parallelism
    shard = build_on_meta(tiny_config(family, **{field: 5}), torch.float32, None, ShardSpec(1, 2))
    assert shard.model.layers[0].mlp.experts.w13.shape[0] == 5


def test_the_flag_reaches_the_engine_config():
    import argparse

    from ember.args import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["-tp", "2", "--enable-expert-parallel"]))["enable_expert_parallel"]
    assert not engine_kwargs(parser.parse_args([]))["enable_expert_parallel"]


# ---- two ranks end to end --------------------------------------------------------------------------------------------
def _run(path, **kwargs):
    """(greedy tokens of PROMPTS over 32 steps, logits of SCORED) of an engine."""
    from ember import LLM
    llm = LLM(path, **SMALL, **kwargs)
    try:
        return generate(llm), llm.engine.score(SCORED)
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.parametrize("family, compile_mode", [*((f, "auto") for f in FAMILIES),
                                                  pytest.param("qwen3_moe", "default", marks=pytest.mark.slow)])
def test_two_expert_parallel_ranks_give_one_ranks_tokens_and_logits(family, compile_mode, tmp_path):
    """Chunks of 8 tokens with preemption (SMALL); layer 0 sends every token to rank 0's experts, the other MoE
    layers route freely. Greedy tokens over 32 steps equal, teacher-forced logits within 1e-4. Slow: compiled
    (the op with its map traced, the fusion passes on each rank's graph), ~40 s."""
    hf = random_hf_model(tiny_config(family))
    one_sided_router(hf)
    hf.save_pretrained(tmp_path)
    one, one_logits = _run(str(tmp_path), compile_mode=compile_mode)
    two, two_logits = _run(str(tmp_path), compile_mode=compile_mode, tensor_parallel_size=2,
                           enable_expert_parallel=True)
    assert all(len(t) == 32 for t in two) and len({tuple(t) for t in two}) == len(PROMPTS)
    assert two == one
    assert one_logits.std() > 0.1
    assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL


def test_the_roofline_counts_a_ranks_whole_experts():
    """Mixtral-8x7B at two ranks: rank 0 holds 4 whole experts, and at one token expects 2 / 8 of them read (the
    expectation over routings; the rank holding more of the chosen experts sets a step's time)."""
    from ember.bench.roofline import expert_bytes
    from ember.models.bundled import bundled_config
    cfg = bundled_config("mixtral-8x7b", num_hidden_layers=1)
    expert = 3 * 4096 * 14336 * 2                             # one expert's gate, up and down in bf16
    shard = build_on_meta(cfg, torch.bfloat16, None, ShardSpec(0, 2, True))
    assert shard.model.layers[0].mlp.experts.w13.shape == (4, 2 * 14336, 4096)
    assert expert_bytes(shard, 1) == [(4 * expert, expert)]


def test_the_launch_table_is_looked_up_by_a_ranks_whole_experts(tmp_path, monkeypatch):
    """An expert-parallel rank of Mixtral-8x7B (4 experts of intermediate 14336) takes the table's entry for that
    shape as for any; at four ranks (2 experts) the table has none and the constants decide."""
    import json

    from ember.kernels import moe_configs as MC
    from ember.kernels.moe_op import CPU_SMS, launch_for
    from ember.models.bundled import bundled_config
    cfg = bundled_config("mixtral-8x7b", num_hidden_layers=1)
    w13 = [build_on_meta(cfg, torch.bfloat16, None, ShardSpec(0, n, True)).model.layers[0].mlp.experts.w13
           for n in (2, 4)]
    assert [tuple(w.shape) for w in w13] == [(4, 28672, 4096), (2, 28672, 4096)]
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    entry = dict(experts=4, hidden=4096, intermediate=14336, top_k=2, gemv_max_tokens=1,
                 grouped=[{"tokens": 64, "gate_up": tiles, "down": tiles}])
    path = tmp_path / "moe_configs.json"
    path.write_text(json.dumps({"num_sms": CPU_SMS, "element_size": 2, "shapes": [entry]}))
    monkeypatch.setattr(MC, "_table", lambda: MC.load_table(path))
    MC.moe_launch.cache_clear()
    try:
        x = torch.empty(64, 4096, dtype=torch.bfloat16)
        assert launch_for(x, w13[0], 2) == MC.MoeLaunch("grouped", tiles, tiles)
        assert launch_for(x, w13[1], 2) == MC.fallback_launch(MC.MoeShape(64, 2, 4096, 14336, 2, 2, CPU_SMS))
        assert launch_for(x, w13[1], 2).gate_up["BLOCK_M"] == 32             # not the entry's 16
    finally:
        MC.moe_launch.cache_clear()


def test_compiled_graphs_and_triton_markers_are_keyed_by_expert_parallelism(monkeypatch):
    """A rank holding whole experts must not load the graph of a rank holding every expert's share (its MoE calls
    lack the expert map): both the compile cache key and the Triton warm-up marker name the whole shard."""
    from ember.runner import model_runner, warmup

    class Keyed(Exception):
        pass

    def capture(config, dtype, device=None, settings=None):
        raise Keyed(settings["tensor_parallel"])
    monkeypatch.setattr(model_runner, "compile_cache_key", capture)
    monkeypatch.setattr("ember.graphs.artifacts.compile_cache_key", capture)
    ns = types.SimpleNamespace

    def keys(expert_parallel: bool):
        runner = ns(modes=ns(compile_mode="default", cudagraph_mode=ns(name="NONE")), capture_sizes=[1],
                    hf_config=ns(to_dict=dict), dtype=torch.float32, device=torch.device("cpu"), skip_prefill=False,
                    quant=None, config=ns(compile=ns(disabled_fusions=(), cudagraph_capture="eager", jit_warmup=None),
                                          attention_backend="auto", attention_backend_options=(),
                                          cache=ns(block_size=16)),
                    shard=ShardSpec(0, 2, expert_parallel), attn=ns(layers={}), model=torch.nn.Module(),
                    max_num_tokens=8, max_num_reqs=2, table=ns(max_model_len=64))
        found = []
        for build in (lambda: model_runner.ModelRunner._build_forward(runner), lambda: warmup._marker(runner)):
            with pytest.raises(Keyed) as keyed:
                build()
            found.append(keyed.value.args[0])
        return found

    assert keys(False) == [(0, 2, False)] * 2
    assert keys(True) == [(0, 2, True)] * 2
