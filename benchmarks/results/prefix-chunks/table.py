"""Per cell and arm (B: before, N: after) the repetitions' req/s and TPOT/TTFT, and after / before of the
means: python3 benchmarks/results/prefix-chunks/table.py"""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
cells: dict = {}
for path in sorted(glob.glob(os.path.join(HERE, "runs", "*.json"))):
    cell, arm, _ = os.path.basename(path).rsplit("-", 2)
    with open(path) as f:
        cells.setdefault(cell, {}).setdefault(arm, []).extend(json.load(f)["runs"])
print("| cell | arm | req/s (each repetition) | mean | TPOT p50 / p90 ms (means) | TTFT p50 / p90 s (means) |")
print("|---|---|---|---:|---:|---:|")
for cell, arms in cells.items():
    mean = {}
    for arm in ("B", "N"):
        runs = arms.get(arm, [])
        if not runs:
            continue
        m = {k: statistics.mean(r[k] for r in runs) for k in ("req_per_s", "tpot_p50_ms", "tpot_p90_ms",
                                                              "ttft_p50_ms", "ttft_p90_ms")}
        mean[arm] = m
        reps = ", ".join(f"{r['req_per_s']:.2f}" for r in runs)
        print(f"| {cell} | {'before' if arm == 'B' else 'after'} | {reps} "
              f"| {m['req_per_s']:.2f} | {m['tpot_p50_ms']:.0f} / {m['tpot_p90_ms']:.0f} "
              f"| {m['ttft_p50_ms'] / 1000:.2f} / {m['ttft_p90_ms'] / 1000:.2f} |")
    if len(mean) == 2:
        print(f"| {cell} | after / before | | **{mean['N']['req_per_s'] / mean['B']['req_per_s']:.2f}x** "
              f"| {mean['N']['tpot_p50_ms'] / mean['B']['tpot_p50_ms']:.2f} / "
              f"{mean['N']['tpot_p90_ms'] / mean['B']['tpot_p90_ms']:.2f} "
              f"| {mean['N']['ttft_p50_ms'] / mean['B']['ttft_p50_ms']:.2f} / "
              f"{mean['N']['ttft_p90_ms'] / mean['B']['ttft_p90_ms']:.2f} |")
