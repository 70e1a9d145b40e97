"""OpenVINO GenAI as a benchmark peer (`openvino`, `openvino_int8`): installed into its own
venv, the model exported offline to OpenVINO IR from the same local HF directory our servers
load, served by the thinnest HTTP front over its ContinuousBatchingPipeline.

Install: python -m handler bench install-peer openvino [--dir DIR]   (or `make peer-openvino`)
Location: DIR, else $LMI_BENCH_OPENVINO_DIR, else <repo>/.cache/peers/openvino.

Why a front of our own: OpenVINO's server (OVMS) is a container image, not on PyPI. The front
(`python -m handler.tools.bench.openvino_peer serve ...`, run by the peer venv's Python) does
what OVMS does: one engine thread loops `pipe.step()` while requests wait; each request handler
calls `pipe.add_request(id, ids, GenerationConfig)`; the engine thread reads every handle after
each step into that request's queue. It speaks the same
/invocations subset as peers.py (streaming included) and tokenizes with the model dir's HF
tokenizer, so every cell sees the same prompt ids.

Facts relied on (openvino-genai 2026.4.1 on an AVX-512 BF16 CPU without AMX, shared/FACTS.md):
- `optimum-cli export openvino -m DIR --task text-generation-with-past --weight-format fp32|int8`
  writes the IR (models under 1B stay fp32 unless asked); optimum-intel pulls torchvision, which
  drags a CUDA torch: torch==2.13.0 (CPU, from the local wheel) goes in first, and torchvision,
  triton and the nvidia-* wheels are removed after;
- the CPU plugin computes in bf16 and keeps a bf16 KV cache by default on this CPU, even from an
  fp32 IR; fp32 needs INFERENCE_PRECISION_HINT=f32 *and* KV_CACHE_PRECISION=f32;
- the KV block is 32 tokens; SchedulerConfig's num_kv_blocks sizes the cache exactly.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from handler.tools.bench.vllm_cpu import REPO, python_of, resolve_peer_dir   # the peers' shared layout

NAME = "openvino"
QUANTIZED = {"openvino_int8": "int8"}     # cell -> IR weight format
KV_QUANTIZED = {"openvino_kv8": "u8"}     # cell -> KV_CACHE_PRECISION (weights and compute in the run dtype)
VERSION = "2026.4.1.0"
PACKAGES = (f"openvino-genai=={VERSION}", "optimum-intel[openvino]==2.2.0", "flask==3.1.3")
TORCH = "torch==2.13.0"                  # CPU build, a local wheel (FACTS.md): before optimum-intel
REMOVE_PREFIXES = ("torchvision", "triton", "nvidia-")
BLOCK = 32                               # the CPU plugin's KV block in tokens
MARKER = "lmi-peer.json"
ENV_DIR = "LMI_BENCH_OPENVINO_DIR"
INSTALL_HINT = "python -m handler bench install-peer openvino"
STARTUP_TIMEOUT = 600.0                  # compiling the IR; the export itself runs before start
# run dtype -> the CPU plugin's properties; int8 IRs take the run dtype's compute and KV too
PRECISION = {"fp32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"},
             "bf16": {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"}}


def peer_dir(path: str | None = None) -> str:
    return resolve_peer_dir(path, ENV_DIR, "openvino")


def installed(path: str | None = None) -> tuple[bool, str]:
    """(True, dir) when the installer finished there, else (False, why not: the command)."""
    d = peer_dir(path)
    if not os.path.isfile(os.path.join(d, MARKER)) or not os.path.exists(python_of(d)):
        return False, (f"OpenVINO GenAI peer not installed ({INSTALL_HINT}); looked in {d} "
                       f"(set {ENV_DIR} to use another)")
    return True, d


def install(path: str | None = None, log=print, python: str | None = None) -> str:
    d = peer_dir(path)
    t0 = time.monotonic()
    if not os.path.exists(python_of(d)):
        log(f"creating venv {d}")
        subprocess.run([python or sys.executable, "-m", "venv", d], check=True)
    py = python_of(d)
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    log(f"pip install {TORCH} (CPU), then {' '.join(PACKAGES)} (a few minutes, ~2 GB)")
    subprocess.run(pip + [TORCH], check=True)
    subprocess.run(pip + [*PACKAGES, TORCH], check=True)
    frozen = subprocess.run([py, "-m", "pip", "list", "--format", "json"], check=True, capture_output=True,
                            text=True).stdout
    drop = [p["name"] for p in json.loads(frozen) if p["name"].lower().startswith(REMOVE_PREFIXES)]
    if drop:
        log(f"removing what optimum pulled and text generation does not use: {' '.join(drop)}")
        subprocess.run([py, "-m", "pip", "uninstall", "-y", *drop], check=True)
    versions = subprocess.run(
        [py, "-c", "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
                   "('openvino', 'openvino-genai', 'openvino-tokenizers', 'optimum-intel', 'torch', "
                   "'transformers')}))"], check=True, capture_output=True, text=True).stdout
    info = {"packages": list(PACKAGES) + [TORCH], "versions": json.loads(versions), "removed": drop,
            "install_s": round(time.monotonic() - t0, 1)}
    with open(os.path.join(d, MARKER), "w") as f:
        json.dump(info, f, indent=2)
    log(f"OpenVINO peer installed in {d} ({info['install_s']:.0f} s): {info['versions']}")
    return d


# ------------------------------------------------------------------ IR export
def ir_dir(path: str, model_dir: str, weight_format: str) -> str:
    """Where the IR of (model dir, weight format) is cached: <peer>/models/<dir name>-<hash>-<fmt>."""
    import hashlib

    key = hashlib.sha1(os.path.realpath(model_dir).encode()).hexdigest()[:8]
    return os.path.join(path, "models", f"{os.path.basename(os.path.normpath(model_dir))}-{key}-{weight_format}")


def export(path: str, model_dir: str, weight_format: str, log=print) -> str:
    """optimum-cli export, once per (model dir, weight format); returns the IR directory."""
    if weight_format not in ("fp32", "int8"):
        raise ValueError(f"weight_format={weight_format!r}: allowed fp32, int8")
    out = ir_dir(path, model_dir, weight_format)
    if os.path.isfile(os.path.join(out, "openvino_model.xml")):
        return out
    log(f"exporting {model_dir} to OpenVINO IR ({weight_format}) in {out}")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VIRTUAL_ENV=path)
    env.pop("PYTHONPATH", None)
    subprocess.run([os.path.join(path, "bin", "optimum-cli"), "export", "openvino", "-m", model_dir,
                    "--task", "text-generation-with-past", "--weight-format", weight_format, tmp],
                   check=True, env=env)
    os.replace(tmp, out)
    return out


def server(path: str, ir: str, model_dir: str, port: int, kv_tokens: int, max_num_seqs: int,
           prefill_tokens: int, dtype: str, threads: int = 2, kv_precision: str | None = None,
           spec: tuple[list[str], dict] | None = None) -> tuple[list[str], dict, dict]:
    """(command, environment additions, what was held equal) for one front over `ir`.
    KV: our kv_tokens rounded up to whole 32-token blocks; kv_precision (e.g. "u8", the CPU
    plugin's quantized KV cache) instead of the run dtype's; spec: spec_args()'s (flags, what
    they set), speculation on."""
    if dtype not in PRECISION:
        raise ValueError(f"dtype={dtype!r}: allowed {', '.join(PRECISION)}")
    blocks = math.ceil(kv_tokens / BLOCK)
    cmd = [python_of(path), "-m", "handler.tools.bench.openvino_peer", "serve", "--ir", ir,
           "--tokenizer", model_dir, "--port", str(port), "--kv-blocks", str(blocks),
           "--max-num-seqs", str(max_num_seqs), "--max-batched-tokens", str(prefill_tokens),
           "--dtype", dtype, "--threads", str(threads)] + (["--kv-precision", kv_precision] if kv_precision else [])
    cmd += list(spec[0]) if spec else []
    env = {"VIRTUAL_ENV": path, "PYTHONPATH": REPO, "OMP_NUM_THREADS": str(threads)}
    held = {"kv_cache_tokens": blocks * BLOCK, "block_size": BLOCK, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": prefill_tokens, "prefix_caching": False, "dynamic_split_fuse": True,
            "properties": dict(PRECISION[dtype], INFERENCE_NUM_THREADS=threads,
                               **({"KV_CACHE_PRECISION": kv_precision} if kv_precision else {})), "ir": ir,
            "front": "handler.tools.bench.openvino_peer (engine thread loops step(); OVMS is not on PyPI)"}
    if spec:
        held["speculative"] = dict(spec[1])
    return cmd, env, held


# ------------------------------------------------------------------ speculative decoding
# OpenVINO GenAI's pipelines: ContinuousBatchingPipeline built with the property
# {"prompt_lookup": True} proposes from the request's own prompt and output (the last
# max_ngram_size..1 tokens looked up, the num_assistant_tokens after the match proposed); with
# {"draft_model": draft_model(IR, device, ...)} a second model proposes. Either way the request's
# GenerationConfig carries num_assistant_tokens (and max_ngram_size). The step API does not expose
# the acceptance counters (only generate()'s perf metrics do): the front counts, per request
# after its first token, the tokens each step produced (/spec_stats).
def spec_args(method: str, k: int, *, max_ngram_size: int = 4, draft_ir: str | None = None
              ) -> tuple[list[str], dict]:
    """(front flags, what they set) for speculation with `k` proposed tokens a step."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: must be an integer >= 1")
    if method == "ngram":
        if not isinstance(max_ngram_size, int) or max_ngram_size < 1:
            raise ValueError(f"max_ngram_size={max_ngram_size!r}: must be an integer >= 1")
        return (["--spec", "prompt_lookup", "--num-assistant-tokens", str(k), "--max-ngram-size",
                 str(max_ngram_size)],
                {"pipeline": "prompt_lookup", "num_assistant_tokens": k, "max_ngram_size": max_ngram_size})
    if method == "draft_model":
        if not draft_ir:
            raise ValueError("method draft_model needs draft_ir (the draft model's OpenVINO IR)")
        return (["--spec", "draft_model", "--num-assistant-tokens", str(k), "--draft-ir", draft_ir],
                {"pipeline": "draft_model", "num_assistant_tokens": k, "draft_ir": draft_ir,
                 "draft_kv": "its own scheduler config, as many blocks as the model's"})
    raise ValueError(f"method={method!r}: allowed ngram, draft_model")


# ------------------------------------------------------------------ the front (peer venv)
class Engine:
    """One thread loops pipe.step() while any request is unfinished and, after each step, hands
    every request's new ids to its queue (the pattern OVMS uses: handlers add requests and
    wait on their own output; nobody polls)."""

    def __init__(self, ir: str, kv_blocks: int, max_num_seqs: int, max_batched_tokens: int, dtype: str,
                 threads: int, kv_precision: str | None = None, spec: dict | None = None):
        import threading

        import openvino_genai as ov_genai

        sc = ov_genai.SchedulerConfig()
        sc.num_kv_blocks = kv_blocks
        sc.max_num_seqs = max_num_seqs
        sc.max_num_batched_tokens = max_batched_tokens
        sc.enable_prefix_caching = False
        sc.dynamic_split_fuse = True
        props = dict(PRECISION[dtype], INFERENCE_NUM_THREADS=threads)
        if kv_precision:
            props["KV_CACHE_PRECISION"] = kv_precision
        self.spec = spec or {}
        pipe_props = dict(props)
        if self.spec.get("pipeline") == "prompt_lookup":
            pipe_props["prompt_lookup"] = True
        elif self.spec.get("pipeline") == "draft_model":
            dsc = ov_genai.SchedulerConfig()
            for key in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                        "dynamic_split_fuse"):
                setattr(dsc, key, getattr(sc, key))
            pipe_props["draft_model"] = ov_genai.draft_model(self.spec["draft_ir"], "CPU", scheduler_config=dsc,
                                                             **props)
        self.ov = ov_genai
        self.pipe = ov_genai.ContinuousBatchingPipeline(ir, sc, "CPU", pipe_props)
        self.cv = threading.Condition()
        self.next_id = 0
        self.live: dict[int, tuple] = {}      # request id -> (handle, its queue)
        self.started: set[int] = set()        # requests that produced their first token
        self.stats = {"decode_steps": 0, "decode_tokens": 0}   # after each request's first token
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        running = self.ov.GenerationStatus.RUNNING
        while True:
            with self.cv:
                while not self.live:
                    self.cv.wait()
                live = list(self.live.items())
            try:
                self.pipe.step()
            except Exception as e:  # noqa: BLE001 - every waiting request learns why
                for rid, (_, q) in live:
                    q.put(RuntimeError(f"step failed: {type(e).__name__}: {e}"))
                with self.cv:
                    for rid, _ in live:
                        self.live.pop(rid, None)
                continue
            for rid, (h, q) in live:
                new = []
                while h.can_read():     # {sequence id: output}: the ids produced since the last read
                    new += [i for o in h.read().values() for i in o.generated_ids]
                if new:
                    if rid in self.started:
                        self.stats["decode_steps"] += 1
                        self.stats["decode_tokens"] += len(new)
                    self.started.add(rid)
                    q.put(new)
                status = h.get_status()
                if status != running:
                    self.started.discard(rid)
                    q.put(None if status == self.ov.GenerationStatus.FINISHED
                          else RuntimeError(f"generation ended with status {status}"))
                    with self.cv:
                        self.live.pop(rid, None)

    def submit(self, ids: list[int], max_new_tokens: int, ignore_eos: bool, eos: int | None):
        """-> a queue of lists of new ids, then None (finished) or an exception."""
        import queue

        import numpy as np
        import openvino as ov

        cfg = self.ov.GenerationConfig()
        cfg.max_new_tokens = max_new_tokens
        cfg.ignore_eos = ignore_eos
        if self.spec:
            cfg.num_assistant_tokens = self.spec["num_assistant_tokens"]
            if self.spec["pipeline"] == "prompt_lookup":
                cfg.max_ngram_size = self.spec["max_ngram_size"]
        if eos is not None:
            cfg.eos_token_id = eos
        q: queue.Queue = queue.Queue()
        with self.cv:
            rid = self.next_id
            self.next_id += 1
            h = self.pipe.add_request(rid, ov.Tensor(np.asarray([ids], dtype=np.int64)), cfg)
            self.live[rid] = (h, q)
            self.cv.notify()
        return q

    @staticmethod
    def tokens(q):
        """Yields (new ids, finished) from a submitted request's queue."""
        while True:
            item = q.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                yield [], True
                return
            yield item, False


def serve(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m handler.tools.bench.openvino_peer serve")
    ap.add_argument("--ir", required=True)
    ap.add_argument("--tokenizer", required=True, help="the HF model dir the IR came from")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--kv-blocks", type=int, required=True)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=tuple(PRECISION), default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-precision", help="KV_CACHE_PRECISION instead of the dtype's (u8: quantized KV)")
    ap.add_argument("--spec", choices=("prompt_lookup", "draft_model"), help="speculative decoding's pipeline")
    ap.add_argument("--num-assistant-tokens", type=int, default=5, help="with --spec: tokens proposed a step")
    ap.add_argument("--max-ngram-size", type=int, default=4, help="--spec prompt_lookup: longest n-gram matched")
    ap.add_argument("--draft-ir", help="--spec draft_model: the draft model's IR directory")
    a = ap.parse_args(argv)
    if a.spec == "draft_model" and not a.draft_ir:
        ap.error("--spec draft_model needs --draft-ir")
    spec = None if a.spec is None else {"pipeline": a.spec, "num_assistant_tokens": a.num_assistant_tokens,
                                        "max_ngram_size": a.max_ngram_size, "draft_ir": a.draft_ir}
    from flask import Flask, Response, jsonify, request
    from transformers import AutoTokenizer

    from handler.tools.bench.peers import BadRequest, _reason, final_body, parse_body

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    eng = Engine(a.ir, a.kv_blocks, a.max_num_seqs, a.max_batched_tokens, a.dtype, a.threads, a.kv_precision,
                 spec)
    app = Flask("openvino-peer")

    @app.get("/ping")
    def ping():
        return jsonify({"status": "healthy"})

    @app.get("/spec_stats")
    def spec_stats():
        with eng.cv:
            return jsonify(dict(eng.stats, speculative=a.spec))

    @app.post("/invocations")
    def invocations():
        try:
            prompt, n, ignore_eos, k, details, stream = parse_body(request.get_json(force=True, silent=True))
        except BadRequest as e:
            return jsonify({"code": 400, "message": str(e)}), 400
        want = min(n, k) if k else n
        ids = tok(prompt)["input_ids"]
        q = eng.submit(ids, want, ignore_eos, tok.eos_token_id)
        if not stream:
            out: list[int] = []
            try:
                for new, _ in eng.tokens(q):
                    out += new
            except Exception as e:  # noqa: BLE001 - the client records the message
                return jsonify({"code": 424, "message": f"{type(e).__name__}: {e}"}), 424
            return jsonify(final_body(tok.decode(out), out, _reason(out, n, k, tok.eos_token_id, ignore_eos),
                                      tok, details))

        def lines():
            out: list[int] = []
            pending = None     # the last token is held back to carry the final body
            try:
                for new, finished in eng.tokens(q):
                    for t in new:
                        if pending is not None:
                            yield json.dumps({"token": {"id": pending, "text": tok.decode([pending]),
                                                        "log_prob": None}}) + "\n"
                        pending = t
                        out.append(t)
                    if finished and pending is not None:
                        msg = {"token": {"id": pending, "text": tok.decode([pending]), "log_prob": None}}
                        msg.update(final_body(tok.decode(out), out,
                                              _reason(out, n, k, tok.eos_token_id, ignore_eos), tok, details))
                        yield json.dumps(msg) + "\n"
            except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
                yield json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n"

        return Response(lines(), mimetype="application/jsonlines")

    from werkzeug.serving import WSGIRequestHandler

    WSGIRequestHandler.protocol_version = "HTTP/1.1"
    app.run(host=a.host, port=a.port, threaded=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[2:]))
    print("usage: python -m handler.tools.bench.openvino_peer serve --ir DIR --tokenizer DIR ...", file=sys.stderr)
    sys.exit(2)
