"""Distillation runs side by side: validation acceptance per CPU-hour of training, as a table and one plot.

    python -m train.compare_runs runs/abl/full runs/abl/vocab4096 ... [--until-hours H] [--out curves.png]
    python -m train.compare_runs --legs configs/sets/smollm2_drafter/legs.json runs/next-leg-arm ... --out chain.png

Each argument is a `train.distill --out` directory. Its val_agreement.csv gives the validation acc_1 and the
empirical chain tau at each evaluation, and its metrics.csv the training's clock at that step (cpu_s: the
process's CPU seconds, all threads; or elapsed_s, wall-clock with --clock wall; evaluations included, resumed
legs added up), so runs with different step costs compare on the same clock. CPU time is what a shared machine
measures fairly: another job's load stretches a run's wall-clock, far less its CPU seconds.

With --legs, a training chain's committed legs (a set's legs.json, `train.set_recipe`) are one curve on the
chain's clock (the legs' hours added up), and each run given is a next leg: it starts where the chain ends.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def curve(run: Path, clock: str = "cpu_s") -> list[dict]:
    """[{"step", "hours", "acc_1", "tau_chain"}] at each validation of one run, in step order; hours of `clock`
    (a metrics.csv column: cpu_s or elapsed_s)."""
    agreement, metrics = run / "val_agreement.csv", run / "metrics.csv"
    for f in (agreement, metrics):
        if not f.is_file():
            raise ValueError(f"{run}: no {f.name}; is it a train.distill --out directory with an evaluation?")
    with metrics.open(newline="") as f:
        elapsed = {int(r["step"]): float(r[clock]) for r in csv.DictReader(f) if r.get(clock)}
    if not elapsed:
        raise ValueError(f"{metrics}: no rows with {clock} yet" + (" (runs before 2026-12-04 log no CPU time: "
                                                                   "--clock wall)" if clock == "cpu_s" else ""))
    points = []
    with agreement.open(newline="") as f:
        for r in csv.DictReader(f):
            step = int(r["step"])
            at = max((s for s in elapsed if s <= step), default=min(elapsed))  # the last timed row before it
            points.append({"step": step, "hours": elapsed[at] / 3600, "acc_1": float(r["acc_1"]),
                           "tau_chain": float(r["tau_chain"])})
    return sorted(points, key=lambda p: p["step"])


def chain_curve(legs_file: Path, clock: str = "cpu_s") -> list[dict]:
    """A chain's committed legs (legs.json) as one curve: steps and hours of `clock` (cpu_s or elapsed_s) added
    up across legs. A record keeps each leg's total clock, not each evaluation's, so a leg's evaluations are
    placed on its clock in proportion to their steps."""
    try:
        legs = json.loads(Path(legs_file).read_text())["legs"]
        points, steps, hours = [], 0, 0.0
        for leg in legs:
            for v in leg["validation"]:
                points.append({"step": steps + v["step"], "hours": hours + leg[clock] / 3600 * v["step"] / leg["steps"],
                               "acc_1": v["acc_1"], "tau_chain": v["tau_chain"]})
            steps, hours = steps + leg["steps"], hours + leg[clock] / 3600
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"{legs_file}: not a chain's legs.json ({e!r}); the state stage of python -m "
                         f"train.set_recipe writes it") from None
    if not points:
        raise ValueError(f"{legs_file}: no validation points in its legs")
    return points


def after(points: list[dict], start: dict) -> list[dict]:
    """A next leg's curve on its chain's clock: steps and hours counted from the chain's last point."""
    return [{**p, "step": start["step"] + p["step"], "hours": start["hours"] + p["hours"]} for p in points]


def table(curves: dict[str, list[dict]]) -> str:
    lines = ["| run | steps | hours | validation acc_1 | chain tau | tau gained per hour |",
             "|---|---|---|---|---|---|"]
    for name, points in curves.items():
        last = points[-1]
        rate = (last["tau_chain"] - 1) / last["hours"] if last["hours"] > 0 else float("nan")
        lines.append(f"| {name} | {last['step']} | {last['hours']:.2f} | {last['acc_1']:.3f} | "
                     f"{last['tau_chain']:.2f} | {rate:.2f} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], out: Path, clock: str = "cpu_s") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, points in curves.items():
        hours = [p["hours"] for p in points]
        axes[0].plot(hours, [p["acc_1"] for p in points], marker="o", label=name)
        axes[1].plot(hours, [p["tau_chain"] for p in points], marker="o", label=name)
    for ax, label in zip(axes, ("validation acc_1", "validation chain tau")):
        ax.set_xlabel("training CPU-hours" if clock == "cpu_s" else "training wall-clock (hours)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.compare_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="train.distill --out directories")
    p.add_argument("--legs", type=Path, default=None,
                   help="a training chain's legs.json: its legs as one curve, and each run as a next leg after it")
    p.add_argument("--out", type=Path, default=None, help="write the learning curves here (PNG)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="hours of process CPU time (default) or of wall-clock")
    p.add_argument("--until-hours", type=float, default=None,
                   help="only the evaluations within this many hours (the same clock for every run)")
    args = p.parse_args(argv)
    try:
        clock = {"cpu": "cpu_s", "wall": "elapsed_s"}[args.clock]
        until = float("inf") if args.until_hours is None else args.until_hours
        if not args.runs and args.legs is None:
            raise ValueError("give train.distill --out directories, or --legs")
        curves = {}
        if args.legs is not None:
            chain = chain_curve(args.legs, clock)
            curves[f"chain ({args.legs.parent.name})"] = chain
        for run in args.runs:
            points = curve(run, clock)
            curves[run.name] = after(points, chain[-1]) if args.legs is not None else points
        curves = {name: [pt for pt in points if pt["hours"] <= until] for name, points in curves.items()}
        if not all(curves.values()):
            empty = next(name for name, points in curves.items() if not points)
            raise ValueError(f"{empty}: no validation rows yet (val_agreement.csv is empty)")
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(table(curves))
    if args.out is not None:
        plot(curves, args.out, clock)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
