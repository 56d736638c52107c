"""One command reproduces the embedded default model set.

    python -m train.recipe --work runs/default --assets taps_jax/assets/default

Stages, in order; each is skipped when its output exists and resumes from its
own checkpoints when interrupted (rerun the same command):

  tokenizer  byte-level BPE on the stdlib train split      -> WORK/tokenizer/
  data       token caches + held-out prompt set            -> WORK/tokens/, WORK/prompts_heldout.jsonl
  target     Qwen3 pretraining (configs/train/target_*)     -> WORK/target_train/export/
  drafter    DFlash distillation (configs/train/drafter_*)  -> WORK/drafter_train/export/
  traces     TAPS traces on train-split prompts that the    -> WORK/prompts_traces.jsonl, WORK/traces/
             drafter was NOT distilled on
  scorer     TAPS scorers: temperature-1 and greedy labels -> WORK/scorer_train/, WORK/scorer_greedy_train/
  adaptive   the adaptive policy's prior on validation-    -> WORK/adaptive.json
             split prompts (train.adaptive_table)
  assemble   compact copies (bfloat16 weights) + prompts   -> ASSETS/{target,drafter,scorer,scorer_greedy}/
  report     taps-bench at T=0 and T=1 + final losses        -> ASSETS/report.json, report.png, report_t1.png

Each training stage is its module's `run(config)` with a typed config
(`stage_configs`: TargetRun, DistillRun, TracesRun, ScorerRun); `--dry-run`
prints those configs, resolved presets included, and runs nothing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from taps_jax import compile_cache
from taps_jax.engine.adaptive import TABLE_FILE
from train import corpus

STAGES = ("tokenizer", "data", "target", "drafter", "traces", "scorer", "adaptive", "assemble", "report")
# (training dir under WORK, labels): the set's scorer/ serves sampled decoding,
# scorer_greedy/ greedy decoding (their acceptance rules differ).
SCORERS = (("scorer_train", "sampled"), ("scorer_greedy_train", "greedy"))
SCORER_SETTINGS = {"residual": True}


def _done(path: Path, name: str) -> bool:
    if path.exists():
        print(f"[recipe] {name}: done ({path}), skipped", flush=True)
        return True
    print(f"[recipe] {name}: running", flush=True)
    return False


def _check(code: int, name: str) -> None:
    if code:
        raise SystemExit(f"[recipe] stage {name} failed with exit status {code}; fix it and rerun to resume")


def stage_configs(name: str, args) -> list:
    """The typed run configs of the training stages: what each stage's `run(config)` is called with."""
    from train import distill, scorer, target, traces

    work = args.work
    target_dir, drafter_dir = work / "target_train" / "export", work / "drafter_train" / "export"
    if name == "target":  # the corpus: the recipe's --corpus (root_override) or the stdlib
        return [target.TargetRun(out=work / "target_train", settings=target.load_preset(args.preset),
                                 tokenizer=work / "tokenizer", tokens=work / "tokens", preset=args.preset,
                                 resume=True)]
    if name == "drafter":
        return [distill.DistillRun(target=target_dir, out=work / "drafter_train",
                                   settings=distill.load_preset(args.preset), corpus=corpus.stdlib_root(),
                                   preset=args.preset, resume=True)]
    if name == "traces":
        return [traces.TracesRun(target=target_dir, drafter=drafter_dir, prompts=work / "prompts_traces.jsonl",
                                 out=work / "traces", trace=traces.TraceConfig(max_new_tokens=args.trace_tokens))]
    if name == "scorer":
        steps = {"steps": args.scorer_steps} if args.scorer_steps else {}
        return [scorer.ScorerRun(traces=work / "traces", target=target_dir, out=work / out, resume=True,
                                 train=scorer.ScorerTrainConfig(labels=labels, **SCORER_SETTINGS, **steps))
                for out, labels in SCORERS]
    return []


def _run(module, config, name: str):
    try:
        return module.run(config)
    except ValueError as e:
        raise SystemExit(f"[recipe] stage {name} failed: {e}; fix it and rerun to resume") from None
    except KeyboardInterrupt:
        raise SystemExit(f"[recipe] stage {name} interrupted; rerun the same command to resume") from None


def dry_run(name: str, args) -> None:
    """Print what a stage would run: its run config (the resolved preset included), or what it builds."""
    configs = stage_configs(name, args)
    for config in configs:
        print(f"[recipe] {name}: run({config})")
    if not configs:
        print(f"[recipe] {name}: (no training run; see the module docstring)")


def run_stage(name: str, args) -> None:
    work, preset = args.work, args.preset
    tok_dir, tokens = work / "tokenizer", work / "tokens"
    target_dir = work / "target_train" / "export"
    drafter_dir = work / "drafter_train" / "export"
    if name == "tokenizer":
        if not _done(tok_dir / "tokenizer.json", name):
            from train.tokenizer import train_tokenizer
            train_tokenizer(tok_dir, vocab_size=args.vocab_size, max_bytes=args.tokenizer_bytes)
    elif name == "data":
        if not _done(work / "prompts_heldout.jsonl", name):
            from train import packing
            packing.main(["--tokenizer", str(tok_dir), "--cache-dir", str(tokens)])
            corpus.write_prompts_jsonl(work / "prompts_heldout.jsonl", corpus.build_prompts("heldout", n=args.heldout_prompts))
    elif name == "target":
        if not _done(target_dir / "config.json", name):
            from train import target
            config, = stage_configs(name, args)
            _run(target, config, name)
            if not (target_dir / "config.json").exists():
                _run(target, dataclasses.replace(config, resume=False, export_only=True), name)
    elif name == "drafter":
        if not _done(drafter_dir / "config.json", name):
            from train import distill
            config, = stage_configs(name, args)
            _run(distill, config, name)
    elif name == "traces":
        if not _done(work / "traces" / "DONE", name):
            from train import distill, traces
            prompts = work / "prompts_traces.jsonl"
            if not prompts.exists():
                # Rounds on the drafter's own distillation prompts would show it
                # memorised, not as it drafts on new code: the scorer must learn the latter.
                corpus.write_prompts_jsonl(prompts, corpus.build_prompts(
                    "train", n=args.trace_prompts, exclude=distill.distillation_prompt_texts(preset)))
            config, = stage_configs(name, args)
            _run(traces, config, name)
            (work / "traces" / "DONE").write_text("complete\n")
    elif name == "scorer":
        for config, (out, labels) in zip(stage_configs(name, args), SCORERS):
            if not _done(work / out / "scorer" / "config.json", f"{name} ({labels} labels)"):
                from train import scorer
                _run(scorer, config, name)
    elif name == "adaptive":
        if not _done(work / TABLE_FILE, name):
            from train import adaptive_table

            prompts = work / "prompts_adaptive.jsonl"  # neither the benchmark's nor the drafter's prompts
            corpus.write_prompts_jsonl(prompts, corpus.build_prompts("validation", n=args.adaptive_prompts, seed=0))
            adaptive_table.fit_stage(target_dir, drafter_dir, [work / out / "scorer" for out, _ in SCORERS],
                                     prompts, work / TABLE_FILE, num_prompts=args.adaptive_prompts,
                                     max_new_tokens=args.adaptive_tokens, batch_size=args.adaptive_prompts)
    elif name == "assemble":
        scorers = {out.removesuffix("_train"): work / out / "scorer" for out, _ in SCORERS}
        assemble(args.assets, target_dir, drafter_dir, scorers, work / "prompts_heldout.jsonl",
                 work / TABLE_FILE)
    elif name == "report":
        write_report(args.assets, work, args.report_prompts, args.report_budgets, args.report_tokens)


def _best_val(metrics_csv: Path) -> dict | None:
    """The lowest validation loss in a training loop's metrics.csv."""
    if not metrics_csv.exists():
        return None
    with metrics_csv.open() as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "val" and r["loss"]]
    best = min(rows, key=lambda r: float(r["loss"]), default=None)
    return {"val_loss": float(best["loss"]), "step": int(best["step"])} if best else None


def _final_row(path: Path) -> dict | None:
    if not path.exists():
        return None
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for k, v in rows[-1].items() if v} if rows else None


def write_report(assets: Path, work: Path, num_prompts: int, budgets: str = "16,32,64", tokens: int = 128) -> None:
    """taps-bench on the assembled set at temperature 0 and 1, plus the final training losses.

    ASSETS/report.json = {"losses": ..., "greedy": <taps-bench JSON at T=0>, "sampled": <at T=1>};
    report.png / report_t1.png are taps-bench's plots.
    """
    from decode import bench

    models = [work / "target_train" / "export", work / "drafter_train" / "export",
              *(work / out / "scorer" for out, _ in SCORERS)]
    newest_model = max((f.stat().st_mtime for d in models for f in d.glob("*") if f.is_file()), default=0.0)
    runs = {}
    for key, temperature, png in (("greedy", 0.0, "report.png"), ("sampled", 1.0, "report_t1.png")):
        out, plot = work / f"report_{key}.json", work / f"report_{key}.png"
        if out.exists() and out.stat().st_mtime < newest_model:
            out.unlink()  # a model was retrained after this run: benchmark again
        if not _done(out, f"report ({key})"):
            _check(bench.main(["--model", str(assets), "--policies", "ar,chain,ddtree,taps",
                               "--budgets", budgets, "--num-prompts", str(num_prompts),
                               "--max-new-tokens", str(tokens), "--temperature", str(temperature),
                               "--json", str(out), "--plot", str(plot),
                               # per-stage ms and the verify cost curve: greedy run only
                               *(["--no-stages"] if temperature else ["--cost-curve"])]), "report")
        runs[key] = json.loads(out.read_text())
        shutil.copy(plot, assets / png)  # assemble rebuilds ASSETS, so the runs live in WORK
    losses = {
        "target": _best_val(work / "target_train" / "metrics.csv"),
        "drafter": _best_val(work / "drafter_train" / "metrics.csv"),
        "drafter_val_agreement": _final_row(work / "drafter_train" / "val_agreement.csv"),
        **{out.removesuffix("_train"): (json.loads((work / out / "summary.json").read_text())
                                        if (work / out / "summary.json").exists() else None)
           for out, _ in SCORERS},
    }
    # A stage whose logs are gone (say the target was restored from the shipped
    # set instead of retrained) keeps the losses of the last report.
    kept = work / "report_losses.json"
    previous = json.loads(kept.read_text()) if kept.exists() else {}
    losses = {k: v if v is not None else previous.get(k) for k, v in losses.items()}
    kept.write_text(json.dumps(losses, indent=2))
    (assets / "report.json").write_text(json.dumps({"losses": losses, **runs}, indent=2))
    print(f"[recipe] report: {assets / 'report.json'}", flush=True)


def assemble(assets: Path, target_dir: Path, drafter_dir: Path, scorer_dirs: dict[str, Path], prompts: Path,
             table: Path | None = None) -> None:
    """Copy the set into the package in compact form: bfloat16 weights, float32 at load time."""
    from taps_jax import load_scorer, load_target
    from taps_jax.decoder import load_drafter

    tmp = assets.with_name(assets.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    load_target(target_dir, dtype="bfloat16").save(tmp / "target")
    for extra in ("generation_config.json",):
        if (target_dir / extra).exists():
            shutil.copy(target_dir / extra, tmp / "target" / extra)
    load_drafter(drafter_dir, dtype="bfloat16").save(tmp / "drafter")
    for name, scorer_dir in scorer_dirs.items():  # {"scorer": dir, "scorer_greedy": dir}
        if (scorer_dir / "config.json").exists():
            load_scorer(scorer_dir).save(tmp / name)
    shutil.copy(prompts, tmp / "prompts_heldout.jsonl")
    if table is not None and table.is_file():
        shutil.copy(table, tmp / table.name)
    shutil.rmtree(assets, ignore_errors=True)
    tmp.rename(assets)  # never leave a half-written set in the package
    size = sum(f.stat().st_size for f in assets.rglob("*") if f.is_file())
    print(f"[recipe] assembled {assets} ({size / 2**20:.1f} MiB)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/default"), help="working dir for all stages")
    p.add_argument("--assets", type=Path, default=Path("taps_jax/assets/default"), help="where the set is assembled")
    p.add_argument("--preset", default="default", help="configs/train/{target,drafter}_<preset>.json")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset, in order (default: all)")
    p.add_argument("--corpus", type=Path, default=None,
                   help="train on the .py files under this directory instead of the standard library")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary size")
    p.add_argument("--tokenizer-bytes", type=int, default=None, help="train the tokenizer on this many bytes only")
    p.add_argument("--heldout-prompts", type=int, default=200, help="prompts in the shipped held-out set")
    p.add_argument("--trace-prompts", type=int, default=256, help="train-split prompts traced for the scorer")
    p.add_argument("--adaptive-prompts", type=int, default=64,
                   help="validation-split prompts the adaptive prior is fitted on (one batch)")
    p.add_argument("--adaptive-tokens", type=int, default=128, help="new tokens per prompt of that fit")
    p.add_argument("--trace-tokens", type=int, default=128, help="tokens decoded per trace prompt")
    p.add_argument("--scorer-steps", type=int, default=None, help="scorer training steps (default: train.scorer's)")
    p.add_argument("--report-prompts", type=int, default=32, help="held-out prompts in the report benchmark")
    p.add_argument("--report-budgets", default="16,32,64", help="tree budgets in the report benchmark")
    p.add_argument("--report-tokens", type=int, default=128, help="new tokens per prompt in the report benchmark")
    p.add_argument("--dry-run", action="store_true",
                   help="print each stage's training command and resolved preset, run nothing")
    compile_cache.add_flag(p)
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"{p.prog}: error: unknown stage {unknown[0]!r}; stages: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if args.corpus is not None and not args.corpus.is_dir():
        print(f"{p.prog}: error: --corpus {args.corpus} is not a directory; give a tree of .py files", file=sys.stderr)
        return 2
    if args.dry_run:
        with corpus.root_override(args.corpus):
            for name in STAGES:
                if name in stages:
                    dry_run(name, args)
        return 0
    from decode.common import check_output_path

    try:
        for out in (args.work, args.assets):
            check_output_path(out, directory=True)  # before any stage runs
        compile_cache.setup(args)  # the stages run in this process
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    with corpus.root_override(args.corpus):  # every stage reads the corpus from there
        for name in STAGES:
            if name in stages:
                run_stage(name, args)
    (args.work / "recipe.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
