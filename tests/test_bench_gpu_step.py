"""bench.gpu_step, the prepared device script of issue 34: its --smoke mode (tiny shapes on CPU)
runs every measurement the GPU run makes and writes the JSON the device check reads."""

from __future__ import annotations

import json

from bench import gpu_step


def test_smoke_mode_measures_every_case_and_writes_json(tmp_path):
    out = tmp_path / "gpu_step.json"
    result = gpu_step.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    for name in ("NONE", "EAGLE3_tree"):
        assert set(result["step_ms"][name]["3"]) == {"graphs_off", "graphs_on"}
        assert all(ms > 0 for ms in result["step_ms"][name]["3"].values())
    assert set(result["big_plain_decode_ms"]) == {"1", "2"}
    assert result["big_weight_bytes"] > 0 and len(result["done_when"]) == 4
