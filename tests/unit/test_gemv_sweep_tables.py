"""The GEMV sweeps' table writes (benches/gemv_sweep.py) merge into the stored tables: a run over some shapes (say a
tensor-parallel shard's) replaces those shapes' entries and keeps the others, and what it writes loads back through
ember.kernels.gemv_routing. No GPU: the writers are called with measured entries made up here."""

import json
import types

from benches import gemv_sweep
from ember.kernels import gemv_routing


def test_a_crossover_run_keeps_the_shapes_it_did_not_measure():
    previous = {"device": "H100", "shapes": [dict(n=1024, k=2048, gated=False, max_rows=16),
                                             dict(n=2048, k=2048, gated=False, max_rows=7)]}
    table = gemv_sweep.merged_crossover(previous, {(2048, 2048, False): 5, (3072, 4096, False): 3}, "cmd", "H100",
                                        "2.11")
    assert [(e["n"], e["k"], e["max_rows"]) for e in table["shapes"]] == [(1024, 2048, 16), (2048, 2048, 5),
                                                                         (3072, 4096, 3)]
    assert [e["device"] for e in table["shapes"]] == ["H100", "H100", "H100"]
    other = gemv_sweep.merged_crossover(previous, {(3072, 4096, False): 3}, "cmd", "H200", "2.11")
    # another device's run adds its shapes; each entry names the device that measured it
    assert [(e["n"], e["k"], e["device"]) for e in other["shapes"]] == [(1024, 2048, "H100"), (2048, 2048, "H100"),
                                                                         (3072, 4096, "H200")]


def test_the_one_row_table_keeps_the_row_shapes_and_loads_back(tmp_path):
    path = tmp_path / "shapes.json"
    previous = {"row_command": "rows", "row_shapes": [{"n": 1, "k": 2}]}
    stored = {(4096, 2048, False): dict(n=4096, k=2048, gated=False, programs_per_sm=4, w_tile_bytes=8192, us=5.0,
                                        constants_us=6.0),
              (1024, 2048, False): dict(n=1024, k=2048, gated=False, programs_per_sm=8, w_tile_bytes=16384, us=2.5,
                                        constants_us=2.7)}
    tma = {(14336, 4096, True): dict(n=14336, k=4096, gated=True, block_n=16, block_k=256, stages=3, us=40.0,
                                     gemv_us=42.0)}
    props = types.SimpleNamespace(name="H100", multi_processor_count=132)
    gemv_sweep._write_one_row_shapes(path, previous, stored, tma, ["llama-3.1-8b"], (2,), False, props)
    doc = json.loads(path.read_text())
    assert doc["row_shapes"] == [{"n": 1, "k": 2}] and doc["row_command"] == "rows"
    assert [e["n"] for e in doc["shapes"]] == [1024, 4096]                   # sorted
    assert "--tensor-parallel-sizes 2" in doc["command"]
    assert gemv_routing.load_shapes(path)[(4096, 2048, False, 132, 2)] == (4, 8192)
    assert gemv_routing.load_tma_shapes(path)[(14336, 4096, True, 132, 2)] == (16, 256, 3)
