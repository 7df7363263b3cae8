"""FP8 linear layers under tensor parallelism on the CPU (float32 compute, gloo): each rank loads only its slices of
every layout's weights and scales, and two ranks in two processes give one rank's logits and greedy tokens, as
closely as the layout's activation rounding allows; a block size that a shard would cut is refused at start-up.

How closely, and why:
- Static per-tensor activations and 128x128 blocks (activations rounded per token and 128 columns, and every shard
  boundary on a block): each rank rounds its columns of x exactly as one rank rounds them, so two ranks differ from
  one only where float32 sums round differently (a row-parallel layer's two partial sums, added by the all-reduce):
  ~2e-7 of logits of std ~0.9. Such a difference can now and then move an activation across an e4m3 rounding
  boundary, one rounding step: one of the 18 Qwen3 block positions moved by 0.043 that way.
- Dynamic per-token activations (online, compressed-tensors per channel): a row-parallel rank scales its half of
  each token by that half's amax (no collective for the amax), so its rounding is another draw of the same e4m3
  error, not one rank's: logits move by 0.64-0.87 of what fp8 itself moves them from the float model, and two ranks
  are as close to the float model as one (0.97-1.03 of one rank's distance). Online, a row-parallel rank also
  quantizes its half of each weight row with that half's scale. Greedy tokens are not compared for these layouts:
  the tiny random models' top-2 margins along the greedy path (0.002-0.003) are a hundredth of the change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.distributed.shard import ShardSpec
from ember.models.layers.scaled_linear import ScaledLinear
from ember.quant import QuantConfigError
from tests.helpers.fp8_checkpoint import LAYOUTS, quantization_config, save_fp8_checkpoint
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.helpers.tp_ranks import load, rank_results, record_slice_reads, run_ranks

# q, k and v 256 rows a rank (two heads of 128, one KV head of 128), gate and up 256, o and down 256 input columns:
# every shard whole 128x128 blocks
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
SAME_ROUNDING = ("fp8-tensor", "ct-tensor", "fp8-block", "ct-block")
PER_TOKEN = ("online", "ct-channel")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """folders(family) -> {layout: a loader spec ("folder" or "folder:fp8")}; layout "float" is the unquantized
    model. Each family's checkpoints are written once, when a test first asks for them."""
    root = tmp_path_factory.mktemp("fp8_tp")
    made: dict[str, dict[str, str]] = {}

    def of(family: str) -> dict[str, str]:
        if family not in made:
            source = root / family
            name, _, bias = family.partition("_")         # "llama_bias": every projection with a bias
            config = tiny_config(name, **SHAPE, **(dict(attention_bias=True, mlp_bias=True) if bias else {}))
            random_hf_model(config, seed=3).save_pretrained(source)
            specs = {"float": str(source), "online": f"{source}:fp8"}
            for layout in LAYOUTS:
                specs[layout] = str(save_fp8_checkpoint(source, root / f"{family}-{layout}", layout))
            made[family] = specs
        return made[family]
    return of


@pytest.mark.parametrize("layout", ("online",) + LAYOUTS)
def test_each_rank_reads_its_slices_of_weights_and_scales(folders, layout, monkeypatch):
    """Without processes: rank r's fp8 weights and scales are rows (q/k/v, gate/up) or columns (o, down) of the whole
    model's, read as slices; per-tensor scales and a row-parallel layer's per-channel scales whole on each rank."""
    whole = load(folders("llama")[layout])
    sliced = record_slice_reads(monkeypatch)
    shards = [load(folders("llama")[layout], ShardSpec(r, 2)) for r in range(2)]
    checked = 0
    for name, layer in whole.named_modules():
        if not isinstance(layer, ScaledLinear):
            continue
        parts = [shard.get_submodule(name) for shard in shards]
        w, s = layer.weight.view(torch.uint8), layer.scale
        block = layer.block is not None
        if name.endswith(("o_proj", "down_proj")):                      # row-parallel: columns of the input
            k = layer.in_features // 2
            for r, part in enumerate(parts):
                assert part.reduces and part.input_range == (r * k, k, 2 * k)
                if layout != "online":
                    assert torch.equal(part.weight.view(torch.uint8), w[:, r * k:(r + 1) * k])
                if block:
                    assert torch.equal(part.scale, s[:, r * k // 128:(r + 1) * k // 128])
                elif layout != "online":
                    assert torch.equal(part.scale, s)                    # per tensor or per channel: whole
            if layout == "online":
                # each rank quantizes its half of every row by that half's amax: the whole row's scale is the larger
                halves = torch.stack([p.scale for p in parts])
                assert torch.equal(halves.amax(0), s) and (halves[0] != halves[1]).float().mean() > 0.9
        else:                                                           # column-parallel: rows of each part
            offsets = [sum(layer.full_sizes[:i]) for i in range(len(layer.full_sizes))]
            for r, part in enumerate(parts):
                rows = torch.cat([torch.arange(o + start, o + start + n)
                                  for o, (start, n) in zip(offsets, part.shard_ranges)])
                assert part.weight.shape[0] == layer.weight.shape[0] // 2 and not part.reduces
                assert torch.equal(part.weight.view(torch.uint8), w[rows])
                # per channel (online too: a column-parallel row is whole, so its scale is one rank's as it is the
                # whole model's), per tensor (each part's own, per row) or per block of 128 rows
                expected = s[rows[::128] // 128] if block else s[rows]
                assert torch.equal(part.scale, expected)
        checked += 1
    assert checked == 4 * 2
    # per rank and layer: each of the 7 checkpoint weights as a slice, and per channel or per block its scale too
    # (gate/up and q/k/v parts' scales; o and down's as well for blocks); the embedding and the untied LM head
    scales = {"online": 0, "fp8-tensor": 0, "ct-tensor": 0, "ct-channel": 5, "fp8-block": 7, "ct-block": 7}[layout]
    assert len(sliced) == 2 * (2 + 2 * (7 + scales))


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                    pytest.param("llama_bias", marks=pytest.mark.slow)])
def test_two_ranks_give_one_ranks_logits_in_every_layout(folders, family, tmp_path):
    """Online and the five checkpoint layouts: two ranks (two processes, gloo) against one. Slow, 17-20 s each:
    Qwen3 (per-head q/k norms between the column-parallel q/k/v and attention), and Llama with a bias on every
    projection (a row-parallel layer adds its bias once, after the all-reduce)."""
    layouts = folders(family)
    specs = list(layouts.values())
    two = run_ranks(specs, tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as each rank runs: two threads of a shared 2-core machine crawl
    try:
        one = {spec: rank_results(load(spec)) for spec in specs}
    finally:
        torch.set_num_threads(threads)

    def rms(t: torch.Tensor) -> float:
        return t.pow(2).mean().sqrt().item()
    for layout, spec in layouts.items():
        a, b, unquantized = one[spec]["logits"], two[spec]["logits"], one[layouts["float"]]["logits"]
        assert a.shape == (18, 320) and a.std() > 0.5
        diff = (b - a).abs()
        fp8_change = rms(a - unquantized)              # how far fp8 moves one rank's logits from the float model
        if layout == "float":
            assert diff.max().item() <= 1e-5 and one[spec]["tokens"] == two[spec]["tokens"]
            continue
        assert 0.05 < fp8_change < 0.2, layout
        if layout in SAME_ROUNDING:
            assert diff.median().item() <= 1e-6, layout
            assert (diff.amax(1) <= 1e-4).sum().item() >= 17, layout   # at most one rounding step moved
            assert rms(b - a) <= 0.05 * fp8_change, layout
            # greedy, 24 tokens each: one rank's top-2 margins along the way are at least 0.002, twenty times the
            # largest difference of a step's logits seen here (5e-5)
            assert two[spec]["tokens"] == one[spec]["tokens"], layout
            assert all(len(t) == 24 for t in two[spec]["tokens"])
        else:
            assert layout in PER_TOKEN
            assert 1e-3 < rms(b - a) <= fp8_change, layout              # another draw, no larger
            assert rms(b - unquantized) <= 1.1 * fp8_change, layout     # and no further from float


def test_biases_split_with_their_rows_and_stay_whole_after_a_reduction(folders):
    spec = folders("llama_bias")["ct-tensor"]
    whole, shards = load(spec), [load(spec, ShardSpec(r, 2)) for r in range(2)]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layer = whole.model.layers[1].get_submodule(name)
        parts = [shard.model.layers[1].get_submodule(name) for shard in shards]
        if name.endswith(("qkv_proj", "gate_up_proj")):
            offsets = [sum(layer.full_sizes[:i]) for i in range(len(layer.full_sizes))]
            for part in parts:
                rows = torch.cat([torch.arange(o + start, o + start + n)
                                  for o, (start, n) in zip(offsets, part.shard_ranges)])
                assert torch.equal(part.bias, layer.bias[rows]), name
        else:
            assert parts[0].reduces and all(torch.equal(p.bias, layer.bias) for p in parts), name
        assert layer.bias.abs().min() > 0


def test_a_shard_that_cuts_weight_blocks_is_refused_at_start_up(tmp_path):
    from ember import LLM
    from ember.models.layers.linear import RowParallelLinear
    from ember.models.loader import build_on_meta
    from ember.quant import resolve_quant_config
    # head_dim 64: each rank's one KV head is 64 rows of k_proj's 128, half a 128-row block
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64)
    config.quantization_config = quantization_config("fp8-block")
    quant = resolve_quant_config(config, None, torch.bfloat16, "cpu")
    with pytest.raises(QuantConfigError, match=r"model.layers.0.self_attn.qkv_proj: the 128x128 weight blocks do not "
                       r"split over tensor_parallel_size 2: this rank would hold rows \[0, 64\) of packed part 1 "
                       r"\(128 rows\)"):
        build_on_meta(config, torch.bfloat16, quant, ShardSpec(0, 2))
    assert build_on_meta(config, torch.bfloat16, quant).model.layers[0].self_attn.qkv_proj.scale.shape == (4, 2)
    # before any worker starts
    random_hf_model(config).save_pretrained(tmp_path / "float")
    folder = save_fp8_checkpoint(tmp_path / "float", tmp_path / "block", "fp8-block")
    with pytest.raises(QuantConfigError, match=r"rows \[0, 64\) of packed part 1 \(128 rows\)"):
        LLM(str(folder), device="cpu", tensor_parallel_size=2)
    # a row-parallel projection of 384 inputs: each rank would hold 192 columns, a block and a half
    from ember.distributed.shard import building
    with torch.device("meta"), building(ShardSpec(1, 2)):
        down = RowParallelLinear(384, 256)
    with pytest.raises(QuantConfigError, match=r"mlp.down_proj: .* tensor_parallel_size 2: this rank would hold input "
                       r"columns \[192, 384\) of 384, not whole 128-column blocks"):
        ScaledLinear.replacing(down, quant, "mlp.down_proj")


def test_fp8_weights_and_kv_cache_in_an_engine_of_two_ranks(folders):
    """End to end: a static per-tensor checkpoint and an fp8 KV cache (each rank quantizes its KV heads' pages), two
    ranks against one, greedy over 16 tokens and teacher-forced logits."""
    from ember import LLM, SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250, 41, 7], [12, 300, 8]]
    results = []
    for tp in (1, 2):
        llm = LLM(folders("llama")["ct-tensor"], device="cpu", dtype="float32", kv_cache_dtype="fp8",
                  tensor_parallel_size=tp, num_kv_blocks=32)
        try:
            runner = llm.engine.runner
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            results.append((tokens, llm.engine.score(list(range(100, 118)))))
        finally:
            runner.shutdown()
    (one, one_logits), (two, two_logits) = results
    assert all(len(t) == 16 for t in two) and two == one
    assert (two_logits - one_logits).abs().max().item() <= 1e-4 and one_logits.std() > 0.5
