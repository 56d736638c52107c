"""One command builds a model set (drafter + TAPS scorers) for a target that exists already.

    python -m train.set_recipe --set smollm2 --work runs/smollm2 [--stages drafter,traces] [--dry-run]

The set is described by configs/sets/<name>.json (or a JSON path): its target
(a shipped set whose target.json points at a model file, or a checkpoint
path), the drafter preset, the instruction prompts and the trace, scorer and
report settings. Stages, in order; each is skipped when its output exists and
resumes from its own checkpoints when interrupted (rerun the same command):

  prompts   train.instructions prompts, rendered by the      -> WORK/prompts_{train,validation,traces,heldout}.jsonl
            target's chat template; the train-split prompts       and WORK/prompts_train_leg<k>.jsonl
            a later leg adds ("more_prompts")
  drafter   DFlash distillation on the target's own answers   -> WORK/distill/export/ (leg k > 1: WORK/distill-k/)
            (configs/train/drafter_<preset>.json); starts from
            the set's committed answers where they match. A
            training that spans sessions is a chain of legs
            ("drafter_legs": each starts from the previous
            leg's drafter); legs the committed drafter state
            has finished are not trained again
  answers   the finished answers as token ids, to commit      -> configs/sets/<answers>/*.npz
            (a new machine skips their generation)
  state     the last finished leg's drafter in bfloat16, with -> configs/sets/<drafter_state>/ (+ legs.json)
            each leg's settings and validation curve: a new
            machine starts the next leg (or the later stages)
            from it
  traces    TAPS traces on the traces split (refused if it    -> WORK/traces/
            overlaps the distillation prompts)
  scorer    TAPS scorers: temperature-1 and greedy labels     -> WORK/scorer_train/, WORK/scorer_greedy_train/
  lookup    the lookup weights: how often the text's earlier  -> WORK/lookup.json
            continuation is the target's next token, on its
            own answers to the traces split (train.lookup_table)
  adaptive  the adaptive policy's prior: accepted length per  -> WORK/adaptive.json
            text signal and budget on the traces split (train.adaptive_table)
  assemble  drafter + scorers in bfloat16 beside the target   -> ASSETS/ (taps_jax/assets/<assets>)
  report    taps-bench on the set at T=0 and T=1              -> ASSETS/report.json, report.png
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
from taps_jax.config import CONFIGS_DIR
from taps_jax.engine.adaptive import TABLE_FILE
from taps_jax.model_sets import ASSETS, NAMED_SETS, POINTER, file_sha256, target_of
from taps_jax.tree.lookup import LOOKUP_FILE

from train.instructions import ANSWERED_KINDS, KINDS, package_root
from train.recipe import SCORERS, _done, _run  # the embedded recipe's scorer runs and stage helpers

STAGES = ("prompts", "drafter", "answers", "state", "traces", "scorer", "lookup", "adaptive", "assemble", "report")
SPLITS = ("train", "validation", "traces", "heldout")
SET_DIR = CONFIGS_DIR / "sets"
LEGS_FILE = "legs.json"  # in the drafter state: what each finished leg was trained with, and its curve


@dataclasses.dataclass(frozen=True)
class SetSpec:
    """configs/sets/<name>.json: what the set is built from and with."""

    target: str  # a shipped set name (its target.json) or a checkpoint path (HF dir or GGUF)
    assets: str  # the set's directory under taps_jax/assets/, or a path
    drafter_preset: str
    prompts: dict  # {"seed", "max_prompt_tokens", "counts": {split: n}}
    traces: dict  # batch_size, num_prompts (the split's first N) and TraceConfig fields (pool_width, budget, ...)
    scorer: dict  # {"steps": n | null}
    report: dict  # {"prompts", "num_prompts", "budgets", "max_new_tokens"}
    adaptive: dict = dataclasses.field(default_factory=dict)  # {"num_prompts", "max_new_tokens", "batch_size"}
    lookup: dict = dataclasses.field(default_factory=dict)  # {"num_prompts", "max_new_tokens", "batch_size"}
    answers: str = ""  # the drafter's generated answers as token ids (to commit): a name under configs/sets/, or a path
    drafter_legs: list = dataclasses.field(default_factory=list)  # presets of the legs after drafter_preset's
    drafter_state: str = ""  # the last finished leg's drafter (to commit): a name under configs/sets/, or a path
    more_prompts: dict = dataclasses.field(default_factory=dict)  # {"k": n}: from leg k on, the chain also trains
    # on the answers to n more train-split prompts, drawn after the ones before; {"k": {"count": n, "packages": [..],
    # "kinds": [..]}}: n code tasks from installed packages' sources instead (`instructions.package_candidates`),
    # with "answers": "source" answered by the source they were made from (teacher-forced text, no generation)
    comment: str = ""

    @classmethod
    def read(cls, name_or_path: str) -> "SetSpec":
        path = Path(name_or_path)
        if not (path.suffix or len(path.parts) > 1):
            path = SET_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = sorted(p.stem for p in SET_DIR.glob("*.json"))
            raise ValueError(f"no set {name_or_path!r}: {path} does not exist; known: {', '.join(known)} "
                             f"(or give the path of a JSON file)")
        try:
            raw = json.loads(path.read_text())
            spec = cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a set description ({e}); see configs/sets/smollm2.json") from None
        from train.traces import TraceConfig

        known = {"traces": {f.name for f in dataclasses.fields(TraceConfig)} | {"batch_size", "num_prompts"},
                 "lookup": {"num_prompts", "max_new_tokens", "batch_size"},
                 "adaptive": {"num_prompts", "max_new_tokens", "batch_size"}}
        for section, names in known.items():
            unknown = sorted(set(getattr(spec, section)) - names)
            if unknown:
                raise ValueError(f"{path}: unknown {section} setting {unknown[0]!r}; known: {', '.join(sorted(names))}")
        for leg, n in spec.more_prompts.items():
            if leg not in {str(k) for k in range(2, len(spec.legs()) + 1)}:
                raise ValueError(f"{path}: more_prompts has leg {leg!r}; its keys are leg numbers of drafter_legs, "
                                 f"2 to {len(spec.legs())} (leg 1 trains on the train split's prompts; a later leg may "
                                 f"add more)")
            _check_more(f"{path}: more_prompts[{leg!r}]", n)
        return spec

    def target_path(self) -> Path:
        if self.target in NAMED_SETS and not Path(self.target).exists():
            path = target_of(ASSETS / self.target)
            if path is None:
                raise ValueError(f"the shipped set {self.target!r} has no target")
            return path
        return Path(self.target)

    def answers_dir(self) -> Path | None:
        return _committed(self.answers)

    def state_dir(self) -> Path | None:
        return _committed(self.drafter_state)

    def through(self, k: int) -> "SetSpec":
        """This set as of its chain's leg k: the legs after k (and the prompts they add) left out, so the later
        stages fit on leg k's drafter (the committed state, once it holds leg k) while a later leg trains."""
        if not 1 <= k <= len(self.legs()):
            raise ValueError(f"--through-leg {k}: the set's drafter chain has legs 1 to {len(self.legs())}")
        return dataclasses.replace(self, drafter_legs=self.drafter_legs[:k - 1],
                                   more_prompts={leg: n for leg, n in self.more_prompts.items() if int(leg) <= k})

    def legs(self) -> list[str]:
        """The drafter presets, in training order: leg 1 from scratch, each later leg from the one before."""
        return [self.drafter_preset, *self.drafter_legs]

    def more_prompt_files(self, work: Path, k: int | None = None) -> list[Path]:
        """The added training prompts that leg k (default: the last) trains on beside prompts_train.jsonl: one
        file per leg up to k that adds some (the `prompts` stage writes them)."""
        last = len(self.legs()) if k is None else k
        return [leg_prompts(work, j) for j in range(2, last + 1) if self.more_at(j)]

    def more_at(self, k: int) -> int | dict:
        """What leg k adds: a number of stdlib train-split prompts, a {"count", "packages", "kinds"} draw, or 0."""
        return self.more_prompts.get(str(k), 0)

    def more_draws(self) -> list[tuple[int, tuple, int, int]]:
        """(leg, pool, first, end) of each leg that adds prompts: the leg's prompts are the end - first that a
        draw of `end` from the pool has and a draw of `first` has not. pool: () for the stdlib's train split
        (leg 1 draws its first prompts), else (packages, kinds); the legs that draw from one pool continue it."""
        drawn, out = {(): self.prompts["counts"]["train"]}, []
        for k in range(2, len(self.legs()) + 1):
            more = self.more_at(k)
            if more:
                pool = () if isinstance(more, int) else (
                    tuple(more["packages"]), tuple(kind for kind in KINDS if kind in more.get("kinds", ())))
                count = more if isinstance(more, int) else more["count"]
                first = drawn.get(pool, 0)
                drawn[pool] = first + count
                out.append((k, pool, first, first + count))
        return out

    def assets_dir(self) -> Path:
        return ASSETS / self.assets if len(Path(self.assets).parts) == 1 else Path(self.assets)


ANSWERS = ("target", "source")  # who answers a leg's added code tasks: the target (generated) or their source


def _check_more(where: str, more) -> None:
    """A leg's added prompts: a positive count, or {"count": n, "packages": [names], "kinds": [kinds] (optional)}."""
    def count_ok(n):
        return not isinstance(n, bool) and isinstance(n, int) and n >= 1

    if isinstance(more, dict):
        unknown = sorted(set(more) - {"count", "packages", "kinds", "answers"})
        packages, kinds = more.get("packages"), more.get("kinds", list(KINDS))
        if unknown:
            raise ValueError(f"{where} has unknown key {unknown[0]!r}; known: count, packages, kinds, answers")
        if more.get("answers", "target") not in ANSWERS:
            raise ValueError(f"{where}: answers must be one of {', '.join(ANSWERS)} (the target's own, generated; "
                             f"or the source each task was made from), got {more['answers']!r}")
        if more.get("answers") == "source" and not set(kinds) <= set(ANSWERED_KINDS):
            raise ValueError(f"{where}: answers \"source\" needs kinds with a source of their own: some of "
                             f"{', '.join(ANSWERED_KINDS)}, got {kinds!r}")
        if not count_ok(more.get("count")):
            raise ValueError(f"{where}: count must be a positive number of prompts, got {more.get('count')!r}")
        if not (isinstance(packages, list) and packages and all(isinstance(n, str) and n for n in packages)):
            raise ValueError(f"{where}: packages must be a list of installed package names (e.g. [\"jax\", "
                             f"\"flax\"]), got {packages!r}")
        if not (isinstance(kinds, list) and kinds and set(kinds) <= set(KINDS)):
            raise ValueError(f"{where}: kinds must be a list of some of {', '.join(KINDS)}, got {kinds!r}")
    elif not count_ok(more):
        raise ValueError(f"{where} must be a positive number of prompts or {{\"count\": n, \"packages\": [...]}}, "
                         f"got {more!r}")


def _committed(name: str) -> Path | None:
    """A directory the set commits: a name under configs/sets/, or a path ("": none)."""
    if not name:
        return None
    return SET_DIR / name if len(Path(name).parts) == 1 else Path(name)


def _given_answers(spec: SetSpec, k: int) -> bool:
    """Whether leg k's added code tasks are answered by their own source (no generation)."""
    more = spec.more_at(k)
    return isinstance(more, dict) and more.get("answers") == "source"


def leg_prompts(work: Path, k: int) -> Path:
    """The training prompts that drafter leg k adds (`SetSpec.more_prompts`)."""
    return work / f"prompts_train_leg{k}.jsonl"


def leg_dir(work: Path, k: int) -> Path:
    """The training dir of drafter leg k (1-based); every leg reads leg 1's data cache."""
    return work / "distill" if k == 1 else work / f"distill-{k}"


def _as_json(settings) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(settings), default=str))


def _leg_settings(preset: str) -> dict:
    """A leg's settings as JSON would hold them (tuples as lists): what the state's records are compared by."""
    from train import distill

    return _as_json(distill.load_preset(preset))


def _same_settings(recorded: dict, preset: str) -> bool:
    """Whether a state's record of a leg's settings is what `preset` gives now. A field added after the record
    was written is missing from it and stands for its default (new fields default to the old behaviour)."""
    from train import distill

    default = _as_json(distill.DistillSettings())

    def sans_defaults(settings: dict) -> dict:
        return {sec: {k: v for k, v in values.items() if default.get(sec, {}).get(k, object()) != v}
                for sec, values in settings.items()}

    return sans_defaults(recorded) == sans_defaults(_leg_settings(preset))


_FOREIGN_STATES: set[Path] = set()  # states already reported as not this set's (the line prints once per run)


def committed_legs(spec: SetSpec) -> int:
    """How many of the set's legs its committed drafter state has finished: all of the state's legs must be
    the set's first ones, with the same settings and added prompts (else 0: the state is another chain's drafter)."""
    state = spec.state_dir()
    if state is None or not (state / LEGS_FILE).is_file() or not (state / "config.json").is_file():
        return 0
    done = json.loads((state / LEGS_FILE).read_text())["legs"]
    legs = spec.legs()
    if len(done) > len(legs) or any(not _same_settings(r["settings"], p) or r.get("more_prompts", 0) != spec.more_at(k)
                                    for k, (r, p) in enumerate(zip(done, legs), 1)):
        if state not in _FOREIGN_STATES:
            _FOREIGN_STATES.add(state)
            print(f"[recipe] drafter: the committed state {state} was trained by other legs than this set's; "
                  f"not used", flush=True)
        return 0
    return len(done)


def drafter_export(spec: SetSpec, work: Path) -> Path:
    """The drafter the later stages use: the last leg's export, or the committed state when it finished it."""
    last = leg_dir(work, len(spec.legs())) / "export"
    if not (last / "config.json").is_file() and committed_legs(spec) == len(spec.legs()):
        return spec.state_dir()
    return last


def stage_configs(name: str, spec: SetSpec, work: Path) -> list:
    """The typed run configs of the training stages (DistillRun, TracesRun, ScorerRun)."""
    from train import distill, scorer, traces

    target = spec.target_path()
    if name == "drafter":  # one run per leg; leg k > 1 starts from leg k - 1's drafter (here, or the state's)
        runs, have = [], committed_legs(spec)
        for k, preset in enumerate(spec.legs(), 1):
            settings = distill.load_preset(preset)
            if k > 1:
                prev = leg_dir(work, k - 1) / "export"
                start = prev if (prev / "config.json").is_file() or k - 1 > have else spec.state_dir()
                settings = dataclasses.replace(
                    settings, drafter=dataclasses.replace(settings.drafter, init_drafter=str(start)))
            runs.append(distill.DistillRun(target=target, out=leg_dir(work, k), settings=settings,
                                           prompts=work / "prompts_train.jsonl",
                                           more_prompts=tuple(spec.more_prompt_files(work, k)),
                                           val_prompts=work / "prompts_validation.jsonl", preset=preset, resume=True))
        return runs
    drafter_dir = drafter_export(spec, work)
    if name == "traces":
        t = dict(spec.traces)
        run = {k: t.pop(k) for k in ("batch_size", "num_prompts") if k in t}
        trace = traces.TraceConfig(**t)  # pool_width, budget, max_new_tokens, ...: unknown keys are refused
        return [traces.TracesRun(target=target, drafter=drafter_dir, prompts=work / "prompts_traces.jsonl",
                                 out=work / "traces", trace=trace, **run,
                                 distill_prompts=(work / "prompts_train.jsonl", *spec.more_prompt_files(work)))]
    if name == "scorer":
        steps = {"steps": spec.scorer["steps"]} if spec.scorer.get("steps") else {}
        return [scorer.ScorerRun(traces=work / "traces", target=target, out=work / out, resume=True,
                                 train=scorer.ScorerTrainConfig(labels=labels, residual=True, **steps))
                for out, labels in SCORERS]
    return []


def run_stage(name: str, spec: SetSpec, work: Path) -> None:
    assets = spec.assets_dir()
    if name == "prompts":
        p = spec.prompts
        # Each leg that adds prompts draws its pool's train split at a larger count and keeps what the draws before
        # did not have (a larger count extends a smaller one, `instructions.draw`).
        todo = [split for split in SPLITS if not _done(work / f"prompts_{split}.jsonl", f"prompts ({split})")]
        more = [d for d in spec.more_draws() if not _done(leg_prompts(work, d[0]), f"prompts (train_leg{d[0]})")]
        if todo or more:  # what `python -m train.instructions --split S --count N --seed S --chat-target T` writes
            from taps_jax.api import load_target
            from train import instructions

            target, seed, pools = load_target(spec.target_path()), p["seed"], {}

            def draw(key: tuple, split: str, count: int) -> list:
                if key not in pools:
                    if key:
                        print("[recipe] prompts: code tasks from " + ", ".join(
                            f"{n} {instructions.package_version(n)}" for n in key[0]), flush=True)
                    pools[key] = instructions.package_candidates(key[0]) if key else instructions.candidates()
                return instructions.draw(pools[key], split, count, seed, (key[1] or None) if key else None)

            jobs = [(work / f"prompts_{split}.jsonl", draw((), split, p["counts"][split]), False) for split in todo]
            for k, key, first, end in more:
                earlier = {ins.id for ins in draw(key, "train", first)} if first else set()
                jobs.append((leg_prompts(work, k), [ins for ins in draw(key, "train", end)
                                                    if ins.id not in earlier][:end - first], _given_answers(spec, k)))
            for file, drawn, given in jobs:
                overlaps = ""
                if given:  # the answers are trained on as text: none may overlap HumanEval either
                    drawn, n = instructions.without_humaneval_answers(drawn)
                    overlaps = f", {n} whose source overlaps HumanEval dropped; answered by their source"
                records, dropped = instructions.render_prompts(drawn, target, p["max_prompt_tokens"], answers=given)
                instructions.write_records(file, records)
                print(f"[recipe] prompts ({file.stem.removeprefix('prompts_')}): {len(records)} ({dropped} longer "
                      f"than {p['max_prompt_tokens']} tokens dropped{overlaps})", flush=True)
    elif name == "drafter":
        legs, have = spec.legs(), committed_legs(spec)
        for k, config in enumerate(stage_configs(name, spec, work), 1):
            label = name if len(legs) == 1 else f"{name} (leg {k} of {len(legs)}: {legs[k - 1]})"
            if k <= have and not (config.out / "export").is_dir():
                print(f"[recipe] {label}: done (the committed state {spec.state_dir()}), skipped", flush=True)
                continue
            if _done(config.out / "export" / "config.json", label):
                continue
            from train import distill
            from train.distill_data import unpack_answers

            data = leg_dir(work, 1) / "data"
            answers = spec.answers_dir()
            if answers is not None and answers.is_dir():
                for got in unpack_answers(answers, data):
                    print(f"[recipe] {label}: answers from {answers / got.name}.npz", flush=True)
            if k > 1 and not (config.out / "data").exists():  # the same answers and tap features as leg 1
                config.out.mkdir(parents=True, exist_ok=True)
                (config.out / "data").symlink_to(Path("..") / data.parent.name / "data")
            _run(distill, config, label)
    elif name == "answers":
        answers = spec.answers_dir()
        if answers is None:
            print(f"[recipe] {name}: skipped (the set names no answers directory)", flush=True)
        else:
            from train.distill_data import pack_answers

            packed = pack_answers(leg_dir(work, 1) / "data", answers)
            print(f"[recipe] {name}: {len(packed)} new answer sets in {answers}"
                  + "".join(f"\n  {p.name} ({p.stat().st_size / 1e6:.2f} MB)" for p in packed), flush=True)
    elif name == "state":
        state = spec.state_dir()
        if state is None:
            print(f"[recipe] {name}: skipped (the set names no drafter_state directory)", flush=True)
        else:
            pack_state(spec, work, state)
    elif name == "traces":
        if not _done(work / "traces" / "DONE", name):
            from train import traces

            config, = stage_configs(name, spec, work)
            _run(traces, config, name)
            (work / "traces" / "DONE").write_text("complete\n")
    elif name == "scorer":
        from train import scorer

        for config, (out, labels) in zip(stage_configs(name, spec, work), SCORERS):
            if not _done(work / out / "scorer" / "config.json", f"{name} ({labels} labels)"):
                _run(scorer, config, name)
    elif name == "lookup":
        if not _done(work / LOOKUP_FILE, name):
            from train import lookup_table

            lookup_table.fit_stage(spec.target_path(), drafter_export(spec, work), work / "prompts_traces.jsonl",
                                   work / LOOKUP_FILE, **spec.lookup)
    elif name == "adaptive":
        if not _done(work / TABLE_FILE, name):
            from train import adaptive_table

            adaptive_table.fit_stage(spec.target_path(), drafter_export(spec, work),
                                     [work / out / "scorer" for out, _ in SCORERS], work / "prompts_traces.jsonl",
                                     work / TABLE_FILE, lookup_file=work / LOOKUP_FILE, **spec.adaptive)
    elif name == "assemble":
        assemble(spec, work, assets)
    elif name == "report":
        report(spec, work, assets)


def pack_state(spec: SetSpec, work: Path, state: Path) -> None:
    """The last finished leg's drafter into `state` in bfloat16 (the bytes `assemble` ships), with legs.json:
    each finished leg's preset, settings, clocks and validation curve (legs finished before this machine's
    from the old state's records). Replaced whole, never half-written; nothing new: kept as it is."""
    from taps_jax.decoder import load_drafter
    from train.compare_runs import curve

    legs, have = spec.legs(), committed_legs(spec)
    here = [k for k in range(1, len(legs) + 1) if (leg_dir(work, k) / "export" / "config.json").is_file()]
    chain = [k for k in here if all(j in here or j <= have for j in range(1, k))]
    if not chain or chain[-1] <= have:
        print(f"[recipe] state: nothing newer than {state} ({have} leg(s)), skipped", flush=True)
        return
    last = chain[-1]
    old = json.loads((state / LEGS_FILE).read_text())["legs"] if have else []
    records = []
    for k in range(1, last + 1):
        if k not in here:
            records.append(old[k - 1])
            continue
        run = leg_dir(work, k)
        points = curve(run, "cpu_s")
        with (run / "metrics.csv").open(newline="") as f:
            final = list(csv.DictReader(f))[-1]
        more = spec.more_at(k)
        records.append({"leg": k, "preset": legs[k - 1], "settings": _leg_settings(legs[k - 1]),
                        **({"more_prompts": more} if more else {}),
                        "steps": int(final["step"]), "cpu_s": float(final["cpu_s"] or 0),
                        "elapsed_s": float(final["elapsed_s"]),
                        "validation": [{"step": p["step"], "acc_1": p["acc_1"], "tau_chain": p["tau_chain"]}
                                       for p in points]})
    tmp = state.with_name(state.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    load_drafter(leg_dir(work, last) / "export", dtype="bfloat16").save(tmp)
    (tmp / LEGS_FILE).write_text(json.dumps({"legs": records}, indent=1))
    aside = state.with_name(state.name + ".old")
    shutil.rmtree(aside, ignore_errors=True)
    if state.exists():
        state.rename(aside)
    tmp.rename(state)
    shutil.rmtree(aside, ignore_errors=True)
    best = records[-1]["validation"][-1] if records[-1]["validation"] else {}
    print(f"[recipe] state: leg {last} of {len(legs)} ({legs[last - 1]}) in {state}"
          + (f": validation acc_1 {best['acc_1']:.3f}, chain tau {best['tau_chain']:.2f}" if best else ""),
          flush=True)


def assemble(spec: SetSpec, work: Path, assets: Path) -> None:
    """The set in the package in compact form: the target's pointer, drafter and scorers in bfloat16."""
    from taps_jax import load_scorer
    from taps_jax.decoder import load_drafter

    tmp = assets.with_name(assets.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    target = spec.target_path()
    shipped = ASSETS / spec.target / POINTER
    if shipped.is_file():  # a model file of another package: keep the pointer (name, sha256, install line)
        shutil.copy(shipped, tmp / POINTER)
    else:
        (tmp / POINTER).write_text(json.dumps({"path": str(target.resolve()), "sha256": file_sha256(target)}
                                              if target.is_file() else {"path": str(target.resolve())}, indent=2))
    load_drafter(drafter_export(spec, work), dtype="bfloat16").save(tmp / "drafter")
    for out, _ in SCORERS:
        scorer_dir = work / out / "scorer"
        if (scorer_dir / "config.json").exists():
            load_scorer(scorer_dir).save(tmp / out.removesuffix("_train"))
    shutil.copy(work / "prompts_heldout.jsonl", tmp / "prompts_heldout.jsonl")
    for name in (TABLE_FILE, LOOKUP_FILE):
        if (work / name).is_file():
            shutil.copy(work / name, tmp / name)
    for name in ("report.json", "report.png", "report_t1.png"):  # the last report stays until the next one
        if (assets / name).is_file():
            shutil.copy(assets / name, tmp / name)
    shutil.rmtree(assets, ignore_errors=True)
    tmp.rename(assets)  # never leave a half-written set in the package
    size = sum(f.stat().st_size for f in assets.rglob("*") if f.is_file())
    print(f"[recipe] assembled {assets} ({size / 2**20:.1f} MiB)", flush=True)


def report(spec: SetSpec, work: Path, assets: Path) -> None:
    """taps-bench on the assembled set at T=0 and T=1 (chat prompts): ASSETS/report.json and the plots."""
    from decode import bench

    r = spec.report
    runs = {}
    for key, temperature, png in (("greedy", 0.0, "report.png"), ("sampled", 1.0, "report_t1.png")):
        out, plot = work / f"report_{key}.json", work / f"report_{key}.png"
        if not _done(out, f"report ({key})"):
            code = bench.main(["--model", str(assets), "--prompts", str(r["prompts"]), "--chat",
                               "--policies", "ar,chain,ddtree,taps,adaptive", "--budgets", str(r["budgets"]),
                               "--num-prompts", str(r["num_prompts"]), "--max-new-tokens", str(r["max_new_tokens"]),
                               "--temperature", str(temperature), "--json", str(out), "--plot", str(plot),
                               *(["--no-stages"] if temperature else [])])
            if code:
                raise SystemExit(f"[recipe] stage report failed with exit status {code}")
        runs[key] = json.loads(out.read_text())
        shutil.copy(plot, assets / png)
    (assets / "report.json").write_text(json.dumps(runs, indent=2))
    print(f"[recipe] report: {assets / 'report.json'}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.set_recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="smollm2", help="configs/sets/NAME.json (or a JSON path) (default smollm2)")
    p.add_argument("--work", type=Path, default=None, help="working dir for all stages (default runs/<set>)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset, in order (default: all)")
    p.add_argument("--through-leg", type=int, default=None, metavar="K",
                   help="build on the drafter chain's first K legs (default: all), e.g. to refit the set on the "
                        "committed leg while a later leg trains")
    p.add_argument("--dry-run", action="store_true", help="print each stage's run config, run nothing")
    compile_cache.add_flag(p)
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    try:
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage {unknown[0]!r}; stages: {', '.join(STAGES)}")
        spec = SetSpec.read(args.set)
        if args.through_leg is not None:
            spec = spec.through(args.through_leg)
        work = args.work or Path("runs") / Path(args.set).stem
        if args.dry_run:
            for name in stages:
                configs = stage_configs(name, spec, work)
                for config in configs:
                    print(f"[recipe] {name}: run({config})")
                if not configs:
                    print(f"[recipe] {name}: (see the module docstring)")
            return 0
        from decode.common import check_output_path

        for out in (work, spec.assets_dir()):
            check_output_path(out, directory=True)  # before any stage runs
        spec.target_path()  # the target is installed and intact
        if "prompts" in stages:  # the packages that legs still to draw take their prompts from are installed
            for k, key, _, _ in spec.more_draws():
                for name in key[0] if key and not leg_prompts(work, k).exists() else ():
                    package_root(name)
        compile_cache.setup(args)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    for name in STAGES:
        if name in stages:
            run_stage(name, spec, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
