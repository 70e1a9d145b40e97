"""`python -m handler tune`: which serving.properties for this model, this traffic and this
latency objective? Proposes candidate files (each with its reason), measures each one with the
bench's load client against a real server within a time budget, and writes:

  OUT/serving.properties  the candidate that met the objective with the most goodput (requests within a
                          TTFT/TPOT objective per second; requests/s without one) (comments: figures, why)
  OUT/tune.json           every candidate's properties and figures, "chosen", "baseline"
  OUT/tune.png            requests/s against each objective metric, the objective drawn, the choice marked

Candidates run one at a time on the same request list. A run stops early when it is hopeless:
once enough requests are known to miss a target that the p90 must miss it too, on an error, or
once it has run longer than the best file that met the objective needed for the whole list
(so it cannot be faster). Exit code 0: a candidate met the objective; 3: none did (the file
written is the closest one, and says so); 2: bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from handler.tools.bench.client import invocations_url, run_load
from handler.tools.bench.compare import OWN_SERVER_ENV, Server, free_port, kv_cache_tokens as bench_kv_tokens, tail
from handler.tools.bench.metrics import Record, Slo, summarise, tpot
from handler.tools.bench.workloads import PRESETS, Workload, prompt_of
from handler.config import explain, hardware, sizing

NOTHING_MET = 3
# objective key -> (summary key, scale from the summary's unit)
SLO_KEYS = {"ttft_p90_ms": ("ttft_p90", 1e3), "tpot_p90_ms": ("tpot_p90", 1e3),
            "latency_p90_s": ("latency_p90", 1.0)}
# Keys a candidate sets; the base file's other keys (model, dtype, ...) are kept as they are.
STRATEGY_KEYS = ("batch_size", "max_batch_delay", "option.rolling_batch", "option.paged_attention",
                 "option.max_rolling_batch_size", "option.max_rolling_batch_prefill_tokens",
                 "option.block_size", "option.kv_cache_tokens", "option.enable_prefix_caching",
                 "option.target_tpot_ms")
# A TPOT objective's candidate aims its steps this far below the p90 target (steps vary around it).
TPOT_TARGET_SHARE = 0.8
MAX_CANDIDATES = {"smoke": 3, "cpu": 8, "gpu": 8}   # the baseline included


class UsageError(ValueError):
    pass


# ------------------------------------------------------------------ traffic
@dataclass
class Traffic:
    """The request list every candidate gets, and what the candidates are sized from."""
    name: str
    bodies: list[dict]
    prompt_tokens: list[int]            # per request, by the model's tokenizer
    concurrency: int | None = None      # closed loop: C clients
    arrivals: list[float] | None = None  # open loop: send times in seconds
    kv_budget: int | None = None        # tokens; None: the server's own sizing
    note: str = ""

    @property
    def n(self) -> int:
        return len(self.bodies)

    @property
    def max_new(self) -> list[int]:
        return [b["parameters"]["max_new_tokens"] for b in self.bodies]

    @property
    def outputs(self) -> list[int]:
        return [min(p["max_new_tokens"], p.get("eos_after", p["max_new_tokens"]))
                for p in (b["parameters"] for b in self.bodies)]

    def in_flight(self, window_s: float) -> int:
        """Clients (closed loop), or the most arrivals within any window of window_s (open loop)."""
        if self.arrivals is None:
            return min(self.concurrency, self.n)
        ts, best, j = sorted(self.arrivals), 1, 0
        for i, t in enumerate(ts):
            while ts[j] < t - window_s:
                j += 1
            best = max(best, i - j + 1)
        return best

    def describe(self) -> dict:
        return {"name": self.name, "requests": self.n, "concurrency": self.concurrency,
                "open_loop": self.arrivals is not None, "prompt_tokens_mean": statistics.mean(self.prompt_tokens),
                "prompt_tokens_max": max(self.prompt_tokens), "max_new_tokens_max": max(self.max_new),
                "output_tokens_mean": statistics.mean(self.outputs), "kv_budget_tokens": self.kv_budget,
                "note": self.note}


def preset_workload(name: str, preset: str) -> Workload:
    """The bench's workload of that name at the preset's size; smoke is a few requests of it."""
    base = {w.name: w for w in PRESETS["gpu" if preset == "gpu" else "cpu"].workloads}
    if name not in base:
        raise UsageError(f"--workload={name!r}: allowed: {', '.join(base)} or a FILE.jsonl")
    w = base[name]
    if preset == "smoke":
        w = replace(w, requests=8, concurrency=4, prompt_words=(4, 12), prefill_tokens=512,
                    max_new_tokens=(12,) if w.eos_after else (4, 8),
                    eos_after=(2, 8) if w.eos_after else None, kv_reservations=3 if w.eos_after else 0,
                    note=f"{name} at smoke size: 8 requests, 4 clients")
    return w


def traffic_from_workload(w: Workload, tok) -> Traffic:
    bodies = w.draw()
    ptoks = [len(tok(b["inputs"])["input_ids"]) for b in bodies]
    kv = bench_kv_tokens(w, [len(tok(prompt_of(x))["input_ids"]) for x in w.prompt_words])
    return Traffic(w.name, bodies, ptoks, concurrency=w.concurrency, kv_budget=kv, note=w.note)


def prompt_with_tokens(tok, n: int) -> str:
    """A prompt of about n tokens of the bench's paragraph (re-encoding may differ by a token)."""
    ids = tok(prompt_of(2 * n + 8))["input_ids"][:n]
    return tok.decode(ids, skip_special_tokens=True)


class WorkloadLine(BaseModel):
    """One request of a --workload FILE.jsonl. Each field's description says what it allows."""
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: Annotated[str, Field(min_length=1, description="a non-empty string")] = None
    prompt_tokens: Annotated[int, Field(ge=1, description="an integer >= 1")] = None
    max_new_tokens: Annotated[int, Field(ge=1, description="an integer >= 1")]
    output_tokens: Annotated[int, Field(ge=1, description="an integer >= 1")] = None
    arrival_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False,
                                      description="a number of seconds >= 0")] = None
    concurrency: Annotated[int, Field(ge=1, description="an integer >= 1")] = None


def workload_line(r, where: str) -> WorkloadLine:
    """A parsed JSON line -> WorkloadLine, or a one-line UsageError naming the field and value."""
    if not isinstance(r, dict):
        raise UsageError(f"{where}: expected a JSON object per line")
    try:
        line = WorkloadLine.model_validate(r)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        name = str(err["loc"][0]) if err["loc"] else "line"
        if err["type"] == "extra_forbidden":
            raise UsageError(f"{where}: unknown field {name!r}; allowed: "
                             + ", ".join(WorkloadLine.model_fields)) from None
        if err["type"] == "missing":
            raise UsageError(f"{where}: {name} is required") from None
        raise UsageError(f"{where}: {name}={err['input']!r} is not "
                         f"{WorkloadLine.model_fields[name].description}") from None
    if (line.prompt is None) == (line.prompt_tokens is None):
        raise UsageError(f"{where}: give exactly one of prompt (text) or prompt_tokens (a length)")
    return line


def traffic_from_jsonl(path: str, tok, concurrency: int | None, limit: int | None) -> Traffic:
    """One request per line: "prompt" (text) or "prompt_tokens" (a length), "max_new_tokens",
    optional "output_tokens" (where the request really stops, as EOS would) and either
    "arrival_s" on every line (open loop) or a "concurrency" (closed loop; or --concurrency)."""
    bodies, ptoks, arrivals, conc = [], [], [], set()
    try:
        with open(path) as f:
            lines = [(i, ln) for i, ln in enumerate(f, 1) if ln.strip()]
    except OSError as e:
        raise UsageError(f"--workload {path}: cannot read: {e.strerror}") from None
    for i, line in lines[:limit]:
        where = f"{path}:{i}"
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg})") from None
        w = workload_line(r, where)
        text = w.prompt if w.prompt is not None else prompt_with_tokens(tok, w.prompt_tokens)
        params = {"max_new_tokens": w.max_new_tokens, "ignore_eos": True, "details": True}
        if w.output_tokens is not None and w.output_tokens < w.max_new_tokens:
            params["eos_after"] = w.output_tokens
        if w.arrival_s is not None:
            arrivals.append(w.arrival_s)
        if w.concurrency is not None:
            conc.add(w.concurrency)
        bodies.append({"inputs": text, "parameters": params, "stream": True})
        ptoks.append(len(tok(text)["input_ids"]))
    if not bodies:
        raise UsageError(f"--workload {path}: no requests")
    if arrivals and len(arrivals) != len(bodies):
        raise UsageError(f"{path}: arrival_s on {len(arrivals)} of {len(bodies)} lines; give it on every "
                         "line (open loop) or on none (closed loop with a concurrency)")
    if len(conc) > 1:
        raise UsageError(f"{path}: lines disagree on concurrency ({sorted(conc)})")
    if arrivals:
        t0 = min(arrivals)
        return Traffic(os.path.basename(path), bodies, ptoks, arrivals=[a - t0 for a in arrivals],
                       note="replayed open loop at the file's arrival times")
    c = concurrency or (conc.pop() if conc else None)
    if c is None:
        raise UsageError(f"{path}: no arrival_s and no concurrency: pass --concurrency C or add "
                         '"concurrency" to the lines')
    return Traffic(os.path.basename(path), bodies, ptoks, concurrency=c,
                   note=f"{len(bodies)} requests from the file, {c} closed-loop clients")


def shared_prefix_share(prompt_ids: list[list[int]], block: int) -> float:
    """Share of prompt tokens in full blocks that an earlier prompt already had (what prefix
    caching could skip: block-aligned, at least one token left to compute, as BlockManager)."""
    seen: set[int] = set()
    hit = total = 0
    for ids in prompt_ids:
        total += len(ids)
        parent, matching = None, True
        for i in range(len(ids) // block):       # every full block is registered once computed
            h = hash((parent, tuple(ids[i * block:(i + 1) * block])))
            matching = matching and h in seen and i < (len(ids) - 1) // block
            hit += block if matching else 0
            seen.add(h)
            parent = h
    return hit / total if total else 0.0


# ------------------------------------------------------------------ candidates
@dataclass
class Candidate:
    name: str
    keys: dict[str, str]                # the strategy keys this candidate sets
    reason: str
    properties: dict[str, str] = field(default_factory=dict)   # the whole file (base + keys)
    result: dict = field(default_factory=dict)


def strategy_keys(strategy: str, *, width: int, prefill: int | None = None, block: int = 16,
                  kv: int | None = None, delay_ms: int | None = None, prefix: bool = False,
                  target_tpot_ms: float | None = None) -> dict[str, str]:
    k: dict[str, str] = {}
    if strategy == "dynamic":
        k.update(batch_size=str(width), max_batch_delay=str(delay_ms))
    elif strategy in ("rolling", "paged"):
        k.update({"option.rolling_batch": "auto", "option.paged_attention": str(strategy == "paged").lower(),
                  "option.max_rolling_batch_size": str(width),
                  "option.max_rolling_batch_prefill_tokens": str(prefill)})
    else:
        k["batch_size"] = "1"
    k["option.block_size"] = str(block)
    if kv is not None:
        k["option.kv_cache_tokens"] = str(kv)
    if prefix:
        k["option.enable_prefix_caching"] = "true"
    if target_tpot_ms:
        k["option.target_tpot_ms"] = f"{target_tpot_ms:g}"
    return k


def kv_bytes_per_token(cfg, geom: sizing.Geometry) -> int:
    """KV bytes per token of `cfg` on this machine (the server's rule: handler.config.sizing)."""
    return sizing.kv_bytes_per_token(geom, hardware.pick_dtype(cfg.dtype, hardware.pick_device(cfg.device)), 1,
                                     getattr(cfg, "kv_cache_dtype", "auto"))


def propose(tr: Traffic, base_cfg, geom: sizing.Geometry, slo: dict, limit: int, tok=None) -> list[Candidate]:
    """The baseline (the base file with the memory budget) and candidates in order of promise,
    each with the arithmetic that motivates it; identical files are proposed once."""
    per_tok = kv_bytes_per_token(base_cfg, geom)
    P_max, P_mean = max(tr.prompt_tokens), statistics.mean(tr.prompt_tokens)
    M, L_mean = max(tr.max_new), statistics.mean(tr.outputs)
    window = slo.get("latency_p90_s") or 10.0
    C = tr.in_flight(window)
    kv = tr.kv_budget
    kv_note = (f"KV: the memory budget, {kv} tokens ({kv * per_tok / (1 << 20):.1f} MiB at {per_tok} B/token); "
               "a larger pool never slows a step, it lets more sequences run" if kv else
               "KV: sized by the server from free memory (no budget given)")

    # block size: the base file's, halved while the mean tail (half a block) is over 1/8 of a sequence
    block = base_cfg.block_size
    while block > 8 and block / 2 > (P_mean + L_mean) / 8:
        block //= 2
    block_why = (f"block_size {block}" + (f" (the base's {base_cfg.block_size} halved: a sequence's last block is "
                                          f"half empty on average and sequences are ~{P_mean + L_mean:.0f} tokens)"
                                          if block != base_cfg.block_size else ""))
    if kv:
        kv -= kv % block
    blocks = (kv // block) if kv else None
    fit_reserved = blocks // explain.blocks_for(P_max + M, block) if blocks else C
    paged_blocks = statistics.mean(sum(explain.blocks_for(p + t, block) for t in range(1, L + 1)) / L
                                   for p, L in zip(tr.prompt_tokens, tr.outputs))
    fit_paged = int(blocks / paged_blocks) if blocks else C
    prefill_all = max(P_max, min(kv or 1 << 30, math.ceil(C * P_mean / 64) * 64))
    share = 0.0
    if tok is not None:
        share = shared_prefix_share([tok(b["inputs"])["input_ids"] for b in tr.bodies], block)

    # the baseline: the base file as given, with the memory budget where it has none
    base_keys = {k: v for k, v in base_cfg.properties.items() if k in STRATEGY_KEYS}
    if kv and "option.kv_cache_tokens" not in base_keys:
        base_keys["option.kv_cache_tokens"] = str(kv)
    out = [Candidate("baseline", base_keys,
                     ("your file as given" if base_cfg.properties_file else "the server's defaults (no --properties)")
                     + f" ({base_cfg.strategy}, width {sizing.running_width(base_cfg)})"
                     + ("; with the memory budget's option.kv_cache_tokens" if kv and
                        "option.kv_cache_tokens" not in base_cfg.properties else ""))]

    def add(name, keys, reason):
        out.append(Candidate(name, keys, f"{reason}; {block_why}; {kv_note}"))

    add(f"paged {C}", strategy_keys("paged", width=C, prefill=prefill_all, block=block, kv=kv),
        f"paged with one slot per request in flight ({C}): every waiting request joins the next step, "
        f"KV blocks are taken as sequences grow (prefill budget {prefill_all}: the prompts of all {C} at once)")
    if fit_paged < C:
        w = max(1, fit_paged)
        add(f"paged {w}", strategy_keys("paged", width=w, prefill=prefill_all, block=block, kv=kv),
            f"paged capped at {w}: the pool holds about {fit_paged} sequences at this traffic's mean size "
            f"({paged_blocks:.1f} blocks); more running sequences would be preempted and recomputed")
    wr = max(1, min(C, fit_reserved))
    waste = 1 - (P_mean + L_mean) / (explain.blocks_for(P_max + M, block) * block)
    add(f"rolling {wr}", strategy_keys("rolling", width=wr, prefill=prefill_all, block=block, kv=kv),
        f"rolling (contiguous reservations of prompt + max_new_tokens = {P_max + M} tokens): the pool holds "
        f"{fit_reserved} reservations; {waste:.0%} of each stays empty when outputs stop early")
    if share >= 0.1:
        add(f"paged {C} + prefix cache",
            strategy_keys("paged", width=C, prefill=prefill_all, block=block, kv=kv, prefix=True),
            f"prefix caching: {share:.0%} of prompt tokens repeat a full block of an earlier prompt")
    if ("tpot_p90_ms" in slo or "latency_p90_s" in slo) and prefill_all > P_max:
        add(f"paged {C}, prefill {P_max}", strategy_keys("paged", width=C, prefill=P_max, block=block, kv=kv),
            f"a prefill budget of one longest prompt ({P_max} tokens): new prompts spread over steps, so "
            "running sequences stall less (TPOT p90) at some cost in TTFT")
    if "tpot_p90_ms" in slo:
        t = round(slo["tpot_p90_ms"] * TPOT_TARGET_SHARE, 1)
        add(f"paged {C}, target TPOT {t:g} ms",
            strategy_keys("paged", width=C, prefill=prefill_all, block=block, kv=kv, target_tpot_ms=t),
            f"steps sized to {t:g} ms ({TPOT_TARGET_SHARE:.0%} of the TPOT objective) from their measured cost: "
            "decode rows first, prompts admitted while they fit, so the running streams keep their pace "
            "and the others wait for their first token")
    if C >= 4 and slo:
        h = C // 2
        add(f"paged {h}", strategy_keys("paged", width=h, prefill=max(P_max, prefill_all // 2), block=block, kv=kv),
            f"half as many running ({h}): shorter steps lower TPOT; the rest wait in the queue")
    wd = max(1, min(C, fit_reserved))
    if tr.arrivals is None:
        delay, why = 50, "clients resend at once, so a batch fills within ms of the last one ending"
    else:
        rate = tr.n / max(max(tr.arrivals), 1e-3)
        delay = int(min(1000 * wd / rate, (slo.get("ttft_p90_ms") or 800) / 4))
        why = f"about the time {wd} arrivals take at {rate:.1f} req/s, within a quarter of the TTFT target"
    add(f"dynamic {wd}", strategy_keys("dynamic", width=wd, block=block, kv=kv, delay_ms=delay),
        f"dynamic batches of {wd} (the reservations the pool holds, at most one per request in flight), "
        f"max_batch_delay {delay} ms: {why}")

    seen, unique = set(), []
    for c in out:
        c.properties = merged_properties(base_cfg.properties, c.keys)
        sig = tuple(sorted(c.properties.items()))
        if sig not in seen:
            seen.add(sig)
            unique.append(c)
    return unique[:limit]


def merged_properties(base: dict[str, str], keys: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in base.items() if k not in STRATEGY_KEYS}, **keys}


def _escape(s: str, key: bool = False) -> str:
    s = s.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    if key:
        for ch in " =:#!":
            s = s.replace(ch, "\\" + ch)
    elif s[:1] in (" ", "\t"):
        s = "\\" + s
    return s


def properties_text(props: dict[str, str], comments: list[str] = ()) -> str:
    lines = [f"# {c}" for c in comments]
    lines += [f"{_escape(k, True)}={_escape(v)}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ measuring
def p90_must_exceed(n_over: int, n: int) -> bool:
    """With n values of which n_over are known to exceed a target, the p90 (linear interpolation,
    rank 0.9 (n-1)) exceeds it too: values from sorted index floor(0.9 (n-1)) up are all over."""
    return n_over >= n - math.floor(0.9 * (n - 1))


class Watch:
    """Decides, while a candidate runs, that it is hopeless (sets `stop` with a reason)."""

    def __init__(self, n: int, slo: dict, beat_s: float | None, deadline: float):
        self.n, self.slo, self.beat_s, self.deadline = n, slo, beat_s, deadline
        self.stop = threading.Event()
        self.reason: str | None = None
        self.started: dict[int, float] = {}
        self.done: list[Record] = []
        self.lock = threading.Lock()
        self.t0: float | None = None
        self.first_start: float | None = None

    def on_start(self, i, t):
        with self.lock:
            self.started[i] = time.monotonic()
            if self.first_start is None:
                self.first_start = time.monotonic()

    def on_done(self, i, rec: Record):
        with self.lock:
            self.started.pop(i, None)
            self.done.append(rec)
        self.check()

    def _halt(self, reason):
        if not self.stop.is_set():
            self.reason = reason
            self.stop.set()

    def check(self) -> None:
        now = time.monotonic()
        with self.lock:
            done, ages = list(self.done), [now - t for t in self.started.values()]
        if any(r.error for r in done):
            return self._halt(f"a request failed: {next(r.error for r in done if r.error)}")
        if now > self.deadline:
            return self._halt("the time budget ran out")
        if self.beat_s and self.first_start and now - self.first_start > self.beat_s and len(done) < self.n:
            return self._halt(f"slower than the best file so far (which needed {self.beat_s:.1f} s for "
                              f"all {self.n} requests)")
        t = self.slo.get("latency_p90_s")
        if t is not None:
            over = sum(r.latency > t for r in done) + sum(a > t for a in ages)
            if p90_must_exceed(over, self.n):
                return self._halt(f"{over} of {self.n} requests took over {t} s: latency p90 must miss")
        t = self.slo.get("ttft_p90_ms")
        if t is not None:
            over = sum((r.ttft if r.ttft is not None else r.latency) * 1e3 > t for r in done)
            if p90_must_exceed(over, self.n):
                return self._halt(f"{over} of {self.n} first tokens came after {t} ms: TTFT p90 must miss")
        t = self.slo.get("tpot_p90_ms")
        if t is not None:
            over = sum((tpot(r.latency, r.ttft, r.tokens) or 0) * 1e3 > t for r in done)
            if p90_must_exceed(over, self.n):
                return self._halt(f"{over} of {self.n} requests ran over {t} ms per token: TPOT p90 must miss")

    def run_watchdog(self) -> threading.Thread:
        def loop():
            while not self.stop.wait(0.25):
                self.check()
        th = threading.Thread(target=loop, daemon=True)
        th.start()
        return th


def goodput_slo(slo: dict) -> Slo | None:
    """The per-request objective a TTFT/TPOT objective implies: each request within the p90 targets."""
    ttft, tpot_ms = slo.get("ttft_p90_ms"), slo.get("tpot_p90_ms")
    if ttft is None and tpot_ms is None:
        return None
    return Slo(ttft / 1e3 if ttft is not None else None, tpot_ms / 1e3 if tpot_ms is not None else None)


def figures(summary: dict) -> dict:
    def scaled(key, scale):
        v = summary.get(key)
        return None if v is None else v * scale
    out = {"requests_per_s": summary.get("requests_per_s"), "goodput_per_s": summary.get("goodput_per_s")}
    for k, (sk, scale) in SLO_KEYS.items():
        out[k] = scaled(sk, scale)
    return out


def meets(fig: dict, slo: dict) -> bool:
    return all(fig.get(k) is not None and fig[k] <= v for k, v in slo.items())


def start_server(c: Candidate, idx: int, model_dir: str, run_dir: str, startup_timeout: float,
                 warm: list[dict]) -> Server:
    """The candidate's server, started, ready and warmed up with `warm` (or with `error` set)."""
    props = os.path.join(run_dir, f"candidate-{idx}.properties")
    with open(props, "w") as f:
        f.write(properties_text(c.properties, [f"candidate {idx}: {c.name}"]))
    port = free_port()
    srv = Server(c.name, [sys.executable, "-m", "handler", "serve", "--properties", props, "--model-dir",
                          model_dir, "--port", str(port), "--host", "127.0.0.1"],
                 os.path.join(run_dir, f"candidate-{idx}.log"), port, env=OWN_SERVER_ENV)
    srv.start()
    try:
        srv.wait(startup_timeout)   # a started candidate may finish starting; the budget stops its load
        if not srv.error:   # first-call costs (allocation, kernel selection) are not part of the run
            run_load(invocations_url(srv.url), [dict(b, parameters=dict(b["parameters"], max_new_tokens=2))
                                                for b in warm], len(warm), progress=False)
    except BaseException:   # Ctrl-C / SIGTERM while starting: the caller never gets it to stop
        srv.stop()
        raise
    return srv


def load(srv: Server, tr: Traffic, slo: dict, beat_s: float | None, deadline: float, progress: bool,
         desc: str) -> dict:
    """One pass of the traffic through a ready server, watched for hopelessness."""
    watch = Watch(tr.n, slo, beat_s, deadline)
    dog = watch.run_watchdog()
    recs, dur = run_load(invocations_url(srv.url), tr.bodies, tr.concurrency or 1, arrivals=tr.arrivals,
                         progress=progress, desc=desc, stop=watch.stop,
                         on_start=watch.on_start, on_done=watch.on_done)
    stopped = watch.reason
    watch.stop.set()
    dog.join()
    if srv.proc.poll() is not None:
        stopped = stopped or f"the server exited with code {srv.proc.returncode}: {tail(srv.log_path)}"
    s = summarise(recs, tr.concurrency or tr.n, dur, goodput_slo(slo))
    return dict(figures(s), summary=s, complete=stopped is None and s["completed"] == tr.n, stopped=stopped)


def measure(c: Candidate, idx: int, tr: Traffic, model_dir: str, run_dir: str, slo: dict,
            beat_s: float | None, deadline: float, startup_timeout: float, progress: bool, log) -> dict:
    t_start = time.monotonic()
    srv = start_server(c, idx, model_dir, run_dir, startup_timeout, tr.bodies[:4])
    try:
        if srv.error:
            return {"log": srv.log_path, "error": f"server did not start: {srv.error}"}
        res = load(srv, tr, slo, beat_s, deadline, progress, f"candidate {idx} {c.name}")
        return dict(res, log=srv.log_path, measure_s=time.monotonic() - t_start)
    finally:
        srv.stop()


def confirm(pair: list[tuple[int, Candidate]], tr: Traffic, model_dir: str, run_dir: str, reps: int,
            startup_timeout: float, progress: bool, log) -> dict:
    """The choice and the baseline again, both servers up, `reps` interleaved passes each (the
    order alternates), no early stop: the ratio to trust on a noisy machine."""
    servers = []
    try:
        for idx, c in pair:
            servers.append((idx, c, start_server(c, idx, model_dir, run_dir, startup_timeout, tr.bodies[:4])))
        bad = [f"{c.name}: {s.error}" for _, c, s in servers if s.error]
        if bad:
            return {"error": "; ".join(bad)}
        runs: dict[int, list[dict]] = {idx: [] for idx, _, _ in servers}
        for rep in range(reps):
            for idx, c, srv in (servers if rep % 2 == 0 else servers[::-1]):
                r = load(srv, tr, {}, None, math.inf, progress, f"confirm {rep + 1}/{reps} {c.name}")
                runs[idx].append(r)
                log(f"confirm {rep + 1}/{reps} [{idx}] {c.name}: {_fmt(r)}")
    finally:
        for _, _, srv in servers:
            srv.stop()
    out = {"reps": reps, "order": "alternating, both servers up", "candidates": {}}
    for idx, c, _ in servers:
        rr = runs[idx]
        recs_s = [r["summary"] for r in rr]
        out["candidates"][str(idx)] = {
            "name": c.name, "requests_per_s_reps": [r["requests_per_s"] for r in rr],
            "requests_per_s": sum(s["completed"] for s in recs_s) / sum(s["duration_s"] for s in recs_s),
            **{k: [r[k] for r in rr] for k in SLO_KEYS}}
    a, b = (out["candidates"][str(idx)] for idx, _ in pair)
    out["ratio_chosen_to_baseline"] = a["requests_per_s"] / b["requests_per_s"] if b["requests_per_s"] else None
    # per pass: the two runs of one pass are neighbours in time, so machine drift cancels best there
    out["ratio_per_pass"] = [x / y if x and y else None
                             for x, y in zip(a["requests_per_s_reps"], b["requests_per_s_reps"])]
    return out


# ------------------------------------------------------------------ the decision
def rank_key(c: dict) -> str:
    """What "fastest" means: goodput (requests within a TTFT/TPOT objective per second) when the
    candidates were measured against one, else requests/s."""
    return "goodput_per_s" if c.get("goodput_per_s") is not None else "requests_per_s"


def decide(cands: list[dict], slo: dict) -> tuple[int | None, int | None]:
    """(chosen, closest): chosen is the complete candidate meeting the objective with the most
    goodput (requests/s without a TTFT/TPOT objective); closest (when none does) the complete one
    whose worst metric is nearest its target."""
    ok = [i for i, c in enumerate(cands) if c.get("meets_slo")]
    if ok:
        return max(ok, key=lambda i: (cands[i][rank_key(cands[i])], cands[i]["requests_per_s"])), None
    measured = [i for i, c in enumerate(cands) if c.get("requests_per_s")]
    if not measured:
        return None, None

    def excess(i):
        c = cands[i]
        worst = max((c[k] / v if c.get(k) is not None and v > 0 else math.inf) for k, v in slo.items()) \
            if slo else 0
        return (not c.get("complete"), worst, -c["requests_per_s"])
    return None, min(measured, key=excess)


def _fmt(c: dict) -> str:
    def f(k, fmt):
        return "–" if c.get(k) is None else format(c[k], fmt)
    return (f"{f('requests_per_s', '.2f')} req/s"
            + (f" (goodput {f('goodput_per_s', '.2f')})" if c.get("goodput_per_s") is not None else "")
            + f", TTFT p90 {f('ttft_p90_ms', '.0f')} ms, "
            f"TPOT p90 {f('tpot_p90_ms', '.1f')} ms, latency p90 {f('latency_p90_s', '.2f')} s")


def slo_text(slo: dict) -> str:
    return ", ".join(f"{k} <= {v:g}" for k, v in slo.items()) or "none (fastest wins)"


def tune(model_dir: str, workload: str, out_dir: str, *, properties: str | None = None, preset: str = "cpu",
         slo: dict | None = None, budget_minutes: float = 30.0, concurrency: int | None = None,
         kv_budget_tokens: int | None = None, startup_timeout: float = 180.0, progress: bool = True,
         confirm_reps: int = 0, log=print) -> tuple[dict, int]:
    """Run the whole tune; returns (tune.json's dict, exit code)."""
    from transformers import AutoTokenizer

    from handler.config import load_config

    slo = dict(slo or {})
    t0 = time.monotonic()
    deadline = t0 + budget_minutes * 60
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UsageError(f"--model-dir {model_dir!r} has no config.json")
    model_dir = os.path.abspath(model_dir)
    base = load_config(properties, model_dir, check_model=True)
    geom = sizing.read_geometry(base.model_dir or model_dir)
    tok = AutoTokenizer.from_pretrained(base.model_dir or model_dir)
    if workload.endswith(".jsonl") or os.path.isfile(workload):
        tr = traffic_from_jsonl(workload, tok, concurrency, 8 if preset == "smoke" else None)
    else:
        w = preset_workload(workload, preset)
        if concurrency:
            w = replace(w, concurrency=concurrency)
        tr = traffic_from_workload(w, tok)
    if tr.arrivals is None and tr.kv_budget is None and tr.concurrency:
        # a FILE: room for every client's request at full size unless told otherwise
        tr.kv_budget = bench_kv_tokens(Workload(tr.name, tr.n, tr.concurrency, (), (max(tr.max_new),)),
                                       [max(tr.prompt_tokens)])
    if base.kv_cache_tokens:
        tr.kv_budget = base.kv_cache_tokens
    if kv_budget_tokens:
        tr.kv_budget = kv_budget_tokens
    cands = propose(tr, base, geom, slo, MAX_CANDIDATES[preset], tok)
    os.makedirs(out_dir, exist_ok=True)
    run_dir = os.path.join(out_dir, "runs")
    os.makedirs(run_dir, exist_ok=True)
    log(f"tune: {len(cands)} candidates on {tr.name} ({tr.n} requests, "
        f"{'open loop' if tr.arrivals else f'{tr.concurrency} clients'}); objective {slo_text(slo)}; "
        f"budget {budget_minutes:g} min")
    from tqdm import tqdm

    bar = tqdm(total=len(cands), desc="tune", unit="file", file=sys.stderr, disable=not progress, position=0)
    rows: list[dict] = []
    best_s: float | None = None
    spent: list[float] = []
    for i, c in enumerate(cands):
        row = {"name": c.name, "reason": c.reason, "properties": c.properties, "requests_per_s": None,
               **{k: None for k in SLO_KEYS}, "meets_slo": False}
        left = deadline - time.monotonic()
        if spent and left < statistics.mean(spent):
            row.update(stopped=f"not measured: the budget had {left:.0f} s left, a candidate takes "
                               f"~{statistics.mean(spent):.0f} s", complete=False)
        else:
            r = measure(c, i, tr, model_dir, run_dir, slo, best_s, deadline, startup_timeout, progress, log)
            row.update({k: v for k, v in r.items() if k != "summary"})
            if "summary" in r:
                row["summary"] = {k: r["summary"][k] for k in ("n", "completed", "errors", "duration_s",
                                                               "output_tokens_per_s", "latency_p50",
                                                               "ttft_p50", "tpot_p50", "error_samples")}
            row["meets_slo"] = bool(row.get("complete")) and meets(row, slo)
            if "measure_s" in r:
                spent.append(r["measure_s"])
            if row["meets_slo"]:
                dur = r["summary"]["duration_s"]
                best_s = dur if best_s is None else min(best_s, dur)
        log(f"[{i}] {c.name}: " + (_fmt(row) + (" meets the objective" if row["meets_slo"] else
                                                 f" misses ({row.get('stopped') or row.get('error') or 'targets'})")
                                   if row.get("requests_per_s") else (row.get("stopped") or row.get("error", "?"))))
        rows.append(row)
        bar.update(1)
    bar.close()

    chosen, closest = decide(rows, slo)
    pick = chosen if chosen is not None else closest
    result = {"candidates": rows, "chosen": chosen, "closest": closest, "baseline": rows[0],
              "objective": slo, "traffic": tr.describe(), "model_dir": model_dir, "preset": preset,
              "budget_minutes": budget_minutes, "elapsed_s": time.monotonic() - t0,
              "kv_bytes_per_token": kv_bytes_per_token(base, geom)}
    if confirm_reps and chosen not in (None, 0):
        left = deadline - time.monotonic()
        if left > 0:
            result["confirmation"] = confirm([(chosen, cands[chosen]), (0, cands[0])], tr, model_dir, run_dir,
                                             confirm_reps, startup_timeout, progress, log)
        else:
            result["confirmation"] = {"error": "not run: the budget was spent"}
        result["elapsed_s"] = time.monotonic() - t0
    with open(os.path.join(out_dir, "tune.json"), "w") as f:
        json.dump(result, f, indent=2)
    if pick is not None:
        with open(os.path.join(out_dir, "serving.properties"), "w") as f:
            f.write(properties_text(rows[pick]["properties"], comments(result, pick)))
    plot(result, os.path.join(out_dir, "tune.png"))
    if chosen is None:
        log("tune: NO candidate met the objective (" + slo_text(slo) + ")"
            + (f"; the closest is [{closest}] {rows[closest]['name']}: {_fmt(rows[closest])}, written to "
               f"{out_dir}/serving.properties" if closest is not None else "; none could be measured")
            + ". Relax the objective, give a larger --budget-minutes, or serve on a faster device.")
        return result, NOTHING_MET
    log(f"tune: chose [{chosen}] {rows[chosen]['name']}: {_fmt(rows[chosen])}; wrote {out_dir}/serving.properties, "
        "tune.json, tune.png")
    return result, 0


def comments(result: dict, pick: int) -> list[str]:
    rows, c, tr = result["candidates"], result["candidates"][pick], result["traffic"]
    slo = result["objective"]
    out = [f"Written by `python -m handler tune` {time.strftime('%Y-%m-%d %H:%M')} for {result['model_dir']}",
           f"traffic: {tr['name']}, {tr['requests']} requests, "
           + ("open loop" if tr["open_loop"] else f"{tr['concurrency']} clients")
           + f"; objective: {slo_text(slo)}",
           f"measured: {_fmt(c)}"]
    if result["chosen"] is None:
        out.insert(0, "NO CANDIDATE MET THE OBJECTIVE: this is the closest one, not a recommendation")
    else:
        others = sorted((r for i, r in enumerate(rows) if i != pick and r.get("meets_slo")),
                        key=lambda r: -r["requests_per_s"])
        met = sum(bool(r.get("meets_slo")) for r in rows)
        why = (f"why it won: the most {'goodput' if rank_key(c) == 'goodput_per_s' else 'requests/s'} of the "
               f"{met} of {len(rows)} candidates that met the objective")
        if others:
            why += f" (next: {others[0]['name']} at {others[0]['requests_per_s']:.2f} req/s)"
        out.append(why)
    b = result["baseline"]
    if pick != 0 and b.get("requests_per_s"):
        out.append(f"baseline ({b['name']}): {_fmt(b)}; this file {c['requests_per_s'] / b['requests_per_s']:.2f}x "
                   "its requests/s" + ("" if b.get("meets_slo") else "; the baseline missed the objective"))
    conf = result.get("confirmation") or {}
    if conf.get("ratio_chosen_to_baseline"):
        reps = conf["candidates"][str(pick)]["requests_per_s_reps"]
        base_reps = conf["candidates"]["0"]["requests_per_s_reps"]
        out.append(f"confirmed: {conf['reps']} interleaved passes each, this file "
                   f"{', '.join(f'{x:.2f}' for x in reps)} req/s vs the baseline "
                   f"{', '.join(f'{x:.2f}' for x in base_reps)}: {conf['ratio_chosen_to_baseline']:.2f}x pooled, "
                   + ", ".join(f"{x:.2f}x" for x in conf["ratio_per_pass"] if x) + " per pass")
    out.append(f"why these settings: {c['reason']}")
    return out


def plot(result: dict, path: str) -> None:
    from matplotlib.figure import Figure

    rows, slo, chosen = result["candidates"], result["objective"], result["chosen"]
    metrics = list(slo) or ["latency_p90_s"]
    fig = Figure(figsize=(5.2 * len(metrics), 4.2))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, m in zip(axes, metrics):
        for i, r in enumerate(rows):
            if r.get(m) is None or not r.get("requests_per_s"):
                continue
            style = dict(marker="o", color="#2a9d4b") if r.get("meets_slo") else \
                dict(marker="x", color="#c0392b") if r.get("complete") else dict(marker="o", color="#999999",
                                                                               mfc="none")
            ax.plot([r[m]], [r["requests_per_s"]], linestyle="none", markersize=8, **style)
            ax.annotate(f"{i} {r['name']}", (r[m], r["requests_per_s"]), textcoords="offset points",
                        xytext=(5, 4 if i % 2 == 0 else -10), fontsize=7)
            if i == chosen:
                ax.plot([r[m]], [r["requests_per_s"]], marker="*", markersize=20, color="#f1c40f",
                        markeredgecolor="k", linestyle="none", label="chosen")
        if m in slo:
            ax.axvline(slo[m], color="k", linestyle="--", linewidth=1, label=f"objective {m} <= {slo[m]:g}")
            ax.axvspan(0, slo[m], color="#2a9d4b", alpha=0.07)
        ax.set_xlim(left=0)
        ax.set_xlabel(m.replace("_", " "))
        ax.set_ylabel("requests/s (wall clock)")
        ax.legend(fontsize=7, loc="lower right")
    tr = result["traffic"]
    fig.suptitle(f"tune: {tr['name']}, {tr['requests']} requests\n"
                 "green: met the objective; red x: missed it; hollow: stopped early", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ command line
def parse_slo(text: str | None) -> dict:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        k, sep, v = part.strip().partition("=")
        if k not in SLO_KEYS:
            raise UsageError(f"--slo: unknown target {k!r}; allowed: {', '.join(SLO_KEYS)}")
        try:
            x = float(v)
        except ValueError:
            x = -1.0
        if not sep or not x > 0 or x == math.inf:
            raise UsageError(f"--slo: {k}={v!r} is not a positive number")
        out[k] = x
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m handler tune",
                                 description="Measure candidate serving.properties files on your model and "
                                             "traffic; write the fastest that meets the objective.")
    ap.add_argument("--model-dir", required=True, help="the model (config.json + safetensors + tokenizer)")
    ap.add_argument("--properties", metavar="BASE", help="your serving.properties: the baseline, and the "
                                                         "keys every candidate keeps (model, dtype, ...)")
    ap.add_argument("--workload", required=True, help="lmi, early_stop, or FILE.jsonl (README: Tuning)")
    ap.add_argument("--preset", default="cpu", choices=sorted(MAX_CANDIDATES),
                    help="size of the run: smoke (a few requests, 3 files), cpu, gpu (default cpu)")
    ap.add_argument("--slo", help="objective, e.g. ttft_p90_ms=500,tpot_p90_ms=50,latency_p90_s=2")
    ap.add_argument("--budget-minutes", type=float, default=30.0, help="wall-clock budget (default 30)")
    ap.add_argument("--out", required=True, help="directory for serving.properties, tune.json, tune.png")
    ap.add_argument("--concurrency", type=int, help="closed-loop clients (overrides the workload's/file's)")
    ap.add_argument("--kv-budget-tokens", type=int, help="KV memory budget in tokens (default: the base "
                                                         "file's option.kv_cache_tokens, else the workload's)")
    ap.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for a server's /ping")
    ap.add_argument("--confirm-reps", type=int, default=0, metavar="R",
                    help="then measure the choice and the baseline R more times each, interleaved, both "
                         "servers up (the ratio to trust on a noisy machine; default 0)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    from handler.config import ConfigError

    # SIGTERM unwinds like Ctrl-C, so that the candidate server running now is stopped too.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if a.budget_minutes <= 0:
            raise UsageError(f"--budget-minutes={a.budget_minutes:g}: must be > 0")
        for flag, v, lo in (("--concurrency", a.concurrency, 1), ("--kv-budget-tokens", a.kv_budget_tokens, 1),
                            ("--confirm-reps", a.confirm_reps, 0)):
            if v is not None and v < lo:
                raise UsageError(f"{flag}={v}: must be >= {lo}")
        _, code = tune(a.model_dir, a.workload, a.out, properties=a.properties, preset=a.preset,
                       slo=parse_slo(a.slo), budget_minutes=a.budget_minutes, concurrency=a.concurrency,
                       kv_budget_tokens=a.kv_budget_tokens, startup_timeout=a.startup_timeout,
                       progress=not a.no_progress, confirm_reps=a.confirm_reps, log=lambda m: print(m, file=sys.stderr, flush=True))
        return code
    except (UsageError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tune: interrupted; the candidate server was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
