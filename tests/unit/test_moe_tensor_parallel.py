"""Mixtures of experts under tensor parallelism (float32, CPU): each rank loads its share of every expert's
intermediate dimension (per-expert and stacked checkpoints) and its partial outputs sum to the whole block's; an
intermediate size the ranks cannot split is refused at start-up; the launch table is looked up by a rank's shape;
the bench's roofline counts a rank's share; the residual add stays after the all-reduce; and, over gloo in two
processes, Qwen3-MoE (experts beside a dense layer) and Mixtral give one rank's greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch

from ember.distributed.shard import ShardSpec
from ember.models import loader
from ember.models.loader import build_on_meta, load_model
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.unit.test_tensor_parallel import LOGITS_ATOL, PROMPTS, run_both

FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, folder, whole ember model) of a tiny random model (8 experts, top 2; intermediate 32 or 48)."""
    path = tmp_path_factory.mktemp(f"moe_tp_{request.param}")
    hf = random_hf_model(tiny_config(request.param))
    hf.save_pretrained(path)
    return request.param, path, hf, load_model(path, None, torch.float32, "cpu", progress=False)


def _shards(path, monkeypatch):
    """Both ranks' shards of the checkpoint, and the names of the expert tensors each read as slices."""
    sliced = []
    read_slice = loader._read_slice

    def spy(f, name, piece):
        sliced.append((name, piece.dim, piece.start, piece.length))
        return read_slice(f, name, piece)
    monkeypatch.setattr(loader, "_read_slice", spy)
    shards = [load_model(path, None, torch.float32, "cpu", progress=False, shard=ShardSpec(r, 2)) for r in range(2)]
    return shards, [s for s in sliced if ".experts." in s[0]]


def _expected_slices(experts, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank` of two's w13 and w2, cut from the whole model's."""
    size = experts.intermediate_size
    half = size // 2
    rows = slice(rank * half, (rank + 1) * half)
    w13 = torch.cat([experts.w13[:, :size][:, rows], experts.w13[:, size:][:, rows]], dim=1)
    return w13, experts.w2[:, :, rows]


def test_each_rank_loads_its_share_of_every_expert(checkpoint, monkeypatch):
    family, path, _, whole = checkpoint
    (rank0, rank1), sliced = _shards(path, monkeypatch)
    moe_layers = [i for i, layer in enumerate(whole.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe_layers == ([0, 2] if family == "qwen3_moe" else [0, 1])
    for rank, shard in enumerate((rank0, rank1)):
        for i in moe_layers:
            ours, ref = shard.model.layers[i].mlp, whole.model.layers[i].mlp
            w13, w2 = _expected_slices(ref.experts, rank)
            full = ref.experts.intermediate_size
            assert (ours.experts.intermediate_size, ours.experts.full_intermediate_size) == (full // 2, full)
            assert ours.experts.w13.shape == (8, full, 64) and torch.equal(ours.experts.w13, w13)
            assert ours.experts.w2.shape == (8, 64, full // 2) and torch.equal(ours.experts.w2, w2)
            assert torch.equal(ours.gate.weight, ref.gate.weight)             # the router: replicated
        if family == "qwen3_moe":      # mlp_only_layers=[1]: a dense MLP, column/row-parallel as in Llama
            dense, ref = shard.model.layers[1].mlp, whole.model.layers[1].mlp
            assert torch.equal(dense.down_proj.weight, ref.down_proj.weight[:, rank * 48:(rank + 1) * 48])
    # every expert tensor read as a slice: 8 experts x (gate, up, down) a layer, rows of gate / up, columns of down
    full = whole.model.layers[0].mlp.experts.intermediate_size
    assert len(sliced) == 2 * len(moe_layers) * 8 * 3
    assert {(dim, start, length) for _, dim, start, length in sliced} == {
        (d, r * full // 2, full // 2) for d in (0, 1) for r in (0, 1)}


def test_a_stacked_checkpoint_gives_each_rank_the_same_share(checkpoint, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]): a rank
    takes its rows of both halves of gate_up and its columns of down."""
    from safetensors.torch import save_file
    family, path, hf, whole = checkpoint
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    for rank in range(2):
        shard = load_model(tmp_path, None, torch.float32, "cpu", progress=False, shard=ShardSpec(rank, 2))
        w13, w2 = _expected_slices(whole.model.layers[0].mlp.experts, rank)
        experts = shard.model.layers[0].mlp.experts
        assert torch.equal(experts.w13, w13) and torch.equal(experts.w2, w2)


def test_the_ranks_partial_outputs_sum_to_the_whole_block(checkpoint, monkeypatch):
    """Each rank routes alike (the replicated router) and its experts' share gives a partial sum; the two sum to the
    whole block's output. The all-reduce is the block's, once: here it is stood in for by the sum."""
    from ember.models.layers import moe as moe_layer
    family, path, _, whole = checkpoint
    (rank0, rank1), _ = _shards(path, monkeypatch)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    reduced = []
    monkeypatch.setattr(moe_layer, "all_reduce", lambda out, group: reduced.append(group) or out)
    with torch.no_grad():
        expected = whole.model.layers[0].mlp(x)
        parts = [shard.model.layers[0].mlp(x) for shard in (rank0, rank1)]
    assert reduced == ["tp", "tp"]                                    # one all-reduce a block and rank
    assert expected.abs().max() > 0.01 and parts[0].abs().max() > 0.01
    assert (parts[0] + parts[1] - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family, field, size", [("mixtral", "intermediate_size", 49),
                                                 ("qwen3_moe", "moe_intermediate_size", 33)])
def test_an_intermediate_size_the_ranks_cannot_split_is_refused_at_start_up(family, field, size, tmp_path):
    from ember import LLM
    message = f"the MoE experts' intermediate size {size} is not divisible by tensor_parallel_size 2"
    with pytest.raises(ValueError, match=message):
        build_on_meta(tiny_config(family, **{field: size}), torch.float32, None, ShardSpec(1, 2))
    random_hf_model(tiny_config(family, **{field: size})).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):            # before any worker starts
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2)
    assert build_on_meta(tiny_config(family, **{field: size}), torch.float32, None).model.layers[0].mlp.experts \
        .w2.shape == (8, 64, size)                             # one rank: any size


def test_the_launch_table_is_looked_up_by_a_ranks_shape(tmp_path, monkeypatch):
    """The Mixtral-8x7B layer at two ranks takes the entry for intermediate 7168, not 14336's; a rank's shape the
    table lacks takes the constants."""
    import json

    from ember.kernels import moe_configs as MC
    from ember.kernels.moe_op import CPU_SMS, launch_for
    from ember.models.bundled import bundled_config
    cfg = bundled_config("mixtral-8x7b", num_hidden_layers=1)
    experts = [build_on_meta(cfg, torch.bfloat16, None, ShardSpec(0, tp)).model.layers[0].mlp.experts
               for tp in (1, 2, 4)]
    assert [e.w2.shape[2] for e in experts] == [14336, 7168, 3584]
    tiles = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)

    def entry(intermediate, block_m):
        grouped = [{"tokens": 64, "gate_up": dict(tiles, BLOCK_M=block_m), "down": dict(tiles, BLOCK_M=block_m)}]
        return dict(experts=8, hidden=4096, intermediate=intermediate, top_k=2, gemv_max_tokens=1, grouped=grouped)
    path = tmp_path / "moe_configs.json"
    path.write_text(json.dumps({"num_sms": CPU_SMS, "element_size": 2,
                                "shapes": [entry(14336, 16), entry(7168, 32)]}))
    monkeypatch.setattr(MC, "_table", lambda: MC.load_table(path))
    MC.moe_launch.cache_clear()
    try:
        x = torch.empty(64, 4096, dtype=torch.bfloat16)
        launches = [launch_for(x, e.w13, 2) for e in experts]
        assert [launch.gate_up["BLOCK_M"] for launch in launches[:2]] == [16, 32]
        rank_of_four = MC.MoeShape(64, 8, 4096, 3584, 2, 2, CPU_SMS)
        assert launches[2] == MC.fallback_launch(rank_of_four) and launches[2].path == "grouped"
    finally:
        MC.moe_launch.cache_clear()


def test_the_roofline_counts_a_ranks_share_of_the_chosen_experts():
    from ember.bench.roofline import expert_bytes
    from ember.models.bundled import bundled_config
    cfg = bundled_config("mixtral-8x7b", num_hidden_layers=1)
    whole, half = (expert_bytes(build_on_meta(cfg, torch.bfloat16, None, ShardSpec(0, tp)), 1) for tp in (1, 2))
    expert = 3 * 4096 * 14336 * 2                             # one expert's gate, up and down in bf16
    assert whole == [(8 * expert, 2 * expert)]                # top 2 of 8 at one token
    assert half == [(4 * expert, expert)]                     # half of each, on each rank


def test_the_residual_add_stays_after_the_all_reduce():
    """On a shard the block's output is all-reduced before the residual add: residual_epilogue must not fold the add
    into the op (each rank would add the residual, and the sum would hold it twice)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.distributed.ops import all_reduce
    from ember.graphs.passes.residual_epilogue import fuse_residual_epilogue
    from ember.kernels.moe_op import moe
    x, logits, residual = torch.randn(3, 16), torch.randn(3, 4), torch.randn(3, 16)
    w13, w2 = torch.randn(4, 24, 16), torch.randn(4, 16, 12)

    def layer(x, logits, residual, w13, w2):
        return all_reduce(moe(x, logits, w13, w2, 2, True), "tp") + residual

    gm = make_fx(layer, tracing_mode="fake")(x, logits, residual, w13, w2)
    assert fuse_residual_epilogue(gm.graph) == 0
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == ["ember.moe.default", "ember.all_reduce.default", "aten.add.Tensor"]


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_two_ranks_give_one_ranks_tokens_and_logits(family, tmp_path):
    """Qwen3-MoE: experts in layers 0 and 2, a dense MLP in layer 1; Mixtral: experts in every layer, a sliding
    window of 8. Greedy tokens over 32 steps, and teacher-forced logits within 1e-4."""
    random_hf_model(tiny_config(family)).save_pretrained(tmp_path)
    (one, _, one_logits, _), (two, _, two_logits, _) = run_both(str(tmp_path), device="cpu")
    assert all(len(t) == 32 for t in two) and len({tuple(t) for t in two}) == len(PROMPTS)
    assert two == one
    assert one_logits.std() > 0.1
    assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL


@pytest.mark.slow      # ~10 s: a trace of the whole shard
def test_fusion_passes_on_a_moe_shard_keep_one_all_reduce_a_block(tmp_path):
    """Rank 0's Qwen3-MoE shard of two, traced whole, through the fusion pipeline: one all-reduce after each
    attention and each MLP (experts or dense) and one for the embedding, none folded away or doubled; rank 0's
    residual adds go into the reduces (the MoE op and each reduced projection take the residual, the reduce's
    output is the new residual stream); the output unchanged."""
    import torch.distributed as dist

    from ember.attention_backends.op import ForwardContext
    from ember.distributed.parallel_state import init_tensor_parallel, leave_tensor_parallel
    from ember.models.loader import random_model
    from tests.helpers.model_harness import ModelHarness
    from tests.helpers.post_grad import count_calls, fused_and_reference
    init_tensor_parallel(0, 1, 0, "cpu", dist.FileStore(str(tmp_path / "store"), 1), 60.0)
    try:
        model = random_model(tiny_config("qwen3_moe"), torch.float32, shard=ShardSpec(0, 2))
        harness = ModelHarness(model, 2)
        common, positions = harness._metadata([(0, [1, 2, 3]), (1, [4, 5])])
        ids = torch.tensor([1, 2, 3, 4, 5])
        context = ForwardContext(layers=harness.layers, attn_metadata=(harness.builder.build(common),))
        pipeline, gm, out, reference = fused_and_reference(model, ids, positions, context)
    finally:
        leave_tensor_parallel()
    layers = model.config.num_hidden_layers
    assert pipeline.counts["residual_epilogue"] == 0 and pipeline.counts["residual_all_reduce"] == 2 * layers
    assert count_calls(gm, torch.ops.ember.all_reduce.default) == 1 + 2 * layers
    reduces = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.ember.all_reduce.default]
    assert not [u for n in reduces for u in n.users if u.target is torch.ops.aten.add.Tensor]   # no add after one
    moe_calls = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == "ember.moe.default"]
    assert len(moe_calls) == 2 and all(len(n.args) == 7 and n.args[6] is not None for n in moe_calls)
    assert [str(u.target) for n in moe_calls for u in n.users] == ["ember.all_reduce.default"] * 2
    assert (out - reference).abs().max().item() <= 1e-6 * reference.abs().max().item()
