"""Image requests against a vision-language model: our server, and optionally vLLM's CPU build on the same checkpoint.

  python benchmarks/vlm_images.py --out benchmarks/results/vlm-images [--model-dir DIR | --build SHAPE]
                                  [--clients 1,4] [--requests 16] [--max-tokens 32] [--with-vllm]

Each request is one chat message: a 448x448 PNG (base64 data: URL, a fixed random image per request
index, so no two requests share an image and no encoder or prefix cache helps) and a short question,
streamed (`stream: true`), `max_tokens` tokens with EOS ignored. Per client count: TTFT (first content
chunk) p50/p90 and mean, requests/s over the whole run (closed loop: each client sends its next request
when its last one ends). With --with-vllm the same requests go to vLLM's CPU build (`python -m handler
bench install-peer vllm`), started on the same checkpoint with the same running limit and prefill budget;
the ratios (ours / vLLM's) are written beside. Writes result.json and README.md (the host named) in --out.

--build SHAPE writes a random-weight checkpoint of a realistic shape (no hub; speed only):
  clip-b16-smollm2   LLaVA: CLIP ViT-B/16 at 224 px (196 image tokens, 86 M) + SmolLM2-135M's language model
  clip-l14-smollm2   LLaVA: CLIP ViT-L/14 at 336 px (576 image tokens, 304 M) + SmolLM2-135M's language model
  smolvlm-256m       Idefics3 as SmolVLM-256M: SigLIP-B/16 at 512 px (93 M), pixel shuffle by 4 (64 image
                     tokens a tile; a 448 px image is one tile) + SmolLM2-135M's language model (the family
                     vLLM CPU 0.32 serves without torchvision: its LLaVA, Qwen2-VL and Gemma 3 import it)
  tiny               the tests' tiny LLaVA (smoke runs)
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from handler.tools.bench.client import wait_ready  # noqa: E402
from handler.tools.bench.compare import free_port  # noqa: E402

QUESTION = "Describe this picture in one sentence."
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=2048, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 100000.0})
SHAPES = {
    "clip-b16-smollm2": (dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              patch_size=16, projection_dim=512), 224, 16, SMOLLM2),
    "clip-l14-smollm2": (dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              patch_size=14, projection_dim=768), 336, 14, SMOLLM2),
}


SIGLIP_B16 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=16)


def build(shape: str, out: str) -> str:
    from handler.tools.demo_model import build_demo_idefics3, build_demo_llava
    if shape == "tiny":
        return build_demo_llava(out)
    if shape == "smolvlm-256m":
        return build_demo_idefics3(out, tile=512, longest=512, text=SMOLLM2, vision=SIGLIP_B16, scale=4)
    vision, size, patch, text = SHAPES[shape]
    return build_demo_llava(out, text=text, vision=vision, image_size=size, patch_size=patch)


def image_url(i: int, size: int = 448) -> str:
    import numpy as np
    from PIL import Image
    px = np.random.default_rng(i).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(i: int, max_tokens: int, model: str) -> dict:
    return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(i)}},
                                                      {"type": "text", "text": QUESTION}]}]}


def one(url: str, b: dict) -> tuple[float, float]:
    """(TTFT, total seconds) of one streamed chat request."""
    t0 = time.perf_counter()
    ttft = None
    with requests.post(url + "/v1/chat/completions", json=b, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if ttft is None and delta and delta[0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0


def drive(url: str, clients: int, n: int, max_tokens: int, model: str, offset: int) -> dict:
    """n requests from `clients` closed-loop clients; the figures."""
    todo = list(range(offset, offset + n))
    lock, got = threading.Lock(), []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            got.append(one(url, body(i, max_tokens, model)))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(t for t, _ in got)
    return {"clients": clients, "requests": len(got), "seconds": wall, "requests_per_s": len(got) / wall,
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]}


class Ours:
    def __init__(self, model_dir: str, props: str, log_dir: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.path.join(log_dir, "ours.properties")
        with open(path, "w") as f:
            f.write(props)
        self.log = open(os.path.join(log_dir, "ours.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "handler", "serve", "--properties", path, "--model-dir",
                                      model_dir, "--host", "127.0.0.1", "--port", str(self.port)], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        wait_ready(self.url, 600, self.proc)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


class Vllm:
    def __init__(self, model_dir: str, running: int, prefill: int, kv_tokens: int, dtype: str, log_dir: str):
        from handler.tools.bench import vllm_cpu
        ok, where = vllm_cpu.installed()
        if not ok:
            raise SystemExit(f"--with-vllm: {where}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd, env, self.held = vllm_cpu.server(where, model_dir, self.port, kv_tokens, running, prefill, dtype)
        full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self.log = open(os.path.join(log_dir, "vllm.log"), "w")
        self.proc = subprocess.Popen(cmd + ["--limit-mm-per-prompt", json.dumps({"image": 1})], env=full,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_ready(self.url, vllm_cpu.STARTUP_TIMEOUT, self.proc)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(120)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir")
    p.add_argument("--build", choices=[*SHAPES, "smolvlm-256m", "tiny"], default="clip-b16-smollm2")
    p.add_argument("--out", required=True)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--requests", type=int, default=16, help="per client count")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--with-vllm", action="store_true")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    model_dir = a.model_dir or build(a.build, os.path.join(tempfile.mkdtemp(prefix="vlm-bench-"), a.build))
    shape = a.build if not a.model_dir else f"the checkpoint in {a.model_dir}"
    running, prefill, kv = 4, 2048, 8192
    props = (f"option.rolling_batch=auto\noption.max_rolling_batch_size={running}\n"
             f"option.max_rolling_batch_prefill_tokens={prefill}\noption.kv_cache_tokens={kv}\noption.dtype={a.dtype}\n"
             "option.encoder_cache_mb=0\n")
    clients = [int(c) for c in a.clients.split(",")]
    result = {"host": platform.node(), "cpus": os.cpu_count(), "model_dir": model_dir, "shape": shape,
              "request": {"image": "448x448 PNG, a different one each request", "question": QUESTION,
                          "max_tokens": a.max_tokens, "stream": True, "ignore_eos": True},
              "properties": props, "ours": [], "vllm": None}
    srv = Ours(model_dir, props, a.out)
    try:
        one(srv.url, body(10_000, 2, "m"))        # warm-up (kernels, first encoder run)
        for k, c in enumerate(clients):
            result["ours"].append(drive(srv.url, c, a.requests, a.max_tokens, "m", 1000 * k))
    finally:
        srv.stop()
    if a.with_vllm:
        from handler.tools.bench import vllm_cpu
        peer = Vllm(model_dir, running, prefill, kv, a.dtype, a.out)
        result["vllm"] = {"held_equal": peer.held, "runs": []}
        try:
            one(peer.url, body(10_000, 2, vllm_cpu.SERVED_NAME))
            for k, c in enumerate(clients):
                result["vllm"]["runs"].append(drive(peer.url, c, a.requests, a.max_tokens, vllm_cpu.SERVED_NAME,
                                                    1000 * k))
        finally:
            peer.stop()
        result["ratios"] = [{"clients": o["clients"], "requests_per_s": o["requests_per_s"] / v["requests_per_s"],
                             "ttft_p50": v["ttft_p50_s"] / o["ttft_p50_s"]}
                            for o, v in zip(result["ours"], result["vllm"]["runs"])]
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Image requests: {shape} on {result['host']} ({result['cpus']} CPUs)", "",
             f"`python benchmarks/vlm_images.py {' '.join(argv)}`", "",
             "| server | clients | requests/s | TTFT p50 (s) | TTFT p90 (s) |", "|---|---|---|---|---|"]
    for name, runs in (("ours", result["ours"]), ("vLLM CPU", (result["vllm"] or {}).get("runs", []))):
        for r in runs:
            lines.append(f"| {name} | {r['clients']} | {r['requests_per_s']:.3f} | {r['ttft_p50_s']:.3f} | "
                         f"{r['ttft_p90_s']:.3f} |")
    for r in result.get("ratios", []):
        lines.append(f"\n{r['clients']} clients: requests/s ours / vLLM {r['requests_per_s']:.2f}x, "
                     f"TTFT p50 vLLM / ours {r['ttft_p50']:.2f}x")
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
