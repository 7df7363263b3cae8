"""The GEMV/cuBLAS routing table: stored entries, the nearest entry for other shapes, a missing or corrupt table,
and the ops following it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ember.kernels import gemv as G
from ember.kernels import gemv_config as GC
from ember.kernels import linear_op as LO
from ember.kernels import gemv_routing as R

TABLE = (((4096, 1024, False), 4), ((6144, 1024, True), 4), ((16384, 2048, True), 2), ((6144, 4096, False), 1))


def test_stored_shapes_take_their_entry():
    assert R.gemv_max_rows(4096, 1024, False, TABLE) == 4
    assert R.gemv_max_rows(16384, 2048, True, TABLE) == 2
    assert R.gemv_max_rows(6144, 4096, False, TABLE) == 1


def test_other_shapes_take_the_entry_nearest_in_size_with_the_same_gating():
    assert R.gemv_max_rows(4096, 1200, False, TABLE) == 4          # near 4096x1024
    assert R.gemv_max_rows(57344, 4096, True, TABLE) == 2          # largest gated entry is nearest
    assert R.gemv_max_rows(8192, 4096, False, TABLE) == 1


def test_a_table_file_round_trips(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"shapes": [dict(n=n, k=k, gated=g, max_rows=r) for (n, k, g), r in TABLE]}))
    assert R.load_table(path) == dict(TABLE)


def test_a_missing_table_is_empty_and_a_corrupt_one_warns(tmp_path):
    assert R.load_table(tmp_path / "absent.json") == {}
    bad = tmp_path / "bad.json"
    bad.write_text('{"shapes": [{"n": 1')                           # truncated
    with pytest.warns(UserWarning, match="crossover table"):
        assert R.load_table(bad) == {}
    assert R.gemv_max_rows(4096, 1024, False, ()) == R.FALLBACK_MAX_ROWS


def test_tma_shapes_round_trip_and_the_stored_ones_parse(tmp_path):
    """`tma_shapes` of the launch-shape document, keyed like the launch shapes (SM count and element size from the
    document); a document without them has none."""
    path = tmp_path / "s.json"
    doc = dict(num_sms=132, element_size=2, shapes=[],
               tma_shapes=[dict(n=57344, k=4096, gated=True, block_n=16, block_k=256, stages=3, us=79.2, gemv_us=81.5)])
    path.write_text(json.dumps(doc))
    assert R.load_tma_shapes(path) == {(57344, 4096, True, 132, 2): (16, 256, 3)}
    path.write_text(json.dumps(dict(doc, tma_shapes=[])))
    assert R.load_tma_shapes(path) == {}
    stored = R.load_tma_shapes()
    assert all(n % b_n == 0 and k % b_k == 0 and stages >= 2 for (n, k, _, _, _), (b_n, b_k, stages) in stored.items())


def test_the_stored_table_parses_when_present():
    if R.TABLE_PATH.exists():
        table = R.load_table()
        assert table and all(1 <= v <= G.GEMV_MAX_M or v == 0 for v in table.values())


@pytest.mark.parametrize("rows,expect_gemv", [(2, True), (3, False)])
def test_linear_op_follows_the_table(monkeypatch, rows, expect_gemv):
    """ember::linear takes the GEMV up to the table's row count and F.linear above it."""
    calls = []
    monkeypatch.setattr(LO, "gemv_applies", lambda x, weight, bias: True)   # as for a CUDA tensor
    monkeypatch.setattr(LO, "gemv_max_rows", lambda n, k, gated: 2)
    monkeypatch.setattr(LO, "gemv", lambda x, w, b: calls.append(x.shape[0]) or F.linear(x, w, b))
    x, w = torch.randn(rows, 32), torch.randn(24, 32)
    torch.testing.assert_close(torch.ops.ember.linear(x, w, None), F.linear(x, w))
    assert bool(calls) is expect_gemv


def _shapes_file(tmp_path, num_sms=132, entries=((6144, 4096, False, 8, 16384),)):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"num_sms": num_sms, "element_size": 2, "shapes": [
        dict(n=n, k=k, gated=g, programs_per_sm=p, w_tile_bytes=t) for n, k, g, p, t in entries]}))
    return path


def test_a_stored_launch_shape_changes_one_row_of_its_weight_shape_on_its_sm_count(tmp_path, monkeypatch):
    """A one-row launch of a stored weight shape takes the stored (programs per SM, W tile bytes) on a GPU of the SM
    count it was measured on; other rows, other SM counts and other shapes keep the constants."""
    table = R.load_shapes(_shapes_file(tmp_path))
    assert table == {(6144, 4096, False, 132, 2): (8, 16384)}

    def configs(shapes):
        monkeypatch.setattr(R, "_shapes", lambda: shapes)
        GC.cached_config.cache_clear()
        return [G.gemv_config(m, n, 4096, sms, gated=gated)
                for m, n, sms, gated in ((1, 6144, 132, False), (2, 6144, 132, False), (1, 6144, 114, False),
                                         (1, 3072, 132, True), (1, 4096, 132, False))]

    try:
        stored, constants = configs(table), configs({})
    finally:
        GC.cached_config.cache_clear()
    # 8 programs per SM: 6144 // (8 * 132) columns rounded down to a power of two; a 16 KiB tile
    assert stored[0]["BLOCK_N"] == 4 and stored[0]["BLOCK_N"] * stored[0]["BLOCK_K"] * 2 == 16384
    assert constants[0]["BLOCK_N"] == 16 and constants[0]["BLOCK_N"] * constants[0]["BLOCK_K"] * 2 == GC.W_TILE_BYTES
    assert stored[1:] == constants[1:]


def test_fp8_launch_shapes_come_from_their_own_document(tmp_path, monkeypatch):
    """The fp8 document (element size 1) is read beside the bf16 one: its entry changes one row of an e4m3 weight of
    its shape, and the bf16 weight of that shape keeps the constants."""
    fp8 = tmp_path / "fp8.json"
    fp8.write_text(json.dumps({"num_sms": 132, "element_size": 1, "shapes": [
        dict(n=4096, k=4096, gated=False, programs_per_sm=4, w_tile_bytes=16384)]}))
    monkeypatch.setattr(R, "SHAPES_PATH", _shapes_file(tmp_path))
    monkeypatch.setattr(R, "FP8_SHAPES_PATH", fp8)
    shapes = R._shapes.__wrapped__()
    assert shapes == {(6144, 4096, False, 132, 2): (8, 16384), (4096, 4096, False, 132, 1): (4, 16384)}
    monkeypatch.setattr(R, "_shapes", lambda: shapes)
    GC.cached_config.cache_clear()
    try:
        fp8_config, bf16_config = (G.gemv_config(1, 4096, 4096, 132, size) for size in (1, 2))
        block_config = G.gemv_config(1, 4096, 4096, 132, 1, max_block_k=128)
    finally:
        GC.cached_config.cache_clear()
    # 4 programs per SM: 4096 // (4 * 132) = 7 columns, rounded down to 4; a 16 KiB tile of 1-byte values, on 8
    # warps (64 products a thread)
    assert fp8_config["BLOCK_N"] == 4 and fp8_config["BLOCK_N"] * fp8_config["BLOCK_K"] == 16384
    assert fp8_config["num_warps"] == 8
    # block scales: a step within one 128-column block, so the tile is 16 x 128 on 4 warps
    assert (block_config["BLOCK_N"], block_config["BLOCK_K"], block_config["num_warps"]) == (16, 128, GC.NUM_WARPS)
    assert bf16_config["BLOCK_N"] == 8 and bf16_config["BLOCK_N"] * bf16_config["BLOCK_K"] * 2 == GC.W_TILE_BYTES
    assert bf16_config["num_warps"] == GC.NUM_WARPS


def test_a_missing_shapes_table_is_empty_and_a_corrupt_one_warns(tmp_path):
    assert R.load_shapes(tmp_path / "absent.json") == {}
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_sms": 132, "shapes": [{"n": 1')
    with pytest.warns(UserWarning, match="launch-shape table"):
        assert R.load_shapes(bad) == {}


def test_the_stored_shapes_table_parses_when_present():
    if R.SHAPES_PATH.exists():
        table = R.load_shapes()
        assert table and all(p in (1, 2, 4, 8) and t in (4096, 8192, 16384) for p, t in table.values())
