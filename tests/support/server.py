"""Start the real server (gunicorn, loopback) for end-to-end tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import requests

from handler.tools.bench.client import wait_ready
from handler.tools.bench.compare import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Server:
    def __init__(self, properties: str, model_dir: str, tmp_path, env: dict | None = None,
                 timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        props = os.path.join(str(tmp_path), f"serving-{self.port}.properties")
        with open(props, "w") as f:
            f.write(properties)
        self.log_path = os.path.join(str(tmp_path), f"server-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "handler", "serve", "--properties", props, "--model-dir", model_dir,
             "--port", str(self.port), "--host", "127.0.0.1"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        try:
            wait_ready(self.url, timeout, self.proc)
        except (TimeoutError, RuntimeError) as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.output()}") from None

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def post(self, body: dict, **kw) -> requests.Response:
        return requests.post(self.url + "/invocations", json=body, timeout=kw.pop("timeout", 120), **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def flat_metrics(text: str) -> dict:
    """/metrics parsed by prometheus_client: {'name' or 'name{k="v",...}': value}, the
    model/strategy labels every series carries left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("model", "strategy"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def assert_eventually(pred, timeout=30.0):
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, "condition not reached"
        time.sleep(0.05)
