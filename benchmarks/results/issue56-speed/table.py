"""The before/after ratio table from bench.log and loopq.log (RESULT lines): per cell, the median over
each arm's processes (step1: each process's median of 5 runs; loop1: req/s), ratio = before / after
for times, after / before for req/s (> 1: after faster)."""
import re, statistics as st, sys, os
here = os.path.dirname(os.path.abspath(__file__))
cells = {}
for f in sys.argv[1:] or ("bench.log", "loopq.log"):
    for line in open(os.path.join(here, f)):
        if not line.startswith("RESULT"):
            continue
        p = line.split()
        root, quant = p[1], p[3]
        arm = "before" if "base56" in root else "after"
        if "req/s" in line:
            model = p[-1] if "model" in line else "qwen2.5-coder-0.5b"
            key = (f"50-client loop, {model} fp32 ({f})", "req/s")
            cells.setdefault(key, {}).setdefault(arm, []).append(float(p[4]))
        else:
            key = (f"1-client step, qwen2.5-coder-0.5b {'fp32' if quant == '-' else quant}", "ms")
            cells.setdefault(key, {}).setdefault(arm, []).append(float(p[4]))
print("| cell | before (bd3ee64) | after (main) | after speed / before | processes |")
print("|---|---:|---:|---:|---:|")
for (name, unit), arms in cells.items():
    b, a = st.median(arms["before"]), st.median(arms["after"])
    r = b / a if unit == "ms" else a / b
    print(f"| {name} | {b:.3f} {unit} | {a:.3f} {unit} | {r:.3f} | {len(arms['before'])}+{len(arms['after'])} |")
