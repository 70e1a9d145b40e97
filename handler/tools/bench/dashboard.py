"""One panel list, two renderings: the Grafana dashboard (PromQL, committed under container/grafana/)
and the same panels drawn with matplotlib from a series of /metrics scrapes (`bench run --plot`).

`python -m handler.tools.bench.dashboard` rewrites the committed JSON from PANELS;
`python -m handler.tools.bench.dashboard --plot SCRAPES.json OUT.png` redraws a saved run.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass

DASHBOARD_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                              "container", "grafana", "lmi-serve.json")
SEL = 'model=~"$model",strategy=~"$strategy"'


@dataclass(frozen=True)
class Query:
    kind: str            # quantile | rate | gauge | mean
    metric: str          # series name without _bucket/_sum/_count
    legend: str
    q: float = 0.0       # quantile
    by: str = ""         # rate: a label to split by

    def promql(self) -> str:
        if self.kind == "quantile":
            return (f"histogram_quantile({self.q}, sum by (le) "
                    f"(rate({self.metric}_bucket{{{SEL}}}[$__rate_interval])))")
        if self.kind == "rate":
            by = f" by ({self.by})" if self.by else ""
            return f"sum{by} (rate({self.metric}{{{SEL}}}[$__rate_interval]))"
        if self.kind == "mean":
            return (f"sum(rate({self.metric}_sum{{{SEL}}}[$__rate_interval])) / "
                    f"sum(rate({self.metric}_count{{{SEL}}}[$__rate_interval]))")
        return f"sum({self.metric}{{{SEL}}})"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str            # Grafana unit: s, reqps, short, percentunit
    queries: tuple[Query, ...]


def _pcts(metric: str, qs=(0.5, 0.9, 0.99)) -> tuple[Query, ...]:
    return tuple(Query("quantile", metric, f"p{round(q * 100)}", q) for q in qs)


PANELS = (
    Panel("Requests / s by outcome", "reqps", (Query("rate", "lmi_requests_total", "{{outcome}}", by="outcome"),)),
    Panel("Tokens / s", "short", (Query("rate", "lmi_generated_tokens_total", "generated"),
                                  Query("rate", "lmi_prefill_tokens_total", "prefill computed"),
                                  Query("rate", "lmi_prefix_cache_hit_tokens_total", "prefix-cache hits"))),
    Panel("Time to first token", "s", _pcts("lmi_time_to_first_token_seconds")),
    Panel("Time per output token", "s", _pcts("lmi_time_per_output_token_seconds")),
    Panel("End-to-end latency", "s", _pcts("lmi_e2e_request_latency_seconds")),
    Panel("Queue time", "s", _pcts("lmi_request_queue_time_seconds", (0.5, 0.99))),
    Panel("Running and waiting sequences", "short", (Query("gauge", "lmi_running", "running"),
                                                      Query("gauge", "lmi_waiting", "waiting"))),
    Panel("KV cache", "percentunit", (Query("gauge", "lmi_kv_cache_usage", "allocated / pool"),
                                      Query("gauge", "lmi_kv_utilization", "written / allocated"),
                                      Query("gauge", "lmi_prefix_cache_occupancy", "prefix cache / pool"))),
    Panel("Sequences per step (batch occupancy)", "short", (Query("mean", "lmi_step_sequences", "mean"),
                                                            Query("quantile", "lmi_step_sequences", "p99", 0.99))),
    Panel("Tokens per step", "short", (Query("mean", "lmi_step_tokens", "mean"),
                                       Query("quantile", "lmi_step_tokens", "p99", 0.99))),
    Panel("Prompt and output length (median)", "short",
          (Query("quantile", "lmi_request_prompt_tokens", "prompt p50", 0.5),
           Query("quantile", "lmi_request_generation_tokens", "output p50", 0.5))),
    Panel("Preemptions / s", "short", (Query("rate", "lmi_preemptions_total", "preemptions"),)),
)


def build_dashboard() -> dict:
    """The Grafana dashboard (schema 39): a Prometheus data-source variable, model/strategy filters."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, p in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "datasource": ds,
            "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": 8 * (i // 3)},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"refId": chr(65 + j), "datasource": ds, "expr": q.promql(), "legendFormat": q.legend}
                        for j, q in enumerate(p.queries)],
        })

    def var(name):
        return {"name": name, "label": name, "type": "query", "datasource": ds,
                "query": {"query": f"label_values(lmi_requests_total, {name})", "refId": name},
                "definition": f"label_values(lmi_requests_total, {name})", "refresh": 2,
                "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}}

    return {
        "title": "lmi-serve", "uid": "lmi-serve", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["lmi-serve", "llm"], "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}}, var("model"), var("strategy")]},
        "panels": panels,
    }


def metric_names(dashboard: dict) -> set[str]:
    """Every series a dashboard's expressions read."""
    names = set()
    for p in dashboard["panels"]:
        for t in p["targets"]:
            names.update(re.findall(r"\b(lmi_[a-z0-9_]+)\{", t["expr"]))
    return names


# ---------------------------------------------------------------- the same panels from scrapes
def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile on cumulative (le, count) pairs: linear inside the bucket
    that holds rank q*total; the +Inf bucket answers the largest finite bound. NaN when empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            lo = prev_le if prev_le < le else 0.0
            return lo + (le - lo) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def _sum(snap: dict, name: str, by: str = "") -> dict:
    """Sum a sample over every label but `by` (and le for buckets): {group: value}."""
    out: dict = {}
    for labels, v in snap.get(name, {}).items():
        d = dict(labels)
        key = d.get("le") if name.endswith("_bucket") else d.get(by, "") if by else ""
        out[key] = out.get(key, 0.0) + v
    return out


def evaluate(query: Query, old: dict, new: dict, dt: float) -> dict:
    """One query between two scrapes ({sample: {labels: value}}), as Grafana would plot it at `new`."""
    def delta(name, by=""):
        a, b = _sum(old, name, by), _sum(new, name, by)
        return {k: b[k] - a.get(k, 0.0) for k in b}

    if query.kind == "gauge":
        return {query.legend: _sum(new, query.metric).get("", math.nan)}
    if query.kind == "rate":
        d = delta(query.metric, query.by)
        return {(query.legend.replace("{{%s}}" % query.by, k) if query.by else query.legend): v / dt
                for k, v in sorted(d.items())}
    if query.kind == "mean":
        s, c = delta(query.metric + "_sum").get("", 0.0), delta(query.metric + "_count").get("", 0.0)
        return {query.legend: s / c if c else math.nan}
    d = delta(query.metric + "_bucket")
    return {query.legend: histogram_quantile(query.q, [(float(k), v) for k, v in d.items()])}


def plot(series: list[tuple[float, dict]], path: str, title: str = "", window: float = 15.0) -> None:
    """Draw PANELS from scrapes [(seconds, {sample: {labels: value}})]; rates and quantiles over
    the last `window` seconds, as Grafana's rate(...[window]) would."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = -(-len(PANELS) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.9 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, PANELS):
        lines: dict = {}
        j = 0
        for i in range(1, len(series)):
            while series[i][0] - series[j + 1][0] >= window:
                j += 1
            t, new = series[i]
            t0, old = series[j]
            if t <= t0:
                continue
            for qry in panel.queries:
                for legend, v in evaluate(qry, old, new, t - t0).items():
                    lines.setdefault(legend, ([], []))
                    lines[legend][0].append(t)
                    lines[legend][1].append(v * 1e3 if panel.unit == "s" else
                                            v * 100 if panel.unit == "percentunit" else v)
        for legend, (xs, ys) in lines.items():
            ax.plot(xs, ys, label=legend, lw=1.4)
        unit = {"s": " (ms)", "percentunit": " (%)"}.get(panel.unit, "")
        ax.set_title(panel.title + unit, fontsize=10)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if lines:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def from_json(rows: list) -> list[tuple[float, dict]]:
    """A scrape series as written by `bench run --scrape-out` -> [(t, {metric: {labels: value}})]."""
    series = []
    for row in rows:
        snap: dict = {}
        for name, labels, v in row["samples"]:
            snap.setdefault(name, {})[frozenset(labels.items())] = v
        series.append((row["t"], snap))
    return series



def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m handler.tools.bench.dashboard",
                                 description="Rewrite the committed Grafana dashboard from PANELS, or plot "
                                             "the panels from a scrape series (bench run --scrape-out).")
    ap.add_argument("--plot", nargs=2, metavar=("SCRAPES_JSON", "OUT_PNG"))
    ap.add_argument("--window", type=float, default=15.0, help="seconds for rates and quantiles")
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    if a.plot:
        import gzip
        with (gzip.open if a.plot[0].endswith(".gz") else open)(a.plot[0], "rt") as f:
            plot(from_json(json.load(f)["series"]), a.plot[1], title=a.title, window=a.window)
        print(a.plot[1])
        return 0
    os.makedirs(os.path.dirname(DASHBOARD_PATH), exist_ok=True)
    with open(DASHBOARD_PATH, "w") as f:
        json.dump(build_dashboard(), f, indent=2)
        f.write("\n")
    print(DASHBOARD_PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
