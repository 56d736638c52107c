"""`python -m decode.device_bench --size tiny` runs for real on CPU: every figure measured, JSON + PNG written."""

from __future__ import annotations

import json

import pytest

from decode import device_bench


def test_tiny_device_bench_on_cpu(tmp_path, capsys):
    assert device_bench.main(["--size", "tiny", "--batches", "2", "--policies", "chain,taps", "--budgets", "16",
                              "--curve", "1,4", "--reps", "2", "--context", "32", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "device_bench_tiny.json").read_text())
    assert (tmp_path / "device_bench_tiny.png").stat().st_size > 0
    assert set(result["ar_ms"]) == {"2"} and all(t["median"] > 0 for t in result["ar_ms"].values())
    assert set(result["verify_curve_ms"]["2"]) == {"1", "4"}
    rows = {(r["policy"], r["batch"]): r for r in result["rounds"]}
    assert set(rows) == {("chain", 2), ("taps", 2)}
    for r in rows.values():
        assert set(r["stage_ms"]) == {"draft", "select", "verify"} and r["round_ms"] > 0
        ar = result["ar_ms"][str(r["batch"])]["median"]
        assert r["predicted_speedup"] == pytest.approx(r["tau_default_set"] * ar / r["round_ms"])
    assert rows[("taps", 2)]["tree_size"] == 17 and rows[("chain", 2)]["tree_size"] == 16
    assert "RANDOM weights" in result["note"] and result["device"].startswith("cpu")
    assert "predicted" in capsys.readouterr().out


def test_bad_flags_are_one_line(capsys):
    for argv in (["--size", "70b"], ["--budgets", "0"], ["--policies", "beam"]):
        with pytest.raises(SystemExit) as e:
            device_bench.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and len(err.strip().splitlines()) == 1
