"""Quality of a served precision against another: perplexity of fixed held-aside text and greedy agreement.

    python -m handler quality --model-dir DIR [--quantize int8|awq|gptq|gguf] [--dtype fp32]
        [--baseline-dtype fp32] [--baseline-dir DIR] [--max-new-tokens 48] [--out quality.json]
        [--kv-cache-dtype int8]     (the candidate's KV cache, e.g. `--quantize '' --kv-cache-dtype int8`:
                                     the same weights over an int8 KV cache against the model's dtype)

Both arms are the server's own engine (paged strategy, in this process, one after the other):
  perplexity   exp(-mean log-prob) of every token of each text but the first, read from the
               engine's prompt log-probs (TGI's `decoder_input_details`, what /generate returns)
  agreement    over chat prompts (the model's chat template), greedy, two ways:
                 teacher-forced  at each position of the baseline's answer, fed the baseline's
                                 tokens so far, whether the candidate's argmax is the baseline's
                                 next token (token-level agreement, what a quantization moves)
                 free-running    the share of the baseline's answer tokens the candidate's own
                                 greedy answer has at the same position (one early near-tie flip
                                 counts every later token as a disagreement: harsh; fp32 against
                                 bf16 of the same weights scores 0.74 on SmolLM2-135M)
The texts are fixed here (English prose and Python written for this check, not drawn from any
training set we know of), so every run measures the same thing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

ENGLISH = """\
The lighthouse keeper kept two logs. The first was the official one, a ledger of wind speeds,
passing ships and the hours the lamp had burned, written in a careful hand because inspectors
read it twice a year. The second was a school notebook with a torn cover, and in it she wrote
what the ledger had no columns for: the morning a seal slept on the landing stage, the winter
the harbour froze so hard that the baker walked across it with a tray of bread, the night a
fishing boat came in with no lights and a crew who would not say where they had been.

When the station was automated, the inspectors took the ledger to a museum in the capital. Nobody
asked for the notebook. She kept it in a drawer with spare batteries and a tide table, and years
later her grandson found it while looking for a screwdriver. He read it in one sitting, standing
up, and then he went outside and looked at the water for a long time, as if it might explain
something the notebook had left out.

Maps are agreements more than pictures. A border drawn across a desert says less about the sand
than about the people who signed the treaty, and a city plan shows the streets that someone
intended rather than the paths that people actually wear into the grass between buildings.
"""

PYTHON = '''\
from dataclasses import dataclass, field


@dataclass
class Inventory:
    """Items on hand, by name, with a reorder threshold for each."""
    counts: dict[str, int] = field(default_factory=dict)
    thresholds: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, quantity: int = 1) -> None:
        if quantity <= 0:
            raise ValueError(f"quantity must be positive, got {quantity}")
        self.counts[name] = self.counts.get(name, 0) + quantity

    def remove(self, name: str, quantity: int = 1) -> None:
        have = self.counts.get(name, 0)
        if quantity > have:
            raise KeyError(f"only {have} of {name!r} on hand")
        self.counts[name] = have - quantity

    def to_reorder(self) -> list[str]:
        """Names whose count fell to their threshold or below, sorted."""
        return sorted(name for name, limit in self.thresholds.items()
                      if self.counts.get(name, 0) <= limit)


def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
'''

CHAT = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the square of a number.",
    "What is 12 times 12?",
    "Give me a short tip for learning a new language.",
    "What gas do plants take in from the air?",
    "Translate 'good morning' into Spanish.",
]

TEXTS = {"english": ENGLISH, "python": PYTHON}


def engine_for(model_dir: str, dtype: str, quantize: str | None, kv_cache_dtype: str = "auto",
               extra: dict | None = None, arms=None):
    from handler.config import load_config
    from handler.server import build_engine

    props = {"option.rolling_batch": "auto", "option.paged_attention": "true", "option.dtype": dtype,
             "option.max_rolling_batch_size": "16", "option.max_model_len": "2048"}
    if quantize:
        props["option.quantize"] = quantize
    if kv_cache_dtype != "auto":
        props["option.kv_cache_dtype"] = kv_cache_dtype
    props.update(extra or {})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "serving.properties")
        with open(path, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in props.items()))
        return build_engine(load_config(path, model_dir, env={}), arms=arms)


def _wait(ch):
    from handler.engine.loop import ErrorEvent
    ids = []
    while True:
        ev = ch.events.get(timeout=600)
        if isinstance(ev, ErrorEvent):
            raise RuntimeError(ev.message)
        ids.append(ev.id)
        if ev.done:
            return ids, ev.done


def perplexity(engine, text: str) -> tuple[float, int]:
    """(perplexity, tokens scored) of `text` from the engine's prompt log-probs."""
    from handler.engine.request import SamplingParams
    ids = engine.tokenize(text)
    ch = engine.submit([ids], SamplingParams(max_new_tokens=1, decoder_input_details=True))[0]
    _, done = _wait(ch)
    lps = [lp for _, _, lp in done.prefill if lp is not None]
    return math.exp(-sum(lps) / len(lps)), len(lps)


def chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def chat_answers(engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from handler.engine.request import SamplingParams
    chans = [engine.submit([ids], SamplingParams(max_new_tokens=max_new))[0] for ids in prompts]
    return [_wait(ch)[0] for ch in chans]


def argmax_rows(runner, ids: list[int]) -> list[int]:
    """The runner's argmax after each position of `ids` (one packed prefill step, every row kept;
    run on an engine that is shut down, so the pool's first blocks are free)."""
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    from handler.model.runner import pack_step
    bs = runner.block_size
    table = list(range(-(-len(ids) // bs)))
    item = StepItem(0, ids, 0, table, False, SamplingParams(max_new_tokens=1), ids, prompt_logprobs=True)
    packed, _ = pack_step([item], bs)
    return runner.forward(packed).argmax(-1).tolist()


def teacher_forced(runner, prompts: list[list[int]], answers: list[list[int]]) -> tuple[int, int]:
    """(positions where the candidate's argmax is the baseline's next token, positions)."""
    same = total = 0
    for p, ans in zip(prompts, answers):
        top = argmax_rows(runner, p + ans)
        for i, tok in enumerate(ans):
            same += top[len(p) - 1 + i] == tok
            total += 1
    return same, total


def agreement(base: list[int], cand: list[int]) -> float:
    """Share of the baseline's tokens the candidate has at the same position."""
    same = sum(1 for a, b in zip(base, cand) if a == b)
    return same / max(len(base), 1)


def weight_bytes(model) -> int:
    """Bytes the weights hold: parameters plus the packed / quantized copies layers keep beside them."""
    from handler.model.linear import packs
    held = {id(t): t for t in [*model.parameters(), *(t for p in packs(model) for t in p.held())]}
    return sum(t.numel() * t.element_size() for t in held.values())


def measure(model_dir: str, dtype: str, quantize: str | None, max_new: int, reference=None,
            kv_cache_dtype: str = "auto", extra: dict | None = None) -> dict:
    """One arm; `reference` (the baseline's answers): also its teacher-forced agreement. `extra`: more
    serving.properties (e.g. option.quantize_head)."""
    engine = engine_for(model_dir, dtype, quantize, kv_cache_dtype, extra)
    forced = None
    try:
        ppl = {name: perplexity(engine, text) for name, text in TEXTS.items()}
        prompts = chat_ids(engine.runner.tokenizer, CHAT)
        answers = chat_answers(engine, prompts, max_new)
        weights = weight_bytes(engine.runner.model)
    finally:
        engine.shutdown()
    if reference is not None:
        forced = teacher_forced(engine.runner, prompts, reference)
    return {"dtype": dtype, "quantize": quantize, "kv_cache_dtype": kv_cache_dtype, "teacher_forced": forced, "perplexity": {k: round(v, 4) for k, (v, _) in ppl.items()},
            "tokens_scored": {k: n for k, (_, n) in ppl.items()}, "answers": answers,
            "weight_bytes": weights}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m handler quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--quantize", default="int8")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--baseline-dtype", default="fp32")
    p.add_argument("--baseline-dir", help="the baseline's model (default --model-dir): e.g. the float model an "
                                          "AWQ/GPTQ checkpoint was made from")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--kv-cache-dtype", default="auto", help="the candidate's option.kv_cache_dtype (auto, int8)")
    p.add_argument("--property", action="append", default=[], metavar="KEY=VALUE",
                   help="another serving.properties line for the candidate (e.g. option.quantize_head=true)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    extra = dict(kv.split("=", 1) for kv in a.property if "=" in kv)
    if len(extra) != len(a.property):
        p.error("--property takes KEY=VALUE")
    base = measure(a.baseline_dir or a.model_dir, a.baseline_dtype, None, a.max_new_tokens)
    cand = measure(a.model_dir, a.dtype, a.quantize or None, a.max_new_tokens, reference=base["answers"],
                   kv_cache_dtype=a.kv_cache_dtype, extra=extra)
    agree = [agreement(b, c) for b, c in zip(base["answers"], cand["answers"])]
    total = sum(len(b) for b in base["answers"])
    result = {
        "model_dir": a.model_dir, "baseline_dir": a.baseline_dir or a.model_dir, "baseline": base, "candidate": cand,
        "perplexity_ratio": {k: round(cand["perplexity"][k] / base["perplexity"][k], 4) for k in TEXTS},
        "teacher_forced_agreement": round(cand["teacher_forced"][0] / max(cand["teacher_forced"][1], 1), 4),
        "greedy_agreement": round(sum(x * len(b) for x, b in zip(agree, base["answers"])) / max(total, 1), 4),
        "greedy_agreement_per_prompt": [round(x, 3) for x in agree],
        "prompts_identical": sum(b == c for b, c in zip(base["answers"], cand["answers"])),
        "weight_bytes_ratio": round(cand["weight_bytes"] / base["weight_bytes"], 3),
    }
    print(f"perplexity {base['dtype']}: {base['perplexity']}; "
          f"{a.quantize or a.dtype}{' KV ' + a.kv_cache_dtype if a.kv_cache_dtype != 'auto' else ''}: {cand['perplexity']} "
          f"(ratio {result['perplexity_ratio']}); agreement teacher-forced "
          f"{result['teacher_forced_agreement']:.3f}, free-running {result['greedy_agreement']:.3f} "
          f"({result['prompts_identical']}/{len(CHAT)} answers identical); weights {cand['weight_bytes'] / 2**20:.0f} "
          f"MiB vs {base['weight_bytes'] / 2**20:.0f} MiB")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
