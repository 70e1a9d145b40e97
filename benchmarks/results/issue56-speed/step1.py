"""One process: a 1-client decode step of the engine at ROOT's code (median and min ms over 5 runs of `steps` iterations).
    python step1.py ROOT MODEL_DIR DTYPE QUANTIZE(or -) STEPS"""
import os, statistics, sys, time
root, model_dir, dtype, quantize, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
sys.path.insert(0, root)
import handler, kernels  # noqa
assert handler.__file__.startswith(root) and kernels.__file__.startswith(root), (handler.__file__, kernels.__file__)
import torch
try:
    from handler.tools.bench.inprocess import make_engine      # the tree after issue 56
except ImportError:
    from benchmarks.step_floor import make_engine               # before it
from handler.engine.request import SamplingParams
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
engine = make_engine(model_dir, dtype, 4, 4096, quantize=None if quantize == "-" else quantize)
engine.submit([list(range(100, 160))], SamplingParams(max_new_tokens=10 + 5 * steps + 8, ignore_eos=True))
step = getattr(engine, "step", None) or engine._iteration
for _ in range(10):
    step()
runs, cpu = [], []
for _ in range(5):
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    runs.append((time.perf_counter() - t) / steps * 1e3)
    cpu.append((time.process_time() - c) / steps * 1e3)     # CPU time of this process: less moved by other load
print(f"RESULT {root} {dtype} {quantize} {statistics.median(runs):.3f} " + " ".join(f"{x:.2f}" for x in runs)
      + f" cpu {statistics.median(cpu):.3f} min {min(runs):.3f}", flush=True)
