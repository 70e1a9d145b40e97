"""Benchmark arithmetic on plain numbers (no HTTP, no torch): percentiles, the LMI figure,
time per output token, summaries of a run, and the speedup ideal iteration-level batching gives.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from handler.config.sizing import expected_ideal_speedup  # noqa: F401  (re-exported; the server sizes with it)

PERCENTILES = (50, 90, 99)


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the run's start."""
    start: float
    end: float
    tokens: int = 0                      # output tokens, counted from details / stream lines
    ttft: float | None = None            # None when the server did not stream
    error: str | None = None
    finish_reason: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default): rank = q/100 * (n-1). None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0..100")
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def tpot(latency: float, ttft: float | None, tokens: int) -> float | None:
    """Time per output token after the first: (latency - ttft) / (tokens - 1).
    None when the first token's time is unknown or there is no second token."""
    if ttft is None or tokens < 2:
        return None
    return (latency - ttft) / (tokens - 1)


def lmi_requests_per_s(concurrency: int, latencies) -> float | None:
    """LMI's load-client figure: clients / mean latency (each client is always busy, so
    C clients each finishing one request per mean latency). Ignores idle gaps and ramp-up."""
    lat = list(latencies)
    if not lat:
        return None
    mean = sum(lat) / len(lat)
    return concurrency / mean if mean > 0 else None


@dataclass(frozen=True)
class Slo:
    """A per-request latency objective (seconds; None: not bounded). A request meets it when it
    succeeded, its first token came within ttft_s (a server that did not stream cannot show that)
    and its mean time per later token is within tpot_s (one token: nothing to bound)."""
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, r: Record) -> bool:
        if r.error is not None:
            return False
        if self.ttft_s is not None and (r.ttft is None or r.ttft > self.ttft_s):
            return False
        t = tpot(r.latency, r.ttft, r.tokens)
        if self.tpot_s is not None and (t is None and r.tokens > 1 or t is not None and t > self.tpot_s):
            return False
        return True

    def describe(self) -> str:
        parts = [f"TTFT <= {self.ttft_s * 1e3:g} ms" if self.ttft_s is not None else "",
                 f"TPOT <= {self.tpot_s * 1e3:g} ms" if self.tpot_s is not None else ""]
        return " and ".join(p for p in parts if p) or "none"


def _pcts(prefix: str, values, out: dict) -> None:
    for q in PERCENTILES:
        out[f"{prefix}_p{q}"] = percentile(values, q)


def summarise(records: list[Record], concurrency: int, duration: float, slo: Slo | None = None) -> dict:
    """Figures of one run (or several pooled: pass the summed duration).

    requests_per_s and output_tokens_per_s are wall clock: completed / duration; with an `slo`,
    goodput_per_s is the requests that met it per second (DistServe's goodput).
    Latency, TTFT and TPOT percentiles are over successful requests; TTFT/TPOT over
    those with a known first-token time (None when the server never streamed)."""
    ok = [r for r in records if r.error is None]
    lat = [r.latency for r in ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (tpot(r.latency, r.ttft, r.tokens) for r in ok) if t is not None]
    tokens = sum(r.tokens for r in ok)
    out = {
        "n": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else None,
        "lmi_requests_per_s": lmi_requests_per_s(concurrency, lat),
        "mean_latency_s": sum(lat) / len(lat) if lat else None,
    }
    if slo is not None:
        met = sum(1 for r in records if slo.met(r))
        out.update(slo=slo.describe(), slo_met=met, goodput_per_s=met / duration if duration > 0 else None)
    _pcts("latency", lat, out)
    _pcts("ttft", ttfts, out)
    _pcts("tpot", tpots, out)
    errs = sorted({r.error for r in records if r.error is not None})
    out["error_samples"] = errs[:5]
    return out


# ---------------------------------------------------------------- the ideal
# With dynamic batching a batch of B requests occupies the model for max(len) decode steps
# (the batch runs until its longest member ends). Perfect iteration-level batching at the
# same width B refills a slot the step it frees, so the same requests cost sum(len) / B
# steps. Counting decode steps only (a step's time taken as independent of how full it is):
#     ideal speedup = sum over batches of max(len)  /  (sum(len) / B)
#                   = E[max of B lengths] / E[len]          (batches of independent draws)

def ideal_speedup(lengths: list[int], batch_size: int) -> float:
    """Ideal speedup over dynamic batching for these output lengths, in arrival order, cut
    into consecutive dynamic batches of batch_size. Only complete batches count: the closed
    loop keeps C requests in flight, and a finite run's short last batch would charge
    dynamic a full-width batch for a few requests. Fewer lengths than one batch: one batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if not lengths:
        raise ValueError("ideal_speedup needs at least one length")
    full = len(lengths) - len(lengths) % batch_size
    if full == 0:
        full, batch_size = len(lengths), len(lengths)
    used = lengths[:full]
    dynamic_steps = sum(max(used[i:i + batch_size]) for i in range(0, full, batch_size))
    return dynamic_steps * batch_size / sum(used)
