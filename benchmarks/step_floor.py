"""Engine decode step against the bare forward of the same batch (the floor).

    python benchmarks/step_floor.py --model-dir DIR [--dtype fp32|bf16] [--batch 32,64]
        [--prompt-tokens 100] [--steps 16] [--reps 3] [--arm NAME=VALUE ...] [--out step_floor.json]

For each batch size B: B sequences of the same prompt length are prefilled through the
paged engine (driven in this thread, no HTTP), then `--steps` decode iterations are timed:

  engine     one engine iteration: schedule, pack, forward, sample, update, detokenize, emit
  runner     runner.step alone (pack + forward + sample)
  forward    the model forward inside runner.step (paged attention, no host work around it)
  floor      transformers' own decode forward of the same B x 1 tokens over a DynamicCache
             holding the same contexts (SDPA, no padding: equal prompt lengths; its linear
             layers packed as the engine's are), i.e. what `model.generate` pays per step
  gemm       the bare-GEMM floor: every linear layer of the engine's model (packed as it
             serves) called once on B rows, the head included, nothing else: what a step
             cannot go below without faster kernels; forward - gemm is attention + the Python
             and small ops around the kernels

Repetitions interleave engine and floor; the ratio engine / floor is taken per repetition and
its median reported. Greedy tokens of the two are compared as a sanity check.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from handler.engine.request import SamplingParams  # noqa: E402
from handler.tools.bench.inprocess import make_engine, prefill  # noqa: E402,F401 (make_engine: the probes' import)


def _sync() -> None:
    """Wait for the GPU's queued work (CUDA runs asynchronously: a host clock alone times the
    launches); nothing on CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timed:
    """Wraps a callable; accumulates its wall time (its GPU work included)."""

    def __init__(self, fn):
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        _sync()
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            _sync()
            self.total += time.perf_counter() - t
            self.calls += 1


def engine_decode(engine, prompts: list[list[int]], steps: int) -> dict:
    """Prefill `prompts`, then time `steps` all-decode iterations. -> per-step seconds."""
    params = SamplingParams(max_new_tokens=steps + 4, ignore_eos=True)
    chans = engine.submit(prompts, params)
    sched = engine.scheduler
    prefill(engine)
    runner = engine.runner
    step, fwd = Timed(runner.step), Timed(runner.forward)
    runner.step, runner.forward = step, fwd
    try:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t
    finally:
        del runner.step, runner.forward     # back to the class's methods
    while sched.has_work:
        engine.step()
    toks = []
    for ch in chans:
        ids = []
        while not ch.events.empty():
            ev = ch.events.get()
            ids.append(ev.id)
        toks.append(ids)
    return {"engine": total / steps, "runner": step.total / steps, "forward": fwd.total / steps,
            "tokens": toks}


def hf_model(model_dir: str, dtype: str, device: torch.device):
    """transformers' model of the checkpoint on the engine's device, its linear layers packed as
    the runner packs ours on CPU."""
    from transformers import AutoModelForCausalLM

    from handler.model.cpu import prepack_linears
    from handler.model.runner import DTYPES
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa").eval()
    model.to(device)
    if next(model.parameters()).device.type == "cpu":
        prepack_linears(model)
    return model


@torch.inference_mode()
def gemm_floor(model, batch: int, steps: int) -> float:
    """Per step: every nn.Linear of `model` (as packed) once on [batch, in] rows."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dt = next(model.parameters()).dtype
    dev = next(model.parameters()).device
    xs = {m.in_features: torch.randn(batch, m.in_features).to(device=dev, dtype=dt) for m in linears}
    for m in linears:
        m(xs[m.in_features])
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        for m in linears:
            m(xs[m.in_features])
    _sync()
    return (time.perf_counter() - t) / steps


@torch.inference_mode()
def hf_floor(model, prompts: list[list[int]], steps: int) -> dict:
    """transformers' decode forward over a DynamicCache (the same model object: without the
    engine's step metadata its attention falls back to SDPA)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    toks = [nxt]
    pos = ids.shape[1]
    _sync()
    t = time.perf_counter()
    for i in range(steps):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                    position_ids=torch.full_like(nxt, pos + i), logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
    _sync()
    total = time.perf_counter() - t
    return {"floor": total / steps, "tokens": torch.cat(toks, 1).tolist()}


def profile_engine(engine, prompts: list[list[int]], steps: int, rows: int = 20) -> str:
    from torch.profiler import ProfilerActivity, profile

    chans = engine.submit(prompts, SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))
    sched = engine.scheduler
    prefill(engine)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
    while sched.has_work:
        engine.step()
    del chans
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--batch", default="32,64")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top operators of the engine's decode iterations")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=VALUE",
                   help="an A/B arm of the CPU paths, repeatable (handler/model/cpu.py Arms: prepack=0, "
                        "gemm=onednn, bf16_gemm=panels|bf16|fp32, kv_layout=token, decode_stack=0)")
    a = p.parse_args(argv)
    from handler.model.cpu import Arms
    try:
        arms = Arms.parse(a.arm)
    except ValueError as e:
        p.error(str(e))
    if a.threads:
        torch.set_num_threads(a.threads)
    results = {"model_dir": a.model_dir, "dtype": a.dtype, "prompt_tokens": a.prompt_tokens, "arms": a.arm,
               "steps": a.steps, "torch_threads": torch.get_num_threads(), "batches": {}}
    for b in (int(x) for x in a.batch.split(",")):
        per_seq = -(-(a.prompt_tokens + a.steps + 8) // 16) * 16
        engine = make_engine(a.model_dir, a.dtype, b, b * per_seq + 64, arms=arms)
        vocab = engine.runner.model.config.vocab_size
        # Distinct prompts (no prefix sharing), ids away from the special tokens.
        prompts = [[(7 + 31 * s + 17 * i) % (vocab - 10) + 5 for i in range(a.prompt_tokens)] for s in range(b)]
        rows = []
        hf = hf_model(a.model_dir, a.dtype, engine.runner.device)
        for _ in range(a.reps):
            e = engine_decode(engine, prompts, a.steps)
            f = hf_floor(hf, prompts, a.steps)
            g = gemm_floor(engine.runner.model, b, a.steps)
            same = sum(x[:len(y)] == y[:len(x)] for x, y in zip(e["tokens"], f["tokens"]))
            rows.append({k: v for k, v in e.items() if k != "tokens"} | {"floor": f["floor"], "gemm": g,
                        "ratio": e["engine"] / f["floor"], "forward_over_gemm": e["forward"] / g,
                        "greedy_rows_equal": same})
            print(f"B={b}: engine {e['engine']*1e3:.1f} ms (runner {e['runner']*1e3:.1f}, forward "
                  f"{e['forward']*1e3:.1f}, bare GEMMs {g*1e3:.1f} -> forward {e['forward']/g:.2f}x GEMMs), "
                  f"transformers floor {f['floor']*1e3:.1f} ms -> {rows[-1]['ratio']:.3f}x; "
                  f"greedy rows equal {same}/{b}", flush=True)
        if a.profile:
            print(profile_engine(engine, prompts, a.steps), flush=True)
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("engine", "runner", "forward", "floor", "gemm", "ratio", "forward_over_gemm")}
        results["batches"][b] = {"reps": rows, "median": med}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
