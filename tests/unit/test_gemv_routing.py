"""The GEMV/cuBLAS routing table: stored entries, the nearest entry for other shapes, a missing or corrupt table,
and the ops following it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ember.kernels import gemv as G
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


def test_the_stored_table_parses_when_present():
    if R.TABLE_PATH.exists():
        table = R.load_table()
        assert table and all(1 <= v <= G.GEMV_MAX_M or v == 0 for v in table.values())


@pytest.mark.parametrize("rows,expect_gemv", [(2, True), (3, False)])
def test_linear_op_follows_the_table(monkeypatch, rows, expect_gemv):
    """ember::linear takes the GEMV up to the table's row count and F.linear above it."""
    calls = []
    monkeypatch.setattr(G, "gemv_applies", lambda x, weight, bias: True)   # as for a CUDA tensor
    monkeypatch.setattr(G, "gemv_max_rows", lambda n, k, gated: 2)
    monkeypatch.setattr(G, "gemv", lambda x, w, b: calls.append(x.shape[0]) or F.linear(x, w, b))
    x, w = torch.randn(rows, 32), torch.randn(24, 32)
    torch.testing.assert_close(torch.ops.ember.linear(x, w, None), F.linear(x, w))
    assert bool(calls) is expect_gemv
