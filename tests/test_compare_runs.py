"""train.compare_runs: validation curves of distillation runs on one clock."""

from __future__ import annotations

import json

import pytest

from train import compare_runs

METRICS = "step,split,loss,lr,grad_norm,tokens_per_s,elapsed_s,cpu_s\n"
AGREEMENT = "step,loss,acc_mean,tau_cumprod,tau_chain,acc_1\n"


def run_dir(tmp_path, name, rows):
    """rows: (step, elapsed_s, cpu_s, acc_1, tau_chain) at each evaluation."""
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.csv").write_text(METRICS + "".join(
        f"{s},train,4.0,1e-3,1.0,100,{e - 1},{c - 1}\n{s},val,3.9,1e-3,,,{e},{c}\n" for s, e, c, _, _ in rows))
    (d / "val_agreement.csv").write_text(AGREEMENT + "".join(
        f"{s},3.9,0.2,1.3,{t},{a}\n" for s, _, _, a, t in rows))
    return d


def test_runs_compare_on_cpu_hours_and_plot(tmp_path, capsys):
    fast = run_dir(tmp_path, "fast", [(50, 1800, 3600, 0.10, 1.10), (100, 3600, 7200, 0.20, 1.30)])
    slow = run_dir(tmp_path, "slow", [(50, 3600, 7200, 0.15, 1.20), (100, 7200, 14400, 0.25, 1.40)])
    assert compare_runs.curve(fast)[-1] == {"step": 100, "hours": 2.0, "acc_1": 0.2, "tau_chain": 1.3}
    assert compare_runs.curve(fast, "elapsed_s")[-1]["hours"] == 1.0
    png = tmp_path / "curves.png"
    assert compare_runs.main([str(fast), str(slow), "--until-hours", "2", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| fast | 100 | 2.00 | 0.200 | 1.30 | 0.15 |" in out  # (1.30 - 1) / 2 hours
    assert "| slow | 50 | 2.00 | 0.150 | 1.20 | 0.10 |" in out  # its step 100 is past 2 CPU-hours
    assert png.stat().st_size > 10_000


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, capsys):
    assert compare_runs.main([str(tmp_path)]) == 2
    assert "no val_agreement.csv" in capsys.readouterr().err
    old = run_dir(tmp_path, "old", [(50, 1800, 3600, 0.1, 1.1)])
    (old / "metrics.csv").write_text("step,split,loss,lr,grad_norm,tokens_per_s,elapsed_s\n50,val,3.9,1e-3,,,1800\n")
    with pytest.raises(ValueError, match="--clock wall"):
        compare_runs.curve(old)
    assert compare_runs.curve(old, "elapsed_s")[0]["hours"] == 0.5


def test_a_chain_of_legs_is_one_curve_and_a_next_leg_starts_where_it_ends(tmp_path, capsys):
    legs = {"legs": [
        {"leg": 1, "steps": 100, "cpu_s": 7200, "elapsed_s": 3600,
         "validation": [{"step": 50, "acc_1": 0.1, "tau_chain": 1.1}, {"step": 100, "acc_1": 0.2, "tau_chain": 1.2}]},
        {"leg": 2, "steps": 40, "cpu_s": 3600, "elapsed_s": 1800,
         "validation": [{"step": 40, "acc_1": 0.3, "tau_chain": 1.4}]}]}
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "legs.json").write_text(json.dumps(legs))
    chain = compare_runs.chain_curve(tmp_path / "state" / "legs.json")
    assert [(p["step"], p["hours"]) for p in chain] == [(50, 1.0), (100, 2.0), (140, 3.0)]
    wall = compare_runs.chain_curve(tmp_path / "state" / "legs.json", "elapsed_s")
    assert [(p["step"], p["hours"]) for p in wall] == [(50, 0.5), (100, 1.0), (140, 1.5)]
    arm = run_dir(tmp_path, "arm", [(20, 1800, 1800, 0.35, 1.5)])
    png = tmp_path / "chain.png"
    assert compare_runs.main(["--legs", str(tmp_path / "state" / "legs.json"), str(arm), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| chain (state) | 140 | 3.00 | 0.300 | 1.40 | 0.13 |" in out
    assert "| arm | 160 | 3.50 | 0.350 | 1.50 | 0.14 |" in out
    assert png.stat().st_size > 10_000
    (tmp_path / "bad.json").write_text("{}")
    assert compare_runs.main(["--legs", str(tmp_path / "bad.json")]) == 2
    assert "not a chain's legs.json" in capsys.readouterr().err
