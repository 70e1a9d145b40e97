"""One process: the paged engine's 50-client closed loop (no HTTP) at ROOT's code, as
`python -m handler bench engine-loop` runs it; the same requests for every ROOT.
    python loop1.py ROOT MODEL_DIR DTYPE QUANTIZE(or -) REQUESTS"""
import os, random, sys, time
root, model_dir, dtype, quantize, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
sys.path.insert(0, root)
import handler, kernels  # noqa
assert handler.__file__.startswith(root) and kernels.__file__.startswith(root), (handler.__file__, kernels.__file__)
import torch
try:
    from handler.tools.bench.inprocess import make_engine      # the tree after issue 56
except ImportError:
    from benchmarks.step_floor import make_engine               # before it
from handler.engine.loop import ErrorEvent
from handler.engine.request import SamplingParams
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
engine = make_engine(model_dir, dtype, 64, 12800, prefill_tokens=4096, quantize=None if quantize == "-" else quantize)
step = getattr(engine, "step", None) or engine._iteration
vocab = engine.tokenizer.vocab_size


def draw(k, seed):
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab - 10) for _ in range(rng.choice((15, 60, 160)))], rng.choice((16, 32, 64)))
            for _ in range(k)]


def loop(reqs, conc=50):
    live, nxt, tokens, done = {}, 0, 0, 0
    def sub(i):
        return engine.submit([reqs[i][0]], SamplingParams(max_new_tokens=reqs[i][1], ignore_eos=True))[0]
    while nxt < min(conc, len(reqs)):
        live[nxt] = sub(nxt); nxt += 1
    t0, c0 = time.perf_counter(), os.times()
    while live:
        step()
        for i, ch in list(live.items()):
            while not ch.events.empty():
                ev = ch.events.get()
                if isinstance(ev, ErrorEvent):
                    raise RuntimeError(ev)
                tokens += 1
                if ev.done is not None:
                    del live[i]; done += 1
                    if nxt < len(reqs):
                        live[nxt] = sub(nxt); nxt += 1
    wall, c1 = time.perf_counter() - t0, os.times()
    return done / wall, tokens / wall, 1000 * ((c1.user - c0.user) + (c1.system - c0.system)) / tokens


loop(draw(50, -1))                                                   # warm-up
rps, tps, cpu = loop(draw(n, 0))
print(f"RESULT {root} {dtype} {quantize} {rps:.3f} req/s {tps:.1f} tok/s cpu {cpu:.2f}", flush=True)
