"""`taps-bench --prompt-tokens 512,4096,16384`: prefill and decoding at real prompt lengths.

For each prompt length, prompts of exactly that many tokens are cut from
held-out text (by default the held-out split of the corpus the embedded set
was trained on; `--text FILE` for your own), and each row (AR, then every
policy x budget) is timed side by side: prefill alone (a generate of one
token), then a whole generate; decoding tokens/s is the difference. Each
timing is repeated (`--repeats`, median, min and max); rows are interleaved
per repeat so drift hits them alike. Peak memory per row: device bytes in
use on an accelerator, the process's peak RSS on CPU (reset before the row).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import jax
from tqdm import tqdm


def heldout_text() -> str:
    """The held-out split of the training corpus (files no training window ever saw), in a stable order."""
    from taps_jax.corpus import iter_texts

    return "\n\n".join(iter_texts("heldout"))


def long_prompts(target, lengths: list[int], count: int, text_file: Path | None = None) -> dict[int, list[list[int]]]:
    """{n: `count` prompts of exactly n token ids}: disjoint windows of the tokenized text."""
    if target.tokenizer is None:
        raise ValueError("--prompt-tokens needs the target's tokenizer.json to cut prompts from text")
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--text {text_file}: cannot read it as UTF-8 text ({e})") from None
    else:
        text = heldout_text()
    ids = target.tokenizer.encode(text)
    need = max(lengths) * count
    if len(ids) < need:
        source = text_file or "the held-out corpus"
        raise ValueError(f"{source} has {len(ids)} tokens, fewer than the {need} needed for {count} prompt(s) of "
                         f"{max(lengths)} tokens; pass a longer --text FILE or fewer/shorter --prompt-tokens")
    return {n: [ids[i * n:(i + 1) * n] for i in range(count)] for n in lengths}


def reset_peak_memory() -> None:
    """Start a new peak: on CPU, reset the kernel's peak-RSS mark (Linux; a no-op elsewhere)."""
    if jax.devices()[0].platform == "cpu":
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_memory_bytes() -> int | None:
    """Device bytes in use at peak on an accelerator; peak RSS of this process on CPU (None if unknown)."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_long_prompts(decoders: dict, prompts: dict[int, list[list[int]]], max_new_tokens: int, repeats: int,
                     temperature: float, seed: int) -> list[dict]:
    """Rows of prefill / decode figures, one per (prompt length, decoder name).

    decoders: {(policy, budget): SpeculativeDecoder}, AR included as ("ar", None).
    """
    kw = dict(temperature=temperature, seed=seed)
    rows = []
    for n, batch in prompts.items():
        runs = {name: {"prefill": [], "total": [], "peak": 0} for name in decoders}
        results = {}
        for name, dec in tqdm(decoders.items(), desc=f"{n} tokens: compile", unit="row"):
            reset_peak_memory()
            dec.generate(batch, 1, **kw)  # compile both programs (not timed)
            results[name] = dec.generate(batch, max_new_tokens, **kw)
            runs[name]["peak"] = peak_memory_bytes()
        for _ in tqdm(range(repeats), desc=f"{n} tokens: timing", unit="repeat"):
            for name, dec in decoders.items():
                reset_peak_memory()
                runs[name]["prefill"].append(_seconds(lambda: dec.generate(batch, 1, **kw)))
                runs[name]["total"].append(_seconds(lambda: dec.generate(batch, max_new_tokens, **kw)))
                peak = peak_memory_bytes()
                runs[name]["peak"] = max(runs[name]["peak"] or 0, peak or 0) or None
        ar_tokens = results[("ar", None)].tokens
        for (policy, budget), r in runs.items():
            res = results[(policy, budget)]
            generated = sum(map(len, res.tokens))
            prefill = _summary(r["prefill"])
            decode_s = [max(t - p, 1e-9) for t, p in zip(r["total"], r["prefill"])]
            rows.append({
                "prompt_tokens": n, "batch": len(batch), "policy": policy, "budget": budget,
                "prefill_ms": prefill["median"] * 1e3,
                "prefill_ms_min": prefill["min"] * 1e3, "prefill_ms_max": prefill["max"] * 1e3,
                "prefill_tokens_per_s": n * len(batch) / prefill["median"],
                "decode_tokens_per_s": (generated - len(batch)) / statistics.median(decode_s),
                "decode_ms_per_token": statistics.median(decode_s) * 1e3 / max(generated / len(batch) - 1, 1),
                "tau": res.stats.get("tau", 1.0),
                "lossless": (res.tokens == ar_tokens) if temperature == 0 else None,
                "peak_bytes": r["peak"],
            })
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'prompt':>7} {'policy':<8} {'budget':>6} {'prefill ms':>11} {'(min-max)':>15} {'prefill tok/s':>13} "
          f"{'decode tok/s':>12} {'ms/token':>8} {'tau':>5} {'lossless':>8} {'peak MiB':>9}")
    for r in rows:
        spread = f"{r['prefill_ms_min']:.0f}-{r['prefill_ms_max']:.0f}"
        lossless = "n/a" if r["lossless"] is None else str(r["lossless"])
        peak = "?" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        print(f"{r['prompt_tokens']:>7} {r['policy']:<8} {str(r['budget'] or '-'):>6} {r['prefill_ms']:>11.1f} "
              f"{spread:>15} {r['prefill_tokens_per_s']:>13.0f} {r['decode_tokens_per_s']:>12.1f} "
              f"{r['decode_ms_per_token']:>8.2f} {r['tau']:>5.2f} {lossless:>8} {peak:>9}")
    print("prefill: one generate of 1 token (median over repeats); decode: the rest of a generate, per new token. "
          "peak: device bytes in use (accelerator) or peak RSS of the whole process (CPU).")


def plot_rows(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_pre, ax_dec) = plt.subplots(1, 2, figsize=(10, 4))
    for key in dict.fromkeys((r["policy"], r["budget"]) for r in rows):
        sel = [r for r in rows if (r["policy"], r["budget"]) == key]
        label = key[0] if key[1] is None else f"{key[0]}-{key[1]}"
        xs = [r["prompt_tokens"] for r in sel]
        ax_pre.plot(xs, [r["prefill_tokens_per_s"] for r in sel], marker="o", label=label)
        ax_dec.plot(xs, [r["decode_tokens_per_s"] for r in sel], marker="o", label=label)
    for ax, title in ((ax_pre, "prefill tokens/s"), (ax_dec, "decode tokens/s after the prompt")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
