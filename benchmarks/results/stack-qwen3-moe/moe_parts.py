"""Where a 1-client decode step goes (a GGUF model served as `paged_gguf` serves it): the step, the model's
forward, its head and the layers (the C layer stack, or the Python layers with --no-stack), ms a step.

    HF_HUB_OFFLINE=1 python moe_parts.py MODEL_DIR [--prop option.key=value ...] [--no-stack] [--steps 100]
"""
import argparse, collections, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import torch
import handler.config as hc
from handler.engine.request import SamplingParams
from handler.model.cpu import Arms
from handler.tools.bench.inprocess import make_engine

ap = argparse.ArgumentParser()
ap.add_argument("model_dir")
ap.add_argument("--prop", action="append", default=[])
ap.add_argument("--no-stack", action="store_true")
ap.add_argument("--steps", type=int, default=100)
a = ap.parse_args()
torch.set_num_threads(2)
orig = hc.load_config
def with_props(path, model_dir, env=None):       # make_engine's file plus --prop lines
    with open(path, "a") as f:
        f.write("".join(p + "\n" for p in a.prop))
    return orig(path, model_dir, env=env)
hc.load_config = with_props
eng = make_engine(a.model_dir, "fp32", 4, 4096, quantize="gguf", arms=Arms(decode_stack=False) if a.no_stack else None)
m = eng.runner.model
acc = collections.defaultdict(float)
def timed(name, obj, attr="forward"):
    f = getattr(obj, attr)
    def w(*args, **kw):
        t = time.perf_counter(); r = f(*args, **kw); acc[name] += time.perf_counter() - t; return r
    setattr(obj, attr, w)
timed("head", m.lm_head); timed("forward", m, "step")
if m.decode_stack is not None:
    timed("layers", m.decode_stack, "run")
else:
    for layer in m.model.layers:
        timed("layers", layer)
eng.submit([list(range(100, 160))], SamplingParams(max_new_tokens=a.steps + 50, ignore_eos=True))
for _ in range(10):
    eng.step()
acc.clear()
t = time.perf_counter()
for _ in range(a.steps):
    eng.step()
step = (time.perf_counter() - t) / a.steps * 1e3
print(f"RESULT stack={m.decode_stack is not None} props={a.prop} step {step:.2f} ms | " +
      " ".join(f"{k} {v / a.steps * 1e3:.2f}" for k, v in acc.items()), flush=True)
