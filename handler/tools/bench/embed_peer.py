"""Library embedding engines as `bench embed` peers, behind one thin HTTP front.

    python -m handler.tools.bench.embed_peer --backend st|onnx|openvino --model-dir DIR --port P [--threads 2]

Run by the Python that has the backend (`st`: our own venv's sentence-transformers, the reference
implementation; `onnx`: the onnx peer's venv, optimum-onnx's ONNX export run by ONNX Runtime;
`openvino`: the openvino peer's venv, optimum-intel's OpenVINO export). Imports nothing of ours but
this file: stdlib, torch, transformers and the backend.

Why a front of our own: the libraries are engines, not servers (TEI and Infinity, their usual fronts,
are not here: TEI is a container image; Infinity pins an older transformers). It does what those
fronts do: HTTP threads queue their texts; one worker takes whatever is waiting (up to --max-batch
texts, no added delay), encodes them as one padded batch and answers each. It speaks the subset of
OpenAI's /v1/embeddings the load generator sends ({"input": str | [str]} -> {"data": [{"embedding",
"index"}]}) and /ping.

Pooling as sentence-transformers' files say (1_Pooling/config.json: mean, cls or last-token;
modules.json's Normalize), computed here for onnx/openvino over the exported model's last hidden state.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BACKENDS = ("st", "onnx", "openvino")


def pooling_of(model_dir: str) -> tuple[str, bool]:
    """(mode: mean | cls | lasttoken, normalize) from sentence-transformers' files (mean, True without)."""
    mode, normalize = "mean", True
    modules = os.path.join(model_dir, "modules.json")
    if os.path.isfile(modules):
        with open(modules) as f:
            mods = json.load(f)
        normalize = any(m.get("type", "").endswith("Normalize") for m in mods)
        for m in mods:
            if m.get("type", "").endswith("Pooling"):
                with open(os.path.join(model_dir, m.get("path", "1_Pooling"), "config.json")) as f:
                    cfg = json.load(f)
                mode = ("cls" if cfg.get("pooling_mode_cls_token") else
                        "lasttoken" if cfg.get("pooling_mode_lasttoken") else "mean")
    return mode, normalize


class Exported:
    """An optimum export (ONNX Runtime or OpenVINO) + the checkpoint's pooling."""

    def __init__(self, backend: str, model_dir: str, threads: int):
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(threads)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.mode, self.normalize = pooling_of(model_dir)
        if backend == "onnx":
            import onnxruntime as ort
            from optimum.onnxruntime import ORTModelForFeatureExtraction
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
            self.model = ORTModelForFeatureExtraction.from_pretrained(model_dir, export=True, session_options=so,
                                                                      provider="CPUExecutionProvider")
        else:
            from optimum.intel import OVModelForFeatureExtraction
            self.model = OVModelForFeatureExtraction.from_pretrained(
                model_dir, export=True, ov_config={"INFERENCE_PRECISION_HINT": "f32",
                                                   "INFERENCE_NUM_THREADS": str(threads)})

    def encode(self, texts: list[str]) -> list[list[float]]:
        import torch

        enc = self.tok(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.inference_mode():
            h = self.model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"].unsqueeze(-1).float()
        if self.mode == "cls":
            v = h[:, 0]
        elif self.mode == "lasttoken":
            v = h[torch.arange(h.shape[0]), enc["attention_mask"].sum(1) - 1]
        else:
            v = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        return v.tolist()


class SentenceTransformers:
    def __init__(self, model_dir: str, threads: int):
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        self.model = SentenceTransformer(model_dir, device="cpu")

    def encode(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(texts, batch_size=len(texts), convert_to_numpy=True).tolist()


class Batcher:
    """One worker: takes what waits (up to max_batch texts), encodes it as one batch, answers each."""

    def __init__(self, engine, max_batch: int):
        self.engine, self.max_batch = engine, max_batch
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def embed(self, texts: list[str]) -> list[list[float]]:
        box = {"done": threading.Event()}
        self.q.put((texts, box))
        box["done"].wait()
        if "error" in box:
            raise RuntimeError(box["error"])
        return box["out"]

    def _run(self) -> None:
        while True:
            jobs = [self.q.get()]
            n = len(jobs[0][0])
            while n < self.max_batch:
                try:
                    jobs.append(self.q.get_nowait())
                except queue.Empty:
                    break
                n += len(jobs[-1][0])
            texts = [t for j, _ in jobs for t in j]
            try:
                out, at = self.engine.encode(texts), 0
                for j, box in jobs:
                    box["out"], at = out[at:at + len(j)], at + len(j)
            except Exception as e:      # every waiting request answered, none lost
                for _, box in jobs:
                    box["error"] = f"{type(e).__name__}: {e}"
            for _, box in jobs:
                box["done"].set()


class Server(ThreadingHTTPServer):
    request_queue_size = 256    # 64 clients connect at once (socketserver's default backlog: 5)
    daemon_threads = True


def make_handler(batcher: Batcher):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body go out as two writes: without TCP_NODELAY, Nagle's algorithm and the client's
        # delayed ACK hold the body ~40 ms (a keep-alive client would measure the front, not the engine)
        disable_nagle_algorithm = True

        def log_message(self, *a):
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"status": "ok"}) if self.path in ("/ping", "/health") else self._send(404, {})

        def do_POST(self):
            if self.path != "/v1/embeddings":
                return self._send(404, {"error": f"no route {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
                vecs = batcher.embed([str(t) for t in texts])
            except Exception as e:
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})
            self._send(200, {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": v}
                                                        for i, v in enumerate(vecs)]})

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m handler.tools.bench.embed_peer")
    ap.add_argument("--backend", choices=BACKENDS, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=64, help="texts encoded together at most")
    a = ap.parse_args(argv)
    engine = (SentenceTransformers(a.model_dir, a.threads) if a.backend == "st"
              else Exported(a.backend, a.model_dir, a.threads))
    engine.encode(["warm up"])
    srv = Server(("127.0.0.1", a.port), make_handler(Batcher(engine, a.max_batch)))
    print(f"embed_peer {a.backend} serving {a.model_dir} on {a.port}", flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
