"""Per-repetition TTFT/TPOT of a `bench compare` run's records: python perrep.py RUN_DIR/lmi [clients]"""
import json, os, statistics as st, sys
d = sys.argv[1]; c = sys.argv[2] if len(sys.argv) > 2 else None
def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(q * len(xs)))]
for f in sorted(os.listdir(d)):
    if not f.endswith(".records.json"):
        continue
    recs = json.load(open(os.path.join(d, f)))
    if isinstance(recs, list):      # no load curve: the repetitions at the workload's concurrency
        recs = {"-": recs}
    for clients, reps in recs.items():
        if c and clients != c:
            continue
        for i, rep in enumerate(reps):
            ok = [x for x in rep if not x["error"]]
            tpot = [(x["end"] - x["start"] - x["ttft"]) / (x["tokens"] - 1) for x in ok if x["tokens"] > 1]
            ttft = [x["ttft"] for x in ok]
            wall = max(x["end"] for x in rep) - min(x["start"] for x in rep)
            print(f"{f[:-13]:10s} c{clients} rep{i + 1}: {len(ok) / wall:.3f} req/s  TPOT p50 {st.median(tpot) * 1e3:6.1f} "
                  f"p90 {pct(tpot, .9) * 1e3:6.1f} ms  TTFT p50 {st.median(ttft) * 1e3:6.0f} p90 {pct(ttft, .9) * 1e3:6.0f} ms")
