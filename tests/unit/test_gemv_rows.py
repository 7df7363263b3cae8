"""Launch shapes of a few rows (`row_shapes` of gemv_shapes.json / gemv_fp8_shapes.json): the sweep's writer and
winner, loading them back, gemv_config taking an entry for its shape and row bucket only, documents without them
behaving as before, and the kernel (interpreted) computing right under every launch the sweep can store."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F

from benches import gemv_row_shapes as RS
from ember.kernels import gemv as G
from ember.kernels import gemv_config as GC
from ember.kernels import gemv_routing as R
from ember.kernels.gemv_routing import RowShape

# weight shapes (output columns, K, gated) of the bundled configs, their tensor-parallel shards and two odd ones
SHAPES = [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True), (4096, 14336, False), (128256, 4096, False),
          (4096, 1024, False), (3072, 1024, True), (1024, 2048, False), (1024, 3072, False), (151936, 1024, False),
          (7168, 4096, True), (3072, 4096, False), (96, 256, False), (40, 72, True)]
# sha256 (first 16 hex digits) of gemv_config's outputs for M 0..17 x element sizes 1, 2, 4 x max_block_k None, 128
# on 132 SMs with the one-row table off, computed with gemv_config as it was before row shapes existed
BEFORE = {'6144x4096': '7ca5d4dbcb9a865b', '4096x4096': '344ade6e2ccdd2ad', '14336x4096g': 'eea0d6652d64b7fe',
          '4096x14336': '58d175a79215d4b4', '128256x4096': '7ca5d4dbcb9a865b', '4096x1024': '2b21b424de64ffe2',
          '3072x1024g': '6ac53f2795888abb', '1024x2048': '18547182ca5a313b', '1024x3072': '3e5ae983e498fb14',
          '151936x1024': '24ec790b66be9865', '7168x4096g': 'eea0d6652d64b7fe', '3072x4096': '344ade6e2ccdd2ad',
          '96x256': 'dce1d3de4b1d107e', '40x72g': 'c01f52d37afe589e'}


def _digest(n, k, gated, sms=132):
    rows = [GC.gemv_config(m, n, k, sms, size, gated=gated, max_block_k=max_block_k)
            for m in range(0, 18) for size in (1, 2, 4) for max_block_k in (None, 128)]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """Points both launch-shape documents into tmp_path and returns a loader that makes them the stored ones."""
    monkeypatch.setattr(R, "SHAPES_PATH", tmp_path / "shapes.json")
    monkeypatch.setattr(R, "FP8_SHAPES_PATH", tmp_path / "fp8_shapes.json")
    monkeypatch.setattr(GC, "launch_shape", lambda *args: None)      # the one-row table stays out of these tests
    read = R._row_shapes.__wrapped__

    def load():
        rows = read()
        monkeypatch.setattr(R, "_row_shapes", lambda: rows)
        GC.cached_config.cache_clear()
        return rows

    load()
    yield load
    GC.cached_config.cache_clear()


def _write(path, entries, measured, num_sms=132, element_size=2):
    return RS.write_row_shapes(path, entries, measured, device="test", num_sms=num_sms, element_size=element_size,
                               command="test")


def test_without_row_entries_gemv_config_is_what_it_was(tables):
    """No document, then a document whose row entries are all for other shapes, SM counts or row buckets: every
    shape x M 0..17 x element size keeps the launch parameters gemv_config gave before row shapes existed."""
    assert {f"{n}x{k}{'g' if g else ''}": _digest(n, k, g) for n, k, g in SHAPES} == BEFORE
    other = RowShape(4, 16384, True, 4, 8)
    entries = [RS.row_entry(6144, 4096, False, 2, other, 1.0, 2.0),         # only bucket 2 of this shape
               RS.row_entry(1000, 4096, False, 4, other, 1.0, 2.0)]         # a shape of the grid's none
    _write(R.SHAPES_PATH, entries, set())
    _write(R.FP8_SHAPES_PATH, [RS.row_entry(4096, 4096, False, 8, other, 1.0, 2.0)], set(), num_sms=114,
           element_size=1)
    assert len(tables()) == 3
    digests = {f"{n}x{k}{'g' if g else ''}": _digest(n, k, g) for n, k, g in SHAPES}
    assert digests.pop("6144x4096") != BEFORE["6144x4096"]                  # its 2-row entry applies...
    assert digests == {key: value for key, value in BEFORE.items() if key != "6144x4096"}
    for m in (1, *range(3, 17)):                                             # ...and no other row count
        for size in (1, 2):
            with RS.forced_row_shape(None):
                expected = GC.gemv_config(m, 6144, 4096, 132, size)
            assert GC.gemv_config(m, 6144, 4096, 132, size) == expected


def test_the_sweep_writes_its_winners_and_gemv_config_takes_them_at_their_rows(tables):
    """Fake timings through the sweep's pick and writer, loaded back: the 4-row winner serves 3 and 4 rows of its
    shape (its bucket), not 2 or 5..16 rows, other shapes or other SM counts; a loser is not stored; the document's
    one-row shapes are kept."""
    R.SHAPES_PATH.write_text(json.dumps(dict(command="one row", device="H100", num_sms=132, element_size=2, shapes=[
        dict(n=28672, k=4096, gated=True, programs_per_sm=4, w_tile_bytes=16384)], tma_shapes=[])))
    dot = RowShape(2, 16384, True, 4, 8)
    cuda = RowShape(4, 16384, False, None, 8)
    won = RS.pick({None: 30.0, dot: 27.0, cuda: 28.0})                       # 10% under the constants
    assert won == dot
    assert RS.pick({None: 30.0, dot: 29.5, cuda: 29.4}) is None             # within the margin
    assert RS.pick({None: 30.0, dot: 31.0}) is None                         # the constants win
    fp8_won = RS.pick({None: 10.0, cuda: 9.0})
    doc = _write(R.SHAPES_PATH, [RS.row_entry(28672, 4096, True, 4, won, 27.0, 30.0)],
                 {(28672, 4096, True, 4), (28672, 4096, True, 2)})
    assert doc["shapes"][0]["programs_per_sm"] == 4 and doc["row_shapes"][0]["rows"] == 4
    _write(R.FP8_SHAPES_PATH, [RS.row_entry(6144, 4096, False, 2, fp8_won, 9.0, 10.0)], {(6144, 4096, False, 2)},
           element_size=1)
    assert R.load_shapes(R.SHAPES_PATH) == {(28672, 4096, True, 132, 2): (4, 16384)}
    assert R.load_row_shapes(R.SHAPES_PATH) == {(28672, 4096, True, 132, 2, 4): dot}
    assert R.load_row_shapes(R.FP8_SHAPES_PATH) == {(6144, 4096, False, 132, 1, 2): cuda}
    tables()

    def config(m, n=14336, sms=132, size=2, gated=True, **kw):
        return GC.gemv_config(m, n, 4096, sms, size, gated=gated, **kw)

    with RS.forced_row_shape(None):
        constants = {m: config(m) for m in range(1, 17)}
        other_sms = {m: config(m, sms=114) for m in range(1, 17)}
        fp8_constants = {m: config(m, n=6144, size=1, gated=False) for m in (2, 3)}
    for m in (3, 4):        # the tensor-core entry: 16 x 16 tiles, a 16 KiB W tile halved for the gate and up rows
        assert config(m) != constants[m]
        assert (config(m)["USE_DOT"], config(m)["num_stages"], config(m)["num_warps"]) == (True, 4, 8)
        assert config(m)["BLOCK_K"] == 16384 // 2 // 16 // 2
        assert constants[m]["USE_DOT"] is False
    for m in (1, 2, *range(5, 17)):
        assert config(m) == constants[m]
    assert {m: config(m, sms=114) for m in range(1, 17)} == other_sms
    assert config(4, use_dot=False) == GC.gemv_config(4, 14336, 4096, 132, 2, gated=True, use_dot=False) \
        == constants[4]                                                      # a caller's path is its own
    # the fp8 entry: 2 rows only (bucket 2), 8 warps on CUDA cores
    assert config(2, n=6144, size=1, gated=False)["num_warps"] == 8 and fp8_constants[2]["num_warps"] == 4
    assert config(3, n=6144, size=1, gated=False) == fp8_constants[3]
    assert config(2, n=6144, size=2, gated=False) == GC.gemv_config(2, 6144, 4096, 132, 2)

    # a second run that times 4 rows again and finds no winner removes the entry, keeping the one-row shapes
    doc = _write(R.SHAPES_PATH, [], {(28672, 4096, True, 4)})
    assert doc["row_shapes"] == [] and doc["shapes"][0]["n"] == 28672


def test_a_document_without_row_shapes_loads_as_before(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(dict(num_sms=132, element_size=2, shapes=[
        dict(n=6144, k=4096, gated=False, programs_per_sm=8, w_tile_bytes=16384)])))
    assert R.load_row_shapes(path) == {}
    assert R.load_shapes(path) == {(6144, 4096, False, 132, 2): (8, 16384)}
    assert R.load_row_shapes(tmp_path / "absent.json") == {}
    path.write_text(json.dumps(dict(num_sms=132, element_size=2, shapes=[], row_shapes=[
        dict(n=1, k=1, gated=False, rows=1, programs_per_sm=2, w_tile_bytes=8192, use_dot=False)])))
    with pytest.warns(UserWarning, match="rows >= 2"):
        assert R.load_row_shapes(path) == {}
    for stored in (R.SHAPES_PATH, R.FP8_SHAPES_PATH):       # the shipped documents parse, row entries or not
        for (*_, rows), shape in R.load_row_shapes(stored).items():
            assert 2 <= rows <= G.GEMV_MAX_M and shape.w_tile_bytes in (8192, 16384)


def test_row_buckets_take_the_nearest_measured_row_count(monkeypatch):
    a, b, c = RowShape(2, 8192, False), RowShape(4, 8192, False), RowShape(2, 16384, True, 4, 4)
    monkeypatch.setattr(R, "_row_shapes", lambda: {(8, 8, False, 4, 2): {4: a, 5: b, 8: c}})
    assert [R.row_shape(8, 8, False, 4, 2, m) for m in range(1, 17)] == \
        [None, None, a, a, b, b, c, c] + [None] * 8
    assert R.row_shape(8, 8, True, 4, 2, 4) is None and R.row_shape(8, 8, False, 4, 1, 4) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,gated", [(3, 40, 512, False), (5, 24, 640, True)])
def test_the_kernel_is_right_under_every_launch_the_sweep_can_store(M, N, K, gated, dtype):
    """Interpreted (CPU, G.CPU_SMS SMs), with the fusions the passes use (RMSNorm prologue, residual epilogue),
    under each distinct candidate of the sweep at this shape and row count, tensor-core ones included (warps and
    stages, which the interpreter ignores, once each)."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(dtype)
    weight = (torch.randn(2 * N if gated else N, K, generator=g) * K ** -0.5).to(dtype)
    norm = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    residual = torch.randn(M, N, generator=g).to(dtype)
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()
    y = F.linear(h.to(dtype).float(), weight.float())
    reference = (F.silu(y[:, :N]) * y[:, N:] if gated else y) + residual.float()
    grid = RS.candidates(M, N, K, gated, G.CPU_SMS, x.element_size())
    launches = []
    for shape in grid:
        with RS.forced_row_shape(shape):
            config = GC.gemv_config(M, N, K, G.CPU_SMS, x.element_size(), gated=gated)
            if dict(config, num_warps=0, num_stages=0) in [dict(c, num_warps=0, num_stages=0) for c in launches]:
                continue
            launches.append(config)
            out = G.gemv(x, weight, None, residual, norm_weight=norm, gated=gated)
        scale = reference.abs().max().item()
        tol = (1e-5 if dtype == torch.float32 else 2e-3) * scale
        assert (out.float() - reference).abs().max().item() <= tol, (shape, launches[-1])
    assert any(c["USE_DOT"] for c in launches) and any(not c["USE_DOT"] for c in launches)
    assert any(c["SPLIT_K"] > 1 for c in launches) and len(launches) >= 3
