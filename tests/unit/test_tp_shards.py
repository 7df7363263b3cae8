"""Tensor-parallel shards without processes: the shard rules, what each rank's layers load from a checkpoint (only its
slices, placed as the rules say), the fusion passes over a shard, and the GEMV tables' fallbacks for its shapes."""

import pytest
import torch

from ember.distributed.shard import CheckpointSlice, ShardSpec, kv_heads, split, vocab_range
from ember.models.loader import load_model
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.helpers.tp_ranks import record_slice_reads


def test_heads_split_evenly_and_kv_heads_replicate_below_the_rank_count():
    assert split(32, ShardSpec(1, 4), "num_attention_heads") == 8
    assert kv_heads(8, 32, ShardSpec(3, 4)) == (2, 6)               # ranks hold KV heads 0-1, 2-3, 4-5, 6-7
    assert [kv_heads(2, 8, ShardSpec(r, 4)) for r in range(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [kv_heads(1, 4, ShardSpec(r, 2)) for r in range(2)] == [(1, 0), (1, 0)]
    with pytest.raises(ValueError, match="num_attention_heads 6 is not divisible by tensor_parallel_size 4"):
        kv_heads(2, 6, ShardSpec(0, 4))
    with pytest.raises(ValueError, match="num_key_value_heads 3 is fewer than tensor_parallel_size 4"):
        kv_heads(3, 12, ShardSpec(0, 4))
    with pytest.raises(ValueError, match="num_key_value_heads 6 is not divisible by tensor_parallel_size 4"):
        kv_heads(6, 12, ShardSpec(0, 4))


def test_vocab_ranges_cover_the_vocabulary_once_the_last_one_padded():
    ranges = [vocab_range(317, ShardSpec(r, 2)) for r in range(2)]
    assert ranges == [(0, 159, 159), (159, 158, 159)]
    assert [vocab_range(128256, ShardSpec(r, 4))[:2] for r in (0, 3)] == [(0, 32064), (96192, 32064)]


def test_a_checkpoint_slice_checks_the_size_it_was_cut_from():
    CheckpointSlice(1, 32, 32, 64).check((48, 64))
    with pytest.raises(ValueError, match=r"shape \(48, 60\), expected 64 along dim 1 \(this rank reads \[32, 64\)"):
        CheckpointSlice(1, 32, 32, 64).check((48, 60))


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def checkpoint(request, tmp_path_factory):
    """(family, folder, whole ember model): Llama with 4 query / 2 KV heads, Gemma 2 with 4 / 1 (replicated at
    two ranks); vocabulary 317, which two ranks split unevenly."""
    overrides = {"num_key_value_heads": 1} if request.param == "gemma2" else {}
    config = tiny_config(request.param, vocab_size=317, **overrides)
    path = tmp_path_factory.mktemp(f"shards_{request.param}")
    random_hf_model(config).save_pretrained(path)
    return request.param, path, load_model(path, None, torch.float32, "cpu", progress=False)


def _shards(path, monkeypatch):
    """Both ranks' shards of the checkpoint, and the names of the tensors each read as slices."""
    sliced = record_slice_reads(monkeypatch)
    shards = [load_model(path, None, torch.float32, "cpu", progress=False, shard=ShardSpec(r, 2)) for r in range(2)]
    return shards, sliced


def test_each_rank_loads_its_slices(checkpoint, monkeypatch):
    family, path, whole = checkpoint
    (rank0, rank1), sliced = _shards(path, monkeypatch)
    full = dict(whole.named_parameters())
    attn = whole.model.layers[0].self_attn
    d, hq, hkv = attn.head_size, attn.num_heads, attn.num_kv_heads
    q_rows = hq * d
    for rank, shard in enumerate((rank0, rank1)):
        params = dict(shard.named_parameters())
        assert params.keys() == full.keys()
        for name, param in params.items():
            ref = full[name]
            if name.endswith("qkv_proj.weight"):
                kv = rank if hkv == 2 else 0          # one KV head: both ranks hold it
                q = ref[rank * q_rows // 2:(rank + 1) * q_rows // 2]
                k = ref[q_rows + kv * d:q_rows + (kv + 1) * d]
                v = ref[q_rows + hkv * d + kv * d:q_rows + hkv * d + (kv + 1) * d]
                expected = torch.cat([q, k, v])
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                cols = ref.shape[1] // 2
                expected = ref[:, rank * cols:(rank + 1) * cols]
            elif name.endswith("gate_up_proj.weight"):
                half, n = ref.shape[0] // 2, ref.shape[0] // 4
                expected = torch.cat([ref[rank * n:(rank + 1) * n], ref[half + rank * n:half + (rank + 1) * n]])
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                expected = torch.cat([ref[rank * 159:(rank + 1) * 159], torch.zeros(rank, ref.shape[1])])
            else:                                     # norms: replicated
                expected = ref
            assert torch.equal(param, expected), name
        assert shard.model.layers[0].self_attn.attn.options.num_heads == 2
        assert shard.model.layers[0].self_attn.attn.options.num_kv_heads == 1     # 2 split, or 1 replicated
    # every sharded tensor was read as a slice, each rank its own: the embedding, and q/k/v, o, gate/up, down
    per_rank = 1 + (0 if family == "gemma2" else 1) + 7 * len(whole.model.layers)
    assert len(sliced) == 2 * per_rank


@pytest.fixture
def group_of_one(tmp_path):
    """This process as a tensor-parallel group of one (gloo): a shard's collectives run, and return their input."""
    import torch.distributed as dist
    from ember.distributed.parallel_state import init_tensor_parallel, leave_tensor_parallel
    store = dist.FileStore(str(tmp_path / "store"), 1)
    init_tensor_parallel(0, 1, 0, "cpu", store, 60.0)
    yield
    leave_tensor_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fusion_passes_on_a_shard_leave_the_reduced_projections_alone(family, group_of_one):
    """Rank 0's shard of two, traced whole: q/k/v and gate/up take their norm (and SiLU) fusions as on one rank; o
    and down, whose all-reduce comes before the residual add, take no residual epilogue of their own, but rank 0's
    take the residual into the reduce (Llama; Gemma 2 norms the reduced output before its add); the output is
    unchanged."""
    from ember.attention_backends.op import ForwardContext
    from ember.models.loader import random_model
    from tests.helpers.model_harness import ModelHarness
    from tests.helpers.post_grad import count_calls, fused_and_reference
    model = random_model(tiny_config(family), torch.float32, shard=ShardSpec(0, 2))
    harness = ModelHarness(model, 2)
    common, positions = harness._metadata([(0, [1, 2, 3]), (1, [4, 5])])
    ids = torch.tensor([1, 2, 3, 4, 5])
    context = ForwardContext(layers=harness.layers, attn_metadata=(harness.builder.build(common),))
    layers = model.config.num_hidden_layers
    pipeline, gm, out, reference = fused_and_reference(model, ids, positions, context)
    assert pipeline.counts["rms_norm_prologue"] == 2 * layers and pipeline.counts["silu_mul_epilogue"] == (
        layers if family == "llama" else 0)                    # Gemma's gelu-tanh is no SiLU
    folded = 2 * layers if family == "llama" else 0
    assert pipeline.counts["residual_epilogue"] == 0 and pipeline.counts["residual_all_reduce"] == folded
    assert count_calls(gm, torch.ops.ember.all_reduce.default) == 1 + 2 * layers     # the embedding, o, down
    assert count_calls(gm, torch.ops.ember.linear.default) == 2 * layers - folded   # o and down, unfused
    reduces = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.ember.all_reduce.default]
    assert not [u for n in reduces for u in n.users if u.target is torch.ops.aten.add.Tensor]   # no add after one
    assert (out - reference).abs().max().item() <= 1e-6 * reference.abs().max().item()


@pytest.mark.parametrize("config", ["llama-3.1-8b", "llama-3.1-70b"])
def test_shard_shapes_missing_from_the_gemv_tables_take_the_fallbacks(config):
    """Every rank's projection shape at 2 and 4 ranks routes (the nearest measured crossover, or the constant) and
    launches without a stored shape unless one was measured for it."""
    from ember.kernels import gemv_routing as R
    from ember.models.bundled import bundled_config
    cfg = bundled_config(config)
    d = cfg.hidden_size // cfg.num_attention_heads
    crossover, shapes = R.load_table(), R.load_shapes()
    for tp in (2, 4):
        weights = {(cfg.num_attention_heads // tp + 2 * cfg.num_key_value_heads // tp) * d: cfg.hidden_size,
                   cfg.hidden_size: cfg.intermediate_size // tp, 2 * cfg.intermediate_size // tp: cfg.hidden_size}
        for n, k in weights.items():
            for gated in (False, True):
                rows = R.gemv_max_rows(n, k, gated)
                assert rows == crossover.get((n, k, gated), rows) and 1 <= rows <= 16
                assert R.launch_shape(n, k, gated, 132, 2) == shapes.get((n, k, gated, 132, 2))
        assert R.gemv_max_rows(n, k, False, table=()) == R.FALLBACK_MAX_ROWS      # no table: the constant


def test_experts_and_fp8_layers_split_on_a_shard():
    from ember.models.bundled import bundled_config
    from ember.models.loader import build_on_meta
    from ember.quant import QuantConfig
    cfg = bundled_config("qwen3-30b-a3b", num_hidden_layers=1)
    experts = build_on_meta(cfg, torch.bfloat16, None, ShardSpec(1, 2)).model.layers[0].mlp.experts
    assert (experts.w13.shape, experts.w2.shape) == ((128, 768, 2048), (128, 2048, 384))     # 768 / 2 of each
    fp8 = QuantConfig(source="online", weight_strategy="channel", activation="dynamic")
    mlp = build_on_meta(tiny_config("llama"), torch.bfloat16, fp8, ShardSpec(1, 2)).model.layers[0].mlp
    assert mlp.down_proj.weight.dtype == torch.float8_e4m3fn and mlp.down_proj.weight.shape == (64, 48)
    assert mlp.gate_up_proj.weight.shape == (96, 64) and mlp.gate_up_proj.scale.shape == (96,)


def test_the_roofline_counts_one_ranks_bytes():
    from ember.bench.roofline import decode_weight_bytes, kv_bytes_per_token
    from ember.models.bundled import bundled_config
    from ember.models.loader import build_on_meta
    cfg = bundled_config("llama-3.1-8b", num_hidden_layers=2)
    whole = kv_bytes_per_token(cfg, torch.bfloat16)
    assert kv_bytes_per_token(cfg, torch.bfloat16, 2) * 2 == whole
    assert kv_bytes_per_token(cfg, torch.bfloat16, 16) * 8 == whole        # 8 KV heads, each on two of 16 ranks
    one = decode_weight_bytes(build_on_meta(cfg, torch.bfloat16), cfg)
    two = decode_weight_bytes(build_on_meta(cfg, torch.bfloat16, shard=ShardSpec(1, 2)), cfg)
    norms = 2 * (2 * 2 + 1) * cfg.hidden_size           # replicated: two norms a layer and the final one, bf16
    assert two == (one - norms) // 2 + norms


def test_each_rank_reads_its_kv_heads_of_per_head_kv_cache_scales(tmp_path):
    from safetensors.torch import load_file, save_file
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)          # 2 KV heads
    tensors = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.5, 2.0])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for rank, k in enumerate((0.5, 2.0)):
        shard = load_model(tmp_path, None, torch.float32, "cpu", progress=False, shard=ShardSpec(rank, 2))
        attn = shard.model.layers[1].self_attn.attn
        assert attn.kv_heads_in_model == (rank, 2)
        assert attn.kv_scales[0].tolist() == [k] and attn.kv_scales[1].tolist() == [0.25]


@pytest.mark.parametrize("flags, value", [([], None), (["--symm-mem-all-reduce"], True),
                                          (["--no-symm-mem-all-reduce"], False)])
def test_the_one_shot_all_reduce_is_asked_for_refused_or_left_to_the_default(flags, value):
    import argparse

    from ember.args import add_engine_args, engine_kwargs
    from ember.config import ParallelConfig
    from ember.distributed.symm_mem import one_shot_by_default
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(flags))["symm_mem_all_reduce"] is value
    config = ParallelConfig(tensor_parallel_size=2, symm_mem_all_reduce=value)
    if value:
        with pytest.raises(ValueError, match="symm_mem_all_reduce needs CUDA"):
            config.validate("cpu")
    else:
        config.validate("cpu")                  # the default and an explicit off are fine on the CPU
    assert one_shot_by_default(None, None) is False and one_shot_by_default(None, torch.device("cpu")) is False
