"""llama.cpp's own server as a benchmark peer (`llamacpp`, `llamacpp_q8`, `llamacpp_gguf`): the native
`llama-server` built from the llama.cpp that PyPI's llama-cpp-python sdist vendors, serving a
GGUF converted from the same local HF directory our servers load, driven through its
OpenAI-compatible /v1/completions with the same prompt token ids as every other cell. Its own
quantizer, `llama-quantize`, is built beside it (`quantize`: a K-quant file such as Q4_K_M from a
converted bf16/f32 GGUF, as llama.cpp's users make them).

Install: python -m handler bench install-peer llamacpp [--dir DIR]   (or `make peer-llamacpp`)
Location: DIR, else $LMI_BENCH_LLAMACPP_DIR, else <repo>/.cache/peers/llamacpp.
Needs a C/C++ compiler and cmake (the installer runs `apt-get install -y cmake` when root and
cmake is absent; otherwise install it yourself). The build takes 8-15 minutes on 2 cores (more
on a loaded machine); a rerun reuses what is built.

Facts relied on (llama-cpp-python 0.3.36's vendored llama.cpp, read in tools/server and
common/arg.cpp):
- PyPI has only the sdist; `python -m llama_cpp.server` serializes requests behind one lock, so
  the peer is the native llama-server (continuous batching over -np slots);
- --kv-unified: one KV buffer of -c tokens shared by every slot (a slot may use all of it);
  KV type f16 unless -ctk/-ctv say otherwise; -b is the logical batch (tokens per decode call);
- a request's `"cache_prompt": false` turns its prompt cache off; `ignore_eos`, `max_tokens`
  (alias of n_predict), a prompt given as token ids, and a streamed last chunk that carries
  `usage` on /v1/completions; GET /health answers 200 once the model is loaded;
- the converter (convert_hf_to_gguf.py) needs sentencepiece, torch and transformers (its own
  venv here) and the vendored gguf-py; a transformers-5 tokenizer_config
  (tokenizer_class TokenizersBackend) is read through a copy naming PreTrainedTokenizerFast.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from handler.tools.bench.vllm_cpu import REPO, resolve_peer_dir   # the peers' shared layout

NAME = "llamacpp"
QUANTIZED = {"llamacpp_q8": "q8_0"}       # cell -> GGUF outtype
SOURCE_GGUF = ("llamacpp_gguf",)          # the .gguf file the model dir was converted from, as is (paged_gguf's blocks)
KV_QUANTIZED = {"llamacpp_kv8": "q8_0"}    # cell -> -ctk/-ctv (weights in the run dtype; a quantized V needs -fa on)
VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={VERSION}"
CONVERT_PACKAGES = ("torch==2.13.0", "transformers==5.23.0", "tokenizers==0.23.3", "safetensors==0.8.0",
                    "numpy==2.4.6", "sentencepiece==0.2.1", "pyyaml==6.0.4", "tqdm==4.70.1", "requests==2.34.2")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               # the tools find their shared libraries beside them wherever the folder is (not by the
               # absolute build path cmake records by default: a moved or symlinked peer would not start)
               "-DCMAKE_BUILD_RPATH=$ORIGIN")


def tool_env(path: str) -> dict:
    """The environment additions a built tool needs: its shared libraries' folder (a build made before
    CMAKE_BUILD_RPATH=$ORIGIN, or moved, records another absolute path)."""
    libs = os.path.dirname(binary(path))
    return {"LD_LIBRARY_PATH": libs + (os.pathsep + os.environ["LD_LIBRARY_PATH"]
                                       if os.environ.get("LD_LIBRARY_PATH") else "")}
MARKER = "lmi-peer.json"
ENV_DIR = "LMI_BENCH_LLAMACPP_DIR"
INSTALL_HINT = "python -m handler bench install-peer llamacpp"
STARTUP_TIMEOUT = 300.0
HEALTH = "/health"
OUTTYPE = {"fp32": "f32", "bf16": "bf16"}     # run dtype -> GGUF outtype of the unquantized cell
KV_TYPE = {"fp32": "f32", "bf16": "bf16"}     # run dtype -> -ctk/-ctv (q8_0 weights too)


def peer_dir(path: str | None = None) -> str:
    return resolve_peer_dir(path, ENV_DIR, "llamacpp")


def binary(path: str, tool: str = "llama-server") -> str:
    """One of the built tools: llama-server, or llama-quantize (its own quantizer: a Q4_K_M file)."""
    return os.path.join(path, "build", "bin", tool)


TOOLS = ("llama-server", "llama-quantize")


def source(path: str) -> str:
    return os.path.join(path, "src", f"llama_cpp_python-{VERSION}", "vendor", "llama.cpp")


def installed(path: str | None = None) -> tuple[bool, str]:
    d = peer_dir(path)
    if not os.path.isfile(os.path.join(d, MARKER)) or not os.access(binary(d), os.X_OK):
        return False, (f"llama.cpp peer not installed ({INSTALL_HINT}); looked in {d} "
                       f"(set {ENV_DIR} to use another)")
    return True, d


def install(path: str | None = None, log=print, python: str | None = None) -> str:
    """sdist -> vendored llama.cpp -> llama-server (niced), plus the converter's venv; each step
    skipped when its output is already there."""
    d = peer_dir(path)
    t0 = time.monotonic()
    os.makedirs(os.path.join(d, "src"), exist_ok=True)
    if shutil.which("cmake") is None:
        if shutil.which("apt-get") and os.geteuid() == 0:
            log("apt-get install -y cmake")
            subprocess.run(["apt-get", "install", "-y", "-q", "cmake"], check=False)
        if shutil.which("cmake") is None:
            raise RuntimeError("cmake not found: install it (Debian: sudo apt-get install -y cmake) and rerun")
    if not os.path.isfile(os.path.join(source(d), "CMakeLists.txt")):
        log(f"pip download --no-deps --no-binary :all: {SDIST}")
        subprocess.run([python or sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        SDIST, "-d", os.path.join(d, "src")], check=True)
        with tarfile.open(os.path.join(d, "src", f"llama_cpp_python-{VERSION}.tar.gz")) as t:
            t.extractall(os.path.join(d, "src"), filter="data")
    if not all(os.access(binary(d, t), os.X_OK) for t in TOOLS):
        log(f"building {' and '.join(TOOLS)} (8-15 minutes on 2 cores; niced)")
        subprocess.run(["nice", "-n", "10", "cmake", "-S", source(d), "-B", os.path.join(d, "build"), *CMAKE_FLAGS],
                       check=True)
        subprocess.run(["nice", "-n", "10", "cmake", "--build", os.path.join(d, "build"), "--target", *TOOLS, "-j2"],
                       check=True)
    venv = os.path.join(d, "convert-venv")
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([python or sys.executable, "-m", "venv", venv], check=True)
    log(f"converter venv: pip install {' '.join(CONVERT_PACKAGES)}")
    subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", *CONVERT_PACKAGES], check=True)
    version = subprocess.run([binary(d), "--version"], capture_output=True, text=True)
    info = {"sdist": SDIST, "cmake_flags": list(CMAKE_FLAGS), "converter_packages": list(CONVERT_PACKAGES),
            "llama_server_version": (version.stdout + version.stderr).strip()[:300],
            "install_s": round(time.monotonic() - t0, 1)}
    with open(os.path.join(d, MARKER), "w") as f:
        json.dump(info, f, indent=2)
    log(f"llama.cpp peer installed in {d} ({info['install_s']:.0f} s): {info['llama_server_version']}")
    return d


# ------------------------------------------------------------------ GGUF
def gguf_path(path: str, model_dir: str, outtype: str) -> str:
    import hashlib

    key = hashlib.sha1(os.path.realpath(model_dir).encode()).hexdigest()[:8]
    return os.path.join(path, "models", f"{os.path.basename(os.path.normpath(model_dir))}-{key}-{outtype}.gguf")


def hf_copy(model_dir: str, out: str) -> str:
    """A directory of links to model_dir's files whose tokenizer_config names a class the
    converter's transformers reads (PreTrainedTokenizerFast) when it names another."""
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(model_dir):
        dst = os.path.join(out, f)
        if not os.path.lexists(dst):
            os.symlink(os.path.join(os.path.abspath(model_dir), f), dst)
    cfg = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(cfg):
        with open(cfg) as fh:
            tc = json.load(fh)
        if tc.get("tokenizer_class") not in (None, "PreTrainedTokenizerFast"):
            tc["tokenizer_class"] = "PreTrainedTokenizerFast"
            os.unlink(os.path.join(out, "tokenizer_config.json"))
            with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
                json.dump(tc, fh, indent=1)
    return out


def convert(path: str, model_dir: str, outtype: str, log=print) -> str:
    """convert_hf_to_gguf.py --outtype f32|bf16|q8_0, once per (model dir, outtype)."""
    if outtype not in ("f32", "bf16", "q8_0"):
        raise ValueError(f"outtype={outtype!r}: allowed f32, bf16, q8_0")
    out = gguf_path(path, model_dir, outtype)
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    src = hf_copy(model_dir, out[:-len(".gguf")] + ".hf")
    log(f"converting {model_dir} to GGUF {outtype}: {out}")
    env = dict(os.environ, PYTHONPATH=os.path.join(source(path), "gguf-py"), HF_HUB_OFFLINE="1")
    subprocess.run(["nice", "-n", "10", os.path.join(path, "convert-venv", "bin", "python"),
                    os.path.join(source(path), "convert_hf_to_gguf.py"), src, "--outtype", outtype,
                    "--outfile", out + ".tmp"], check=True, env=env)
    os.replace(out + ".tmp", out)
    shutil.rmtree(src, ignore_errors=True)
    return out


def quantize(path: str, src_gguf: str, kind: str = "Q4_K_M", log=print) -> str:
    """llama.cpp's own quantizer over a converted GGUF (`llama-quantize SRC OUT KIND`), once per
    (source, kind): the file beside the source, named <source stem>-<kind>.gguf."""
    out = src_gguf.removesuffix(".gguf") + f"-{kind}.gguf"
    if os.path.isfile(out):
        return out
    log(f"llama-quantize {os.path.basename(src_gguf)} -> {kind}: {out}")
    subprocess.run(["nice", "-n", "10", binary(path, "llama-quantize"), src_gguf, out + ".tmp", kind], check=True,
                   env={**os.environ, **tool_env(path)})
    os.replace(out + ".tmp", out)
    return out


def outtype_of(cell: str, dtype: str) -> str:
    """The GGUF a cell serves: q8_0 for llamacpp_q8, else the run dtype's (f32 or bf16; llamacpp_kv8 too)."""
    if cell in QUANTIZED:
        return QUANTIZED[cell]
    if dtype not in OUTTYPE:
        raise ValueError(f"dtype={dtype!r}: allowed {', '.join(OUTTYPE)}")
    return OUTTYPE[dtype]


KV_LAYOUTS = ("unified", "split")


def server(path: str, gguf: str, port: int, kv_tokens: int, slots: int, prefill_tokens: int, dtype: str,
           threads: int = 2, kv_layout: str = "unified", kv_type: str | None = None,
           spec: tuple[list[str], dict] | None = None, metrics: bool = False) -> tuple[list[str], dict, dict]:
    """(command, environment additions, what was held equal). -c is the whole KV in tokens
    (llama.cpp cells hold one token each: no block rounding); -b the prefill budget.

    kv_layout "unified" (--kv-unified): one buffer every slot may fill; each sequence's attention
    then runs over every used cell of the buffer, masked. "split" (--no-kv-unified): each of the
    -np slots owns kv_tokens / slots cells, its attention runs over its own cells only (pass fewer
    slots, e.g. the client count, so that a slot holds the longest sequence).

    spec: spec_args()'s (flags, what they set), speculation on; metrics: --metrics (its /metrics
    counts speculation's proposed and accepted tokens: spec_counters())."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r}: allowed {', '.join(KV_LAYOUTS)}")
    kv = kv_type or KV_TYPE[dtype]
    cmd = [binary(path), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "--kv-unified" if kv_layout == "unified" else "--no-kv-unified", "-c", str(kv_tokens),
           "-t", str(threads), "-tb", str(threads), "-b", str(prefill_tokens), "-ctk", kv, "-ctv", kv,
           "--cache-ram", "0", "--no-warmup"] + (["-fa", "on"] if kv_type else [])
    cmd += (["--metrics"] if metrics else []) + (list(spec[0]) if spec else [])
    held = {"kv_cache_tokens": kv_tokens, "kv_layout": kv_layout, "slots": slots, "batch_tokens": prefill_tokens,
            "threads": threads, "kv_cache_type": kv, "flash_attn": "on" if kv_type else "default",
            "gguf": os.path.basename(gguf),
            "prefix_caching": "off per request (cache_prompt false) and --cache-ram 0"}
    if kv_layout == "split":
        held["kv_tokens_per_slot"] = kv_tokens // slots
    if spec:
        held["speculative"] = dict(spec[1])
    return cmd, tool_env(path), held


# ------------------------------------------------------------------ speculative decoding
# llama-server's own speculation (common/arg.cpp, common/speculative.cpp of the vendored llama.cpp):
# --spec-type picks the proposers; the n-gram ones look the sequence's last n tokens up in its own
# prompt and output (no second model): ngram-simple proposes the m tokens that followed the latest
# earlier occurrence (prompt lookup); ngram-map-k keeps a map of n-gram keys. The lookup example's
# 3-level n-gram cache is the server's ngram-cache (not driven here: its draft length is fixed at 8).
# A draft model is --spec-type draft-simple with --spec-draft-model (a GGUF of the same vocabulary).
NGRAM_TYPES = ("ngram-simple", "ngram-map-k")
SPEC_METRICS = {"proposed": "llamacpp:spec_decode_num_draft_tokens_total",
                "accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
                "verifies": "llamacpp:spec_decode_num_drafts_total"}


def spec_args(method: str, k: int, *, ngram_n: int = 2, ngram_type: str = "ngram-simple",
              draft_gguf: str | None = None, kv_type: str = "f32", threads: int = 2) -> tuple[list[str], dict]:
    """(llama-server flags, what they set) for speculation with `k` proposed tokens a step.
    method "ngram": `ngram_type` over the last `ngram_n` tokens; "draft_model": `draft_gguf`
    proposes greedily (p-min 0: always k tokens), its KV in `kv_type`, on `threads` threads."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: must be an integer >= 1")
    if method == "ngram":
        if ngram_type not in NGRAM_TYPES:
            raise ValueError(f"ngram_type={ngram_type!r}: allowed {', '.join(NGRAM_TYPES)}")
        if not isinstance(ngram_n, int) or ngram_n < 1:
            raise ValueError(f"ngram_n={ngram_n!r}: must be an integer >= 1")
        key = ngram_type.removeprefix("ngram-")
        return (["--spec-type", ngram_type, f"--spec-ngram-{key}-size-n", str(ngram_n),
                 f"--spec-ngram-{key}-size-m", str(k)],
                {"spec_type": ngram_type, "ngram_n": ngram_n, "draft_tokens": k})
    if method == "draft_model":
        if not draft_gguf:
            raise ValueError("method draft_model needs draft_gguf (the draft model's GGUF)")
        return (["--spec-type", "draft-simple", "--spec-draft-model", draft_gguf, "--spec-draft-n-max", str(k),
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-ctkd", kv_type, "-ctvd", kv_type,
                 "-td", str(threads), "-tbd", str(threads)],
                {"spec_type": "draft-simple", "draft_gguf": os.path.basename(draft_gguf), "draft_tokens": k,
                 "draft_kv_cache_type": kv_type})
    raise ValueError(f"method={method!r}: allowed ngram, draft_model")


def spec_counters(metrics_text: str) -> dict:
    """llama-server's /metrics (started with --metrics) -> {proposed, accepted, verifies}: draft
    tokens offered, accepted, and verification steps, counted since start."""
    want = {v: k for k, v in SPEC_METRICS.items()}
    out = {}
    for line in metrics_text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in want:
            out[want[parts[0]]] = float(parts[1])
    return out
