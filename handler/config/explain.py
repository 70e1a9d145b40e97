"""`python -m handler config --explain`: the KV-cache arithmetic of a serving.properties file,
without loading the model (config.json is read as JSON; no transformers; torch only where a GPU
device node exists, to ask about it). The rules are the server's own: handler/config/sizing.py.

What it answers, for the resolved configuration and an optional traffic mix
(prompt tokens P, requests asking max_new_tokens M, actual output lengths L drawn uniformly
from a list, as early stopping makes them):
  - KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes;
  - the KV pool in blocks and tokens (option.kv_cache_tokens, or the server's default sizing);
  - how many sequences fit at the model's full length, and at P + M;
  - rolling/none/dynamic reserve P + M per sequence: the share of reserved slots that never
    hold a token (at the end of a sequence, and averaged over its life);
  - paged holds ceil((P + t) / block_size) blocks at output token t: the steady-state demand of
    the running batch against the pool (above it, preemption) and the worst case;
  - warnings for settings that cannot help (e.g. max_rolling_batch_size above what the KV holds).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import asdict

from handler.config import sizing
# The sizing rules (handler/config/sizing.py) under the names this module has always had.
from handler.config.hardware import pick_device as resolve_device, pick_dtype as resolve_dtype  # noqa: F401
from handler.config import hardware
from handler.config.numerics import Numerics
from handler.config.sizing import (CPU_HEADROOM, CPU_KV_SHARE, DTYPE_BYTES, GPU_HEADROOM, Geometry,  # noqa: F401
                                   kv_bytes_per_token, read_geometry, running_width as batch_width)


def weights_bytes(model_dir: str, g: Geometry, dtype: str) -> int:
    """Size of the weights once loaded in `dtype`: the safetensors files rescaled from the
    stored dtype (headers are a few KiB, ignored)."""
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if g.stored_dtype:
        size = size * DTYPE_BYTES[dtype] // DTYPE_BYTES[g.stored_dtype]
    return size


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


# ------------------------------------------------------------------ the arithmetic
def explain(cfg, g: Geometry, *, device: str, prompt_tokens: int | None = None,
            output_lengths: list[int] | None = None, max_new_tokens: int | None = None,
            concurrency: int | None = None, gpu_memory_gib: float | None = None,
            model_dir: str | None = None, cpu_memory_gib: float | None = None) -> dict:
    """Every figure as a plain number, plus `warnings` (settings that cannot help) and `notes`."""
    dtype = resolve_dtype(cfg.dtype, device)
    tp = getattr(cfg, "tensor_parallel_degree", 1)
    kvd = getattr(cfg, "kv_cache_dtype", "auto")
    per_tok = kv_bytes_per_token(g, dtype, tp, kvd)    # per rank: each rank holds kv_heads / tp heads
    bs = cfg.block_size
    max_len = min(cfg.max_model_len or g.max_positions, g.max_positions)
    width = batch_width(cfg)
    warnings: list[str] = []
    notes: list[str] = []
    out: dict = {"strategy": cfg.strategy, "device": device, "dtype": dtype, "geometry": asdict(g),
                 "kv_bytes_per_token": per_tok,
                 "kv_cache_dtype": kvd if kvd != "auto" else dtype,
                 "kv_bytes_per_token_formula": (f"2 * {g.layers} layers * {g.kv_heads} kv heads * "
                                                + (f"({g.head_dim} int8 + {sizing.KV_SCALE_BYTES} scale) bytes"
                                                   if kvd == "int8" else
                                                   f"{g.head_dim} head dim * {DTYPE_BYTES[dtype]} bytes"))
                                               + (f" / {tp} ranks (per rank)" if tp > 1 else ""),
                 "block_size": bs, "max_model_len": max_len, "batch_width": width}
    if model_dir:       # mixture of experts: what must fit vs what a decode step reads
        try:
            moe = sizing.moe_weights(sizing.read_config(model_dir), DTYPE_BYTES[dtype])
        except (ValueError, TypeError):
            moe = None
        if moe is not None:
            out["moe"] = moe
    if device == "cpu":
        isa, why = hardware.cpu_kernels(getattr(cfg, "cpu_kernels", "auto"))
        out["cpu_kernels"] = {"isa": isa or "torch", "why": why}
    out["numerics"] = Numerics.of(cfg).describe()
    if cfg.max_model_len and cfg.max_model_len > g.max_positions:
        warnings.append(f"option.max_model_len={cfg.max_model_len} is above the model's "
                        f"{g.max_positions} positions; the server caps it at {g.max_positions}")

    tpot, policy = getattr(cfg, "target_tpot_ms", None), getattr(cfg, "scheduling_policy", "fcfs")
    if cfg.strategy in ("rolling", "paged") and (tpot or policy != "fcfs"):
        aging = cfg.scheduling_aging_ms
        out["scheduling"] = {"policy": policy, "target_tpot_ms": tpot, "aging_ms": aging,
                             "prefill_cap_tokens": cfg.max_rolling_batch_prefill_tokens}
        if tpot:
            notes.append(f"option.target_tpot_ms={tpot:g}: each step runs its decode rows, then as many prompt "
                         f"tokens (at most option.max_rolling_batch_prefill_tokens="
                         f"{cfg.max_rolling_batch_prefill_tokens}) as the measured step cost fits in {tpot:g} ms; "
                         f"while the decode rows alone take longer, new prompts wait (up to "
                         f"option.scheduling_aging_ms={aging:g})")
        if policy == "priority":
            notes.append(f"option.scheduling_policy=priority: the lowest request priority is admitted first and "
                         f"may preempt (recompute) higher numbers; a request waiting {aging:g} ms "
                         f"(option.scheduling_aging_ms) goes ahead of every class")
    # --- the pool: as the runner sizes it
    if cfg.kv_cache_tokens is not None:
        kv_tokens, source = cfg.kv_cache_tokens, "option.kv_cache_tokens"
        if kv_tokens % bs:
            notes.append(f"option.kv_cache_tokens={kv_tokens} is rounded up to whole blocks of {bs}: "
                         f"{blocks_for(kv_tokens, bs) * bs} tokens")
    elif device == "cpu":
        # As the runner: the memory available now (cgroup room, else MemAvailable), less the
        # weights it has yet to load here, x CPU_KV_SHARE - CPU_HEADROOM.
        avail = int(cpu_memory_gib * (1 << 30)) if cpu_memory_gib else hardware.cpu_available_memory()
        wb = weights_bytes(model_dir, g, dtype) if model_dir else 0
        budget = sizing.cpu_kv_budget(avail, wb)
        kv_tokens = sizing.default_kv_tokens(per_tok, width * max_len, bs, "cpu", available=avail, weights=wb)
        out["cpu_kv_budget_bytes"] = budget
        within = (f"{'given' if cpu_memory_gib else 'available'} memory {avail / (1 << 30):.2f} GiB - weights "
                  f"{wb / (1 << 30):.2f} GiB, x {CPU_KV_SHARE:g} - {CPU_HEADROOM >> 20} MiB headroom = "
                  f"{budget / (1 << 30):.2f} GiB")
        source = (f"default: {width} running sequences x {max_len} tokens (within {within})"
                  if width * max_len <= budget // per_tok else f"capped by the CPU memory: {within}")
    elif gpu_memory_gib:
        wb = (weights_bytes(model_dir, g, dtype) if model_dir else 0) // tp   # per GPU
        total = int(gpu_memory_gib * (1 << 30))
        budget = sizing.kv_budget_bytes("cuda", cfg.gpu_memory_utilization, total, used=wb)
        kv_tokens = sizing.default_kv_tokens(per_tok, width * max_len, bs, "cuda", cfg.gpu_memory_utilization,
                                             total, used=wb)
        source = (f"estimate: {gpu_memory_gib:g} GiB x gpu_memory_utilization "
                  f"{cfg.gpu_memory_utilization:g} - weights {wb / (1 << 30):.2f} GiB - 1 GiB headroom"
                  + ("" if wb else " (no *.safetensors in the model directory: weights not counted)"))
        if width * max_len < budget // per_tok:   # the runner takes no more than the batch can use
            source = f"default: {width} running sequences x {max_len} tokens (within the {source})"
    else:
        kv_tokens, source = None, "sized at start-up from free GPU memory (pass --gpu-memory-gib to estimate)"
    out["kv_cache_source"] = source
    if kv_tokens is None:
        out.update(warnings=warnings, notes=notes)
        return out
    num_blocks = blocks_for(kv_tokens, bs)
    pool = num_blocks * bs
    out.update(kv_cache_tokens=pool, num_blocks=num_blocks, kv_cache_bytes=pool * per_tok,
               sequences_at_full_length=num_blocks // blocks_for(max_len, bs))
    if pool < max_len:
        warnings.append(f"the KV cache ({pool} tokens) is shorter than max_model_len={max_len}: "
                        f"requests with prompt + max_new_tokens above {pool} are refused (400)")
    if cfg.strategy in ("rolling", "paged") and cfg.max_rolling_batch_prefill_tokens > pool:
        warnings.append(f"option.max_rolling_batch_prefill_tokens={cfg.max_rolling_batch_prefill_tokens} "
                        f"cannot help above the KV cache's {pool} tokens: no step can prefill more than it holds")

    # --- a traffic mix
    if output_lengths or prompt_tokens is not None or max_new_tokens:
        P = prompt_tokens or 0
        lens = sorted(output_lengths or [max_new_tokens or 30])
        M = max_new_tokens or max(lens)
        if max(lens) > M:
            raise ValueError(f"--output-lengths has {max(lens)} above --max-new-tokens={M}: "
                             "a request stops at max_new_tokens")
        mean_L = sum(lens) / len(lens)
        reserve = min(P + M, max_len)
        r_blocks = blocks_for(reserve, bs)
        R = r_blocks * bs
        # Over a sequence's life (L steps), slot-steps written: sum_{t=1..L} (P + t).
        written = sum(L * P + L * (L + 1) / 2 for L in lens) / len(lens)
        paged_blocks = sum(sum(blocks_for(P + t, bs) for t in range(1, L + 1)) for L in lens) / len(lens)
        mix = {"prompt_tokens": P, "max_new_tokens": M, "output_lengths": lens,
               "mean_output_tokens": mean_L,
               "reserved_tokens_per_sequence": R,
               "sequences_at_prompt_plus_max_new_tokens": num_blocks // r_blocks,
               "reservation_waste_at_end": 1 - (P + mean_L) / R,
               "reservation_waste_over_life": 1 - written / (R * mean_L),
               "paged_mean_blocks_per_sequence": paged_blocks / mean_L,
               "paged_sequences_in_steady_state": num_blocks / (paged_blocks / mean_L),
               "paged_tail_waste_over_life": 1 - written / (paged_blocks * bs)}
        running = min(width, concurrency) if concurrency else width
        mix["running"] = running
        if cfg.strategy == "paged":
            demand = running * paged_blocks / mean_L
            worst = running * r_blocks
            mix["paged_steady_state_demand"] = demand / num_blocks
            mix["paged_worst_case_demand"] = worst / num_blocks
            mix["preemption"] = ("expected: the running batch's steady-state demand exceeds the pool"
                                 if demand > num_blocks else
                                 "possible: only when most running sequences are long at once"
                                 if worst > num_blocks else "none: every running sequence fits at P + M")
            if running > num_blocks // blocks_for(P + 1, bs):
                warnings.append(f"option.max_rolling_batch_size={cfg.max_rolling_batch_size} cannot help: "
                                f"the KV cache holds {num_blocks // blocks_for(P + 1, bs)} sequences even at "
                                f"their first output token ({P} prompt tokens, {bs}-token blocks)")
            elif demand > num_blocks:
                warnings.append(f"option.max_rolling_batch_size={cfg.max_rolling_batch_size}: {running} running "
                                f"sequences need {demand:.0f} blocks on average, the pool has {num_blocks}; "
                                f"paged will preempt (recompute); about "
                                f"{int(mix['paged_sequences_in_steady_state'])} run without it")
        else:
            if cfg.strategy == "dynamic":
                # a batch runs until its longest member ends: E[max of B lengths] / E[length]
                x = sizing.expected_ideal_speedup(sorted(set(lens)), running, [lens.count(v) for v in sorted(set(lens))])
                mix["dynamic_steps_over_iteration_level"] = x
                notes.append(f"dynamic: a batch of {running} runs until its longest member ends; with this "
                             f"mix it takes {x:.2f}x the decode steps iteration-level batching (rolling/paged) needs")
            waste_key = "reservation_waste_over_life"
            mix["reservation_waste"] = mix[waste_key]
            fit = num_blocks // r_blocks
            key = "batch_size" if cfg.strategy == "dynamic" else "option.max_rolling_batch_size"
            if cfg.strategy in ("rolling", "dynamic") and running > fit:
                warnings.append(f"{key}={width} cannot help above {fit}: the KV cache reserves "
                                f"{R} tokens (prompt {P} + max_new_tokens {M}, in {bs}-token blocks) per "
                                f"sequence and holds {fit}")
            if cfg.strategy == "rolling" and mix[waste_key] > 0.25:
                notes.append(f"rolling reserves prompt + max_new_tokens: {mix[waste_key]:.0%} of reserved KV "
                             f"holds no token on average over a sequence's life; paged "
                             f"(option.paged_attention=true) would hold about "
                             f"{int(mix['paged_sequences_in_steady_state'])} sequences instead of {fit}")
        if bs > P + mean_L:
            notes.append(f"option.block_size={bs} is larger than a mean sequence ({P + mean_L:.0f} tokens): "
                         "most of each block stays empty")
        if cfg.strategy in ("rolling", "paged") and cfg.max_rolling_batch_prefill_tokens < P:
            notes.append(f"prompts of {P} tokens exceed option.max_rolling_batch_prefill_tokens="
                         f"{cfg.max_rolling_batch_prefill_tokens}: each is prefilled in "
                         f"{-(-P // cfg.max_rolling_batch_prefill_tokens)} chunks")
        out["mix"] = mix
    elif cfg.strategy in ("rolling", "dynamic") and width > out["sequences_at_full_length"]:
        key = "batch_size" if cfg.strategy == "dynamic" else "option.max_rolling_batch_size"
        warnings.append(f"{key}={width} is above the {out['sequences_at_full_length']} sequences the KV "
                        f"cache holds at full length ({max_len} tokens); it helps only when requests "
                        "ask for fewer tokens (pass --prompt-tokens/--max-new-tokens to check your mix)")
    spec = getattr(cfg, "speculative", None)
    if spec is not None:
        out["speculative"] = asdict(spec)
        notes.append(f"speculative decoding: {spec.method}, k={spec.k}"
                     + (f", n-grams of {spec.lookup_max} down to {spec.lookup_min} tokens" if spec.method == "ngram" else
                        f", draft model {spec.draft_model} (loaded beside the model, unquantized, with its own KV pool "
                        "of as many tokens as the model's; k - 1 draft decode steps after a catch-up chunk per step)")
                     + (f", off from {spec.disable_by_batch_size} running sequences" if spec.disable_by_batch_size
                        else ", at every batch size")
                     + (f"; paged: a verify step holds up to {spec.k} more KV slots per sequence until it is checked"
                        if cfg.strategy == "paged" else ""))
    out.update(warnings=warnings, notes=notes)
    return out


def render(e: dict) -> str:
    g = e["geometry"]
    mib = 1 << 20
    lines = [f"strategy {e['strategy']} on {e['device']} ({e['dtype']}); model {g['model_type']}: "
             f"{g['layers']} layers, {g['kv_heads']} kv heads x {g['head_dim']}, {g['max_positions']} positions",
             *([f"CPU kernels: {e['cpu_kernels']['isa']} ({e['cpu_kernels']['why']})"] if "cpu_kernels" in e else []),
             *([f"numerics: {e['numerics']}"] if "numerics" in e else []),
             *([f"mixture of experts: {e['moe']['experts']} experts, top-{e['moe']['top_k']}; weights "
                f"{e['moe']['total_bytes'] / mib:,.1f} MiB in memory (every expert), "
                f"{e['moe']['active_bytes_per_token'] / mib:,.1f} MiB read per decode token (active)"]
               if "moe" in e else []),
             f"KV bytes per token: {e['kv_bytes_per_token']} = {e['kv_bytes_per_token_formula']}",
             f"KV cache: {e['kv_cache_source']}"]
    if "num_blocks" in e:
        lines += [f"  {e['num_blocks']} blocks x {e['block_size']} = {e['kv_cache_tokens']} tokens, "
                  f"{e['kv_cache_bytes'] / mib:.1f} MiB",
                  f"  sequences at full length ({e['max_model_len']} tokens): {e['sequences_at_full_length']}; "
                  f"batch width {e['batch_width']}"]
    m = e.get("mix")
    if m:
        lines += [f"mix: prompt {m['prompt_tokens']} tokens, max_new_tokens {m['max_new_tokens']}, outputs "
                  f"{m['output_lengths']} (mean {m['mean_output_tokens']:.1f}), {m['running']} running",
                  f"  reserved per sequence (rolling/dynamic/none): {m['reserved_tokens_per_sequence']} tokens; "
                  f"the KV holds {m['sequences_at_prompt_plus_max_new_tokens']} such reservations",
                  f"  reservation waste: {m['reservation_waste_at_end']:.1%} of reserved slots never written; "
                  f"{m['reservation_waste_over_life']:.1%} empty averaged over a sequence's life",
                  f"  paged: {m['paged_mean_blocks_per_sequence']:.2f} blocks per running sequence on average, "
                  f"about {m['paged_sequences_in_steady_state']:.1f} sequences in steady state; tail waste "
                  f"{m['paged_tail_waste_over_life']:.1%}"]
        if "preemption" in m:
            lines.append(f"  preemption: {m['preemption']} (steady-state demand "
                         f"{m['paged_steady_state_demand']:.0%} of the pool, worst case "
                         f"{m['paged_worst_case_demand']:.0%})")
    lines += [f"note: {n}" for n in e["notes"]]
    lines += [f"warning: {w}" for w in e["warnings"]]
    return "\n".join(lines)


def _ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag}={text!r}: expected comma-separated integers >= 1, e.g. 16,32,64")
    return vals


def main(argv: list[str]) -> int:
    """`python -m handler config --explain [--properties FILE] [--model-dir DIR] [mix options]`."""
    from handler.config import ConfigError, load_config

    argv = [a for a in argv if a != "--explain"]
    p = argparse.ArgumentParser(prog="python -m handler config --explain",
                                description="The KV-cache arithmetic of a serving.properties file (no model load).")
    p.add_argument("--properties", metavar="FILE")
    p.add_argument("--model-dir", metavar="DIR", default=None)
    p.add_argument("--no-check-model", action="store_true", help="accepted for symmetry with `config`")
    p.add_argument("--prompt-tokens", type=int, metavar="P", help="prompt length of the traffic, in tokens")
    p.add_argument("--max-new-tokens", type=int, metavar="M", help="max_new_tokens the requests ask for")
    p.add_argument("--output-lengths", metavar="L1,L2,...",
                   help="actual output lengths, drawn uniformly (repeat one to weight it); default M")
    p.add_argument("--concurrency", type=int, metavar="C", help="requests in flight (default: the batch width)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default: the file's option.device")
    p.add_argument("--gpu-memory-gib", type=float, metavar="G", help="GPU memory, to estimate the default KV size")
    p.add_argument("--cpu-memory-gib", type=float, metavar="G",
                   help="CPU: memory the server may take (default: this container's now: cgroup limit, else "
                        "MemAvailable)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = p.parse_args(argv)
    try:
        for flag, v in (("--prompt-tokens", a.prompt_tokens), ("--max-new-tokens", a.max_new_tokens),
                        ("--concurrency", a.concurrency)):
            if v is not None and v < (0 if flag == "--prompt-tokens" else 1):
                raise ValueError(f"{flag}={v}: must be >= {0 if flag == '--prompt-tokens' else 1}")
        cfg = load_config(a.properties, a.model_dir, check_model=False)
        g = read_geometry(cfg.model_dir or os.path.abspath(a.model_dir or "."))
        e = explain(cfg, g, device=resolve_device(a.device or cfg.device), prompt_tokens=a.prompt_tokens,
                    output_lengths=_ints("--output-lengths", a.output_lengths) if a.output_lengths else None,
                    max_new_tokens=a.max_new_tokens, concurrency=a.concurrency,
                    gpu_memory_gib=a.gpu_memory_gib, model_dir=cfg.model_dir,
                    cpu_memory_gib=a.cpu_memory_gib)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for w in cfg.warnings:
        print(f"warning: {w}", file=sys.stderr)
    try:
        print(json.dumps(e, indent=2) if a.json else render(e), flush=True)
    except BrokenPipeError:  # `... | head`: not an error; keep the exit-time flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
