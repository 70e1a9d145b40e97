"""Scrape a server's /metrics during a benchmark run: the series for the dashboard's panels and the
server's own TTFT/TPOT/latency over the run (histogram deltas between the first and last scrape)."""
from __future__ import annotations

import threading
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from handler.tools.bench.dashboard import Query, evaluate, from_json  # noqa: F401 (from_json: the scrape format's reader)

# (figure, histogram) the run report puts beside the client's figures.
SERVER_FIGURES = (("ttft", "lmi_time_to_first_token_seconds"), ("tpot", "lmi_time_per_output_token_seconds"),
                  ("latency", "lmi_e2e_request_latency_seconds"), ("queue", "lmi_request_queue_time_seconds"))


def parse(text: str) -> dict:
    """Prometheus text -> {sample name: {frozenset(labels): value}}, lmi_* samples only."""
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("lmi_"):
                out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


class Scraper:
    """Polls base_url/metrics every `interval` seconds in a thread; `series` holds
    (seconds since start, parsed scrape). Failed scrapes are counted, not fatal."""

    def __init__(self, base_url: str, interval: float = 1.0):
        self.url = base_url.rstrip("/").removesuffix("/invocations") + "/metrics"
        self.interval = interval
        self.series: list[tuple[float, dict]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)
        self._session = requests.Session()
        self._t0 = 0.0

    def scrape(self) -> None:
        try:
            r = self._session.get(self.url, timeout=5)
            r.raise_for_status()
            self.series.append((time.perf_counter() - self._t0, parse(r.text)))
        except (requests.RequestException, ValueError):
            self.failures += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.scrape()

    def __enter__(self) -> "Scraper":
        self._t0 = time.perf_counter()
        self.scrape()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        # The server records a request when its response closes, just after the client has read
        # the last byte: give the last ones a moment before the final scrape.
        time.sleep(0.5)
        self.scrape()
        self._session.close()

    def summary(self) -> dict | None:
        """Server-side figures over the run: mean (exact: sum/count) and p50/p99 (estimated from
        buckets as Prometheus does) for each of SERVER_FIGURES; None without two scrapes."""
        if len(self.series) < 2:
            return None
        (t0, first), (t1, last) = self.series[0], self.series[-1]
        out: dict = {"scrapes": len(self.series), "scrape_failures": self.failures}
        for fig, metric in SERVER_FIGURES:
            mean = evaluate(Query("mean", metric, "v"), first, last, t1 - t0)["v"]
            out[f"{fig}_mean"] = None if mean != mean else mean
            for q in (0.5, 0.99):
                v = evaluate(Query("quantile", metric, "v", q), first, last, t1 - t0)["v"]
                out[f"{fig}_p{round(q * 100)}"] = None if v != v else v
            n = evaluate(Query("rate", metric + "_count", "v"), first, last, 1.0).get("v", 0.0)
            out[f"{fig}_count"] = int(n)
        return out

    def to_json(self) -> list:
        """The series as plain JSON: [{"t": s, "samples": [[name, {labels}, value], ...]}]."""
        return [{"t": t, "samples": [[name, dict(labels), v] for name, vals in snap.items()
                                     for labels, v in vals.items()]} for t, snap in self.series]
