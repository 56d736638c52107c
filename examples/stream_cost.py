"""What streaming costs: `GenerateCall.run()` vs `.stream(chunk)` on the embedded default.

    python examples/stream_cost.py

Each form compiled ahead of time, 128 new tokens (EOS ignored), 7 interleaved
repeats; prints the median wall time of each and its ratio to run().
"""
import statistics, time
from taps_jax.decoder import load_model_set, DEFAULT_MODEL_DIR, SpeculativeDecoder
m = load_model_set(DEFAULT_MODEL_DIR)
prompt = ["class Stack:\n    def push(self, item):"]
for policy in ("ar", "ddtree"):
    d = SpeculativeDecoder(m.target, m.drafter, policy, 32)
    calls = {}
    for mode in ("run", 1, 4):
        c = d.prepare(prompt, 128, stop_at_eos=False)
        c.compile(stream=mode != "run")
        calls[mode] = c
    times = {k: [] for k in calls}
    for _ in range(7):
        for mode, c in calls.items():
            t = time.perf_counter()
            if mode == "run":
                r = c.run()
            else:
                for r in c.stream(mode):
                    pass
            times[mode].append(time.perf_counter() - t)
    base = statistics.median(times["run"])
    for mode, ts in times.items():
        print(f"{policy:6s} {str(mode):4s} median {statistics.median(ts)*1e3:7.1f} ms  (min {min(ts)*1e3:.1f} max {max(ts)*1e3:.1f})  x{statistics.median(ts)/base:.3f} of run()")
