"""`bench compare`: our four strategies and three peers, one model, one dtype, one KV
capacity, one request list; repetitions interleaved (the server order rotates each
repetition) so that machine drift hits every server alike. Writes results.json, results.md
and results.png. Each measured repetition also records the CPU time of the server's whole
process tree (handler/tools/bench/cputime.py).
"""
from __future__ import annotations

import collections
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from handler.tools.bench import llamacpp_peer, openvino_peer, peak, vllm_cpu
from handler.tools.bench.client import LMI, LlamaCppCompletions, OpenAICompletions, run_load, wait_ready
from handler.tools.bench.cputime import TreeCpu
from handler.tools.bench.metrics import Record, Slo, expected_ideal_speedup, ideal_speedup, summarise
from handler.tools.bench.workloads import PRESETS, Preset, Workload, output_lengths, prompt_of

STRATEGIES = ("none", "dynamic", "rolling", "paged")
# Quantized cells: a strategy served with option.quantize=<method> (handler/model/quant.py).
QUANTIZED = {"paged_int8": ("paged", "int8"), "paged_w8a16": ("paged", "int8_weight_only"),
             "paged_gguf": ("paged", "gguf")}     # paged_gguf: a model converted from a .gguf file only
# A strategy over an int8 KV cache (option.kv_cache_dtype=int8), weights in the run dtype.
KV_QUANTIZED = {"paged_kv8": ("paged", "int8")}
# The CPU peers installed in their own directories (install-peer), each a cell in the run's dtype
# and a cell with int8 weights: OpenVINO GenAI (int8 weight-compressed IR) and llama.cpp (q8_0).
OPENVINO = (openvino_peer.NAME, *openvino_peer.QUANTIZED, *openvino_peer.KV_QUANTIZED)
LLAMACPP = (llamacpp_peer.NAME, *llamacpp_peer.QUANTIZED, *llamacpp_peer.SOURCE_GGUF, *llamacpp_peer.KV_QUANTIZED)
PEERS = ("hf_naive", "transformers_cb", vllm_cpu.NAME, *OPENVINO, *LLAMACPP)
ALONE = (vllm_cpu.NAME, *OPENVINO, *LLAMACPP)   # started for their own run only: they own the cores while up
INSTALL_HINTS = {vllm_cpu.NAME: vllm_cpu.INSTALL_HINT, **{c: openvino_peer.INSTALL_HINT for c in OPENVINO},
                 **{c: llamacpp_peer.INSTALL_HINT for c in LLAMACPP}}
# The installed peers' thread count: every core this process may use (2 on the project's machine),
# as ours and the torch peers take by default.
THREADS = len(os.sched_getaffinity(0))
DTYPES = ("fp32", "bf16")
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SERIAL = ("none", "hf_naive")          # one request at a time (Workload.serial_requests)
ALL = STRATEGIES + tuple(QUANTIZED) + tuple(KV_QUANTIZED) + PEERS
BLOCK = 16  # tokens per KV block for our servers (option.block_size default) and the CB peer's page
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CONFIGS = os.path.join(ROOT, "benchmarks", "configs")


# ------------------------------------------------------------------ model
def prepare_model(preset: Preset, out_dir: str, model_dir: str | None = None, dtype: str = "fp32") -> str:
    """The model every server loads: the given dir, the tiny demo model, or a shape shipped
    in benchmarks/configs (SmolLM-135M's, Llama-2-7B's) with random weights saved in `dtype`
    (no download). Built once into out_dir/model and reused by later runs there (every
    server casts to the run's dtype on load)."""
    if model_dir:
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ValueError(f"--model-dir {model_dir!r} has no config.json")
        return os.path.abspath(model_dir)
    path = os.path.abspath(os.path.join(out_dir, "model"))
    if os.path.isfile(os.path.join(path, "config.json")):
        return path   # built by an earlier run into the same out dir
    if preset.model == "qwen3-30b-a3b-q4km":     # needs llama.cpp's quantizer: made by its script
        raise ValueError(f"preset {preset.name}: give --model-dir, the directory benchmarks/moe_q4km.py "
                         "converts (it also runs this comparison)")
    if preset.model == "demo":
        from handler.tools.demo_model import build_demo_model

        return os.path.abspath(build_demo_model(path, "llama"))
    from handler.tools.real_model import MODELS
    if preset.model in MODELS and preset.model != "smollm2":
        # Converted once into the checkout's model cache (several GB: not copied into each out dir).
        from handler.tools.real_model import build_real_model
        return os.path.abspath(build_real_model(os.path.join(ROOT, ".cache", "models", preset.model),
                                                model=MODELS[preset.model]))
    if preset.model == "smollm2":
        from handler.tools.real_model import FetchError, build_real_model
        try:
            return os.path.abspath(build_real_model(path))
        except FetchError as e:   # no package index: the same shape with random weights
            print(f"bench: {e}; measuring SmolLM-135M's shape with random weights instead", file=sys.stderr)
            return materialise_random(os.path.join(CONFIGS, "smollm-135m", "config.json"), path, TORCH_DTYPE[dtype])
    return materialise_random(os.path.join(CONFIGS, preset.model, "config.json"), path, TORCH_DTYPE[dtype])


def materialise_random(config_json: str, out_dir: str, dtype: str = "bfloat16") -> str:
    """config.json -> a loadable model dir with random weights + the demo tokenizer, padded
    with unused tokens to the config's vocab size (so every sampled id decodes)."""
    from handler.tools import demo_model

    if hasattr(demo_model, "materialise_random"):
        return demo_model.materialise_random(config_json, out_dir, dtype)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(os.path.dirname(config_json))
    tok = demo_model.build_tokenizer(cfg.vocab_size)
    if len(tok) < cfg.vocab_size:
        tok.add_tokens([f"<unused_{i}>" for i in range(cfg.vocab_size - len(tok))])
    cfg.pad_token_id = tok.pad_token_id
    cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id   # the demo tokenizer's
    dt = getattr(torch, dtype)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    model.generation_config.pad_token_id = tok.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    del model
    return out_dir


def prompt_tokens(tok, workload: Workload, bodies: list[dict]) -> tuple[list[int], dict]:
    """(per prompt length class: its tokens, or its longest draw for a workload sized in
    tokens; min/mean/max over the drawn prompts)."""
    drawn = [len(tok(b["inputs"])["input_ids"]) for b in bodies]
    if workload.chat:    # instructions of every length: the shortest and the longest drawn
        classes = [min(drawn), max(drawn)]
    elif workload.prompt_tokens:
        classes = [max((n for n in drawn if t <= n < nxt), default=t) for t, nxt in
                   zip(sorted(workload.prompt_tokens), sorted(workload.prompt_tokens)[1:] + [10**9])]
    else:
        classes = [len(tok(prompt_of(w))["input_ids"]) for w in workload.prompt_words]
    return classes, {"min": min(drawn), "mean": sum(drawn) / len(drawn), "max": max(drawn)}


def kv_cache_tokens(workload: Workload, prompt_toks: list[int]) -> int:
    """workload.kv_cache_tokens when set; else room for `kv_reservations` (default C)
    sequences of the longest prompt + the largest max_new_tokens, plus one block each for
    block rounding."""
    if workload.kv_cache_tokens:
        return workload.kv_cache_tokens
    per_seq = math.ceil((max(prompt_toks) + max(workload.max_new_tokens)) / BLOCK) + 1
    return (workload.kv_reservations or workload.concurrency) * per_seq * BLOCK


# ------------------------------------------------------------------ servers
def properties(strategy: str, w: Workload, kv_tokens: int, dtype: str | None, tp: int = 1) -> str:
    quantize = kv_dtype = None
    if strategy in QUANTIZED:
        strategy, quantize = QUANTIZED[strategy]
    elif strategy in KV_QUANTIZED:
        strategy, kv_dtype = KV_QUANTIZED[strategy]
    lines = {
        "none": ["batch_size=1", "option.rolling_batch=disable"],   # absent is auto (option.lmi_compat)
        "dynamic": [f"batch_size={w.batch_width}", f"max_batch_delay={w.max_batch_delay_ms}"],
        "rolling": ["option.rolling_batch=auto", "option.paged_attention=false",
                    f"option.max_rolling_batch_size={w.max_rolling_batch_size}"],
        "paged": ["option.rolling_batch=auto", "option.paged_attention=true",
                  f"option.max_rolling_batch_size={w.max_rolling_batch_size}"],
    }[strategy]
    if strategy in ("rolling", "paged"):  # none/dynamic prefill whole batches: the key is ignored there
        lines.append(f"option.max_rolling_batch_prefill_tokens={w.prefill_tokens}")
    lines += [f"option.kv_cache_tokens={kv_tokens}", f"option.block_size={BLOCK}"]
    if dtype:
        lines.append(f"option.dtype={dtype}")
    if tp > 1:
        lines.append(f"option.tensor_parallel_degree={tp}")
    if quantize:
        lines.append(f"option.quantize={quantize}")
    if kv_dtype:
        lines.append(f"option.kv_cache_dtype={kv_dtype}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Arm:
    """A named cell of our server: a strategy with extra properties, optionally served from another
    checkout (an A/B of two commits in one interleaved run: `before=paged@/work/main`)."""
    name: str
    strategy: str
    root: str | None = None             # a checkout whose `handler` the server runs (None: this one)
    extra: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Arm":
        """NAME=STRATEGY[@CHECKOUT][+key=value...], e.g. after=paged+option.target_tpot_ms=80."""
        name, eq, rest = text.partition("=")
        parts = rest.split("+")
        strategy, _, root = parts[0].partition("@")
        if not eq or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in ALL:
            raise ValueError(f"--arm {text!r}: NAME=STRATEGY[@CHECKOUT][+key=value...] with a new name "
                             f"(letters, digits, _.-; not one of the built-in cells)")
        if strategy not in STRATEGIES and strategy not in QUANTIZED and strategy not in KV_QUANTIZED:
            raise ValueError(f"--arm {text!r}: strategy {strategy!r}; allowed: "
                             + ", ".join((*STRATEGIES, *QUANTIZED, *KV_QUANTIZED)))
        if root and not os.path.isfile(os.path.join(root, "handler", "__main__.py")):
            raise ValueError(f"--arm {text!r}: {root} is not a checkout of this project (no handler/__main__.py)")
        extra = []
        for kv in parts[1:]:
            k, eq, v = kv.partition("=")
            if not eq or not k or not v:
                raise ValueError(f"--arm {text!r}: {kv!r} is not key=value")
            extra.append((k, v))
        return cls(name, strategy, os.path.abspath(root) if root else None, tuple(extra))

    def property(self, key: str) -> str | None:
        return next((v for k, v in self.extra if k == key), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Our servers accept the early-stop workloads' knob (parameters.eos_after) only with this switch.
OWN_SERVER_ENV = {"LMI_BENCH_EOS_AFTER": "1"}


@dataclass
class Server:
    name: str
    cmd: list[str]
    log_path: str
    port: int
    proc: subprocess.Popen | None = None
    error: str | None = None
    api: object = LMI                    # the client's body/stream adapter (client.py)
    env: dict | None = None              # additions to the environment (None values: removed)
    startup_timeout: float | None = None  # at least this long (None: the run's)
    skipped: str | None = None           # why it is not run (e.g. a peer not installed)
    held: dict | None = None             # what it was started with, as it counts (results)
    health: str = "/ping"                # the readiness route (llama-server: /health)
    prep_error: str | None = None        # its model could not be prepared: every run reports this
    cwd: str | None = None               # where it starts (an Arm's checkout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.prep_error:
            self.error = self.prep_error
            return
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        for k, v in (self.env or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        log = open(self.log_path, "a")
        # Own session: SIGTERM reaches the whole group (gunicorn master and workers).
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.cwd)
        log.close()

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        timeout = max(timeout, self.startup_timeout or 0)
        try:
            wait_ready(self.url, timeout, self.proc, self.health)
        except (TimeoutError, RuntimeError) as e:
            self.error = f"{e}; log: {self.log_path}: {tail(self.log_path)}"

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def tail(path: str, n: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-n:])
    except OSError:
        return ""


def make_servers(names, w: Workload, model_dir: str, kv_tokens: int, run_dir: str,
                 dtype: str | None, tp: int = 1, vllm_dir: str | None = None, tok=None,
                 peer_dirs: dict | None = None, log_fn=print, arms: dict | None = None) -> list[Server]:
    """peer_dirs: {"openvino": dir, "llamacpp": dir} overriding the installed peers' defaults;
    arms: name -> Arm (our server with extra properties, or another checkout's)."""
    servers = []
    peer_dirs = peer_dirs or {}
    arms = arms or {}
    for name in names:
        port = free_port()
        log = os.path.join(run_dir, f"{name}.log")
        if name in OPENVINO or name in LLAMACPP:
            servers.append(installed_peer(name, w, model_dir, kv_tokens, log, port, dtype or "fp32", tok,
                                          peer_dirs, log_fn))
            continue
        if name == vllm_cpu.NAME:
            ok, where = vllm_cpu.installed(vllm_dir)
            if not ok:
                servers.append(Server(name, [], log, port, skipped=where))
                continue
            cmd, env, held = vllm_cpu.server(where, model_dir, port, kv_tokens, w.max_rolling_batch_size,
                                             w.prefill_tokens, dtype or "fp32")
            servers.append(Server(name, cmd, log, port, api=OpenAICompletions(vllm_cpu.SERVED_NAME), env=env,
                                  startup_timeout=vllm_cpu.STARTUP_TIMEOUT, held=held))
            continue
        if name == "paged_gguf":
            from handler.config.quantization import converted_from_gguf
            if not converted_from_gguf(model_dir):
                servers.append(Server(name, [], log, port, skipped=f"{model_dir} was not converted from a .gguf "
                                                                   "file (its blocks are what paged_gguf serves)"))
                continue
        arm = arms.get(name)
        if arm is not None or name in STRATEGIES or name in QUANTIZED or name in KV_QUANTIZED:
            props = os.path.join(run_dir, f"{name}.properties")
            with open(props, "w") as f:
                f.write(properties(arm.strategy if arm else name, w, kv_tokens, dtype, tp)
                        + "".join(f"{k}={v}\n" for k, v in (arm.extra if arm else ())))
            # Absolute paths: an arm from another checkout starts there.
            cmd = [sys.executable, "-m", "handler", "serve", "--properties", os.path.abspath(props),
                   "--model-dir", os.path.abspath(model_dir), "--port", str(port), "--host", "127.0.0.1"]
            if arm is not None and arm.root:
                servers.append(Server(name, cmd, log, port, env={**OWN_SERVER_ENV, "PYTHONPATH": arm.root},
                                      cwd=arm.root, held={"checkout": arm.root}))
                continue
        else:
            cmd = [sys.executable, "-m", "handler.tools.bench.peers", "--kind", name, "--model-dir", model_dir,
                   "--port", str(port), "--kv-cache-tokens", str(kv_tokens),
                   "--prefill-tokens", str(w.prefill_tokens),
                   "--max-batch-size", str(w.max_rolling_batch_size), "--page-size", str(BLOCK)]
            if dtype:
                cmd += ["--dtype", TORCH_DTYPE[dtype]]
        servers.append(Server(name, cmd, log, port, env=OWN_SERVER_ENV))
    return servers


def installed_peer(name: str, w: Workload, model_dir: str, kv_tokens: int, log: str, port: int, dtype: str,
                   tok, peer_dirs: dict, log_fn=print) -> Server:
    """An OpenVINO or llama.cpp cell: skipped with the install command when the peer is absent;
    its model exported/converted once (cached in the peer's directory) before any clock starts."""
    mod = openvino_peer if name in OPENVINO else llamacpp_peer
    ok, where = mod.installed(peer_dirs.get(mod.NAME))
    if not ok:
        return Server(name, [], log, port, skipped=where)
    try:
        if mod is openvino_peer:
            ir = openvino_peer.export(where, model_dir, openvino_peer.QUANTIZED.get(name, "fp32"), log=log_fn)
            cmd, env, held = openvino_peer.server(where, ir, model_dir, port, kv_tokens, w.max_rolling_batch_size,
                                                  w.prefill_tokens, dtype, THREADS, openvino_peer.KV_QUANTIZED.get(name))
            return Server(name, cmd, log, port, env=env, startup_timeout=openvino_peer.STARTUP_TIMEOUT, held=held)
        layout = peer_dirs.get("llamacpp_kv", "unified")
        slots = w.max_rolling_batch_size
        if layout == "split":    # a slot per client (the running limit never binds beyond that)
            slots = min(slots, w.concurrency)
            if kv_tokens // slots < w_longest(w, tok):
                return Server(name, [], log, port, prep_error=(
                    f"--llamacpp-kv split: {kv_tokens} KV tokens / {slots} slots = {kv_tokens // slots} per slot, "
                    f"less than the longest sequence ({w_longest(w, tok)} tokens)"))
        if name in llamacpp_peer.SOURCE_GGUF:
            from handler.config.quantization import gguf_source
            gguf = gguf_source(model_dir)
            if gguf is None:
                return Server(name, [], log, port, skipped=f"{model_dir} was not converted from a .gguf file "
                                                           "(llamacpp_gguf serves that file as paged_gguf serves its blocks)")
        else:
            gguf = llamacpp_peer.convert(where, model_dir, llamacpp_peer.outtype_of(name, dtype), log=log_fn)
        cmd, env, held = llamacpp_peer.server(where, gguf, port, kv_tokens, slots, w.prefill_tokens, dtype,
                                              THREADS, layout, llamacpp_peer.KV_QUANTIZED.get(name))
        return Server(name, cmd, log, port, api=LlamaCppCompletions(tok), env=env, health=llamacpp_peer.HEALTH,
                      startup_timeout=llamacpp_peer.STARTUP_TIMEOUT, held=held)
    except (subprocess.CalledProcessError, OSError, ValueError) as e:
        return Server(name, [], log, port, prep_error=f"preparing its model failed: {e}")


def w_longest(w: Workload, tok) -> int:
    """The longest prompt + its max_new_tokens over the workload's request list, in tokens."""
    return max(len(tok(b["inputs"])["input_ids"]) + b["parameters"]["max_new_tokens"] for b in w.draw(tok))


# ------------------------------------------------------------------ one workload
def ideal_block(w: Workload, bodies: list[dict], produced: list[int] | None = None) -> dict:
    """The ideal speedup of iteration-level over dynamic batching for this request list; for a
    workload that honours EOS (chat), from the output lengths the model `produced`."""
    if produced:
        return {"batch_width": w.batch_width, "from_draws": ideal_speedup(produced, w.batch_width),
                "expected": ideal_speedup(produced, w.batch_width),
                "mean_output_tokens": sum(produced) / len(produced),
                "formula": "EOS honoured: E[max of B lengths] / E[len] over the output lengths the model "
                           "produced (the first complete run's records, in completion order)"}
    lengths = output_lengths(bodies)
    mix = collections.Counter()
    for m in w.max_new_tokens:
        for k in (range(w.eos_after[0], w.eos_after[1] + 1) if w.eos_after else [m]):
            mix[min(m, k)] += 1
    return {
        "batch_width": w.batch_width,
        "from_draws": ideal_speedup(lengths, w.batch_width),
        "expected": expected_ideal_speedup(list(mix), w.batch_width, list(mix.values())),
        "mean_output_tokens": sum(lengths) / len(lengths),
        "formula": "B * sum over complete consecutive batches of max(len) / sum(len) = E[max of B lengths] / E[len]: "
                   "decode steps of dynamic batching (a batch lasts as long as its longest member) "
                   "over perfect iteration-level batching at the same width B (a slot is refilled "
                   "the step it frees); prefill and per-step cost differences ignored",
    }


def curve_requests(w: Workload, clients: int) -> int:
    """Requests at one point of the load curve: the workload's own N at its own client count,
    else 4 per client (at least 16, at most N): every client sends a few requests, and the
    light points do not take as long as the heavy ones. Always a prefix of the same list."""
    if clients == w.concurrency:
        return w.requests
    return min(w.requests, max(16, 4 * clients))


def run_workload(w: Workload, names, model_dir: str, out_dir: str, reps: int, dtype: str | None,
                 startup_timeout: float, progress: bool, log=print, one_at_a_time: bool = False,
                 tp: int = 1, vllm_dir: str | None = None, clients: list[int] | None = None,
                 params: int | None = None, peak_gflops: float | None = None,
                 peer_dirs: dict | None = None, arms: dict | None = None, slo: Slo | None = None) -> dict:
    """All servers up at once (cheap models), or each started for its own run and stopped
    after it (one_at_a_time: large models that do not fit on the device together; always
    for the ALONE peers, which would take the cores from the others while idle).

    clients: a load curve: each server, once up, runs every client count in turn (the
    requests of curve_requests, a prefix of the same list) in each repetition; the headline
    entry is the workload's own client count (else the largest)."""
    from transformers import AutoTokenizer

    run_dir = os.path.join(out_dir, "runs", w.name)
    os.makedirs(run_dir, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    bodies = w.draw(tok)
    ptoks, drawn = prompt_tokens(tok, w, bodies)
    prompt_lens = [len(tok(b["inputs"])["input_ids"]) for b in bodies]
    kv = kv_cache_tokens(w, [drawn["max"]] if w.prompt_tokens else ptoks)
    servers = make_servers(names, w, model_dir, kv, run_dir, dtype, tp, vllm_dir, tok, peer_dirs, log, arms)
    for s in servers:
        if s.skipped:
            log(f"[{w.name}] {s.name} skipped: {s.skipped}")
    servers_run = [s for s in servers if not s.skipped]
    points = sorted(set(clients)) if clients else [w.concurrency]
    head = w.concurrency if w.concurrency in points else points[-1]
    # (records, duration, cpu seconds, prompt tokens of the completed requests) per (server, clients)
    runs: dict[tuple[str, int], list[tuple[list[Record], float, float | None, int]]] = {
        (s.name, c): [] for s in servers for c in points}
    warm = [dict(b, parameters=dict(b["parameters"], max_new_tokens=4)) for b in bodies[: min(8, len(bodies))]]

    def up(group):
        for s in group:
            s.start()
        for s in group:
            s.wait(startup_timeout)
            if s.error:
                log(f"[{w.name}] {s.name} failed to start: {s.error}")
            else:   # first-call costs (allocation, kernel selection) are not part of the run
                run_load(s.api.url(s.url), warm, min(4, len(warm)), progress=False, api=s.api)

    def measure(s, rep, c):
        if s.error:
            return
        if s.proc.poll() is not None:
            s.error = f"exited with code {s.proc.returncode}; log: {s.log_path}: {tail(s.log_path)}"
            return
        n = curve_requests(w, c)
        mine = bodies[:min(n, w.serial_requests)] if s.name in SERIAL and w.serial_requests else bodies[:n]
        with TreeCpu(s.proc.pid) as cpu:
            recs, dur = run_load(s.api.url(s.url), mine, c, progress=progress,
                                 desc=f"{w.name} rep {rep + 1}/{reps} {s.name} @{c}", api=s.api)
        ptok = sum(n for n, r in zip(prompt_lens, recs) if r.error is None) if len(recs) == len(mine) else 0
        runs[(s.name, c)].append((recs, dur, cpu.seconds, ptok))
        toks = sum(r.tokens for r in recs if r.error is None)
        log(f"[{w.name}] rep {rep + 1}/{reps} {s.name} @{c} clients: {len(recs) / dur if dur else 0:.2f} req/s, "
            f"{sum(r.error is not None for r in recs)} errors, {cpu.seconds:.1f} CPU-s in "
            f"{cpu.processes} processes ({1e3 * cpu.seconds / toks if toks else 0:.2f} per 1k output tokens)")

    try:
        log(f"[{w.name}] servers: {', '.join(s.name for s in servers_run)}; KV capacity {kv} tokens each; "
            f"dtype {dtype or 'the servers default'}; clients {points}")
        if not one_at_a_time:
            up([s for s in servers_run if s.name not in ALONE])
        for rep in range(reps):   # the order rotates each repetition
            k = rep % len(servers_run) if servers_run else 0
            for s in servers_run[k:] + servers_run[:k]:
                alone = one_at_a_time or s.name in ALONE
                if alone:
                    s.error = None
                    up([s])
                for c in points:
                    measure(s, rep, c)
                if alone:
                    s.stop()
    finally:
        for s in servers_run:
            s.stop()

    def entry(s, c):
        rr = runs[(s.name, c)]
        if not rr:
            return {"error": s.error or "no run completed"}
        recs = [r for x in rr for r in x[0]]
        dur = sum(x[1] for x in rr)
        e = summarise(recs, c, dur, slo)
        e["clients"] = c
        e["requests_per_s_reps"] = [len([r for r in x[0] if r.error is None]) / x[1] for x in rr]
        e["finish_reasons"] = dict(collections.Counter(r.finish_reason for r in recs if r.error is None))
        e.update(cpu_figures([x[2] for x in rr], e["output_tokens"]))
        e["prompt_tokens"] = sum(x[3] for x in rr)
        e["prompt_tokens_per_s"] = e["prompt_tokens"] / dur if dur > 0 else None
        if params:
            e.update(peak.achieved(params, e["prompt_tokens"], e["output_tokens"], dur, peak_gflops))
        return e

    entries, curve = {}, {}
    for s in servers:
        if s.skipped:
            entries[s.name] = {"skipped": s.skipped}
            continue
        e = entry(s, head)
        if s.held:
            e["started_with"] = s.held
        if s.error and "error" not in e:
            e["server_error"] = s.error
        with open(os.path.join(run_dir, f"{s.name}.records.json"), "w") as f:
            json.dump({str(c): [[r.to_dict() for r in x[0]] for x in runs[(s.name, c)]] for c in points}
                      if clients else [[r.to_dict() for r in x[0]] for x in runs[(s.name, head)]], f)
        entries[s.name] = e
        if clients:
            curve[s.name] = [curve_point(entry(s, c)) for c in points]
    produced = None
    if w.chat:   # output lengths are the model's: take them from a run that answered every request
        produced = next(([r.tokens for r in x[0]] for s in servers_run for x in runs[(s.name, head)]
                         if len(x[0]) == len(bodies) and all(r.error is None for r in x[0])), None)
    add_ratios(entries, ideal := ideal_block(w, bodies, produced))
    out = {
        "strategies": {k: v for k, v in entries.items()
                       if k in STRATEGIES or k in QUANTIZED or k in KV_QUANTIZED or k in (arms or {})},
        "peers": {k: v for k, v in entries.items() if k in PEERS},
        "workload": dict(w.to_dict(), prompt_tokens=ptoks, prompt_tokens_drawn=drawn, kv_cache_tokens=kv,
                         block_size=BLOCK, repetitions=reps, dtype=dtype, ideal=ideal),
    }
    if clients:
        out["curve"] = curve
        out["workload"]["curve_clients"] = points
        out["workload"]["curve_requests"] = {c: curve_requests(w, c) for c in points}
    return out


CURVE_KEYS = ("clients", "completed", "errors", "requests_per_s", "output_tokens_per_s", "ttft_p50", "ttft_p90",
              "tpot_p50", "tpot_p90", "cpu_s_per_1k_output_tokens", "gflops", "pct_of_peak", "goodput_per_s")


def curve_point(e: dict) -> dict:
    """The load curve's figures of one (server, client count) entry."""
    if "requests_per_s" not in e:
        return {"error": e.get("error", "no run completed")}
    return {k: e.get(k) for k in CURVE_KEYS}


def cpu_figures(cpu_s: list[float], output_tokens: int) -> dict:
    """CPU seconds of the server's process tree over the measured repetitions, and per
    1,000 output tokens (all repetitions pooled, as requests_per_s)."""
    total = sum(cpu_s)
    return {"cpu_s_reps": cpu_s, "cpu_s": total,
            "cpu_s_per_1k_output_tokens": 1e3 * total / output_tokens if output_tokens else None}


def add_ratios(entries: dict, ideal: dict) -> None:
    """Each entry's requests/s over dynamic's and each peer's; its share of the ideal speedup."""
    def rps(name):
        e = entries.get(name) or {}
        return e.get("requests_per_s")
    for name, e in entries.items():
        if e.get("requests_per_s") is None:
            continue
        for ref in ("dynamic",) + PEERS:
            e[f"vs_{ref}"] = e["requests_per_s"] / rps(ref) if rps(ref) else None
        e["share_of_ideal"] = e["vs_dynamic"] / ideal["from_draws"] if e["vs_dynamic"] else None


# ------------------------------------------------------------------ whole comparison
def machine_info() -> dict:
    import torch
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def default_names() -> list[str]:
    """Every server; vLLM's CPU build only on a machine without CUDA (it is a CPU peer).
    When it is not installed it stays in the list and is reported as skipped, with why."""
    import torch

    return [n for n in ALL if not (n == vllm_cpu.NAME and torch.cuda.is_available())]


def compare(preset: str | Preset = "cpu", out_dir: str = "bench-out", only=None, workloads=None,
            reps: int | None = None, model_dir: str | None = None, overrides: dict | None = None,
            startup_timeout: float = 180.0, progress: bool = True, log=print,
            one_at_a_time: bool | None = None, tensor_parallel_degree: int = 1,
            dtype: str | None = None, vllm_dir: str | None = None, clients: list[int] | None = None,
            peer_dirs: dict | None = None, measure_peak: bool = True, arms: list[Arm] | None = None,
            slo: Slo | None = None) -> dict:
    """Run the comparison; write results.{json,md,png} into out_dir; return the results dict.

    only: names among none/dynamic/rolling/paged/hf_naive/transformers_cb/vllm_cpu (default:
    default_names());
    dtype: fp32|bf16 for every server (default: the preset's, else fp32 on CPU, bf16 on CUDA);
    vllm_dir: the vLLM CPU peer's venv (default: vllm_cpu.peer_dir());
    peer_dirs: {"openvino": dir, "llamacpp": dir} (default: each module's peer_dir()), and
    "llamacpp_kv": unified (default) | split, llama-server's KV layout (llamacpp_peer.server);
    clients: client counts of a load curve (each server runs them all, in every repetition);
    measure_peak: time the machine's fp32 FMA peak (peak.py) before the servers, for the
    GFLOP/s column's % of peak;
    workloads: names within the preset (default: all); overrides: Workload fields applied
    to every workload (e.g. {"requests": 20}); one_at_a_time: run servers one by one
    (default: the preset's choice; the gpu preset's 7B servers cannot share one GPU);
    tensor_parallel_degree: our strategies run with that many ranks (the peers with one);
    arms: more cells of our server (Arm), run after `only`'s, interleaved with them;
    slo: a per-request objective: each entry gets goodput_per_s (requests meeting it per second);
    default: TPOT within the first arm's option.target_tpot_ms, if one sets it."""
    from dataclasses import replace

    import torch

    p = PRESETS[preset] if isinstance(preset, str) else preset
    arms = list(arms or [])
    names = list(default_names() if only is None else only) + [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"cells named twice: {', '.join(sorted(n for n in set(names) if names.count(n) > 1))}")
    if slo is None:
        target = next((a.property("option.target_tpot_ms") for a in arms if a.property("option.target_tpot_ms")), None)
        slo = Slo(tpot_s=float(target) / 1e3) if target else None
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed: {', '.join(DTYPES)}")
    dtype = dtype or p.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    ws = [replace(w, **(overrides or {})) for w in p.workloads if not workloads or w.name in workloads]
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()
    if clients is not None and (not clients or min(clients) < 1):
        raise ValueError(f"clients={clients!r}: client counts must be integers >= 1")
    model = prepare_model(p, out_dir, model_dir, dtype)
    machine = machine_info()
    try:
        params = peak.count_params(model)
    except (OSError, ValueError):
        params = None
    ceiling = peak.measure(THREADS) if measure_peak else None
    if ceiling:
        log(f"fp32 FMA peak on {THREADS} threads: C loop {_f((ceiling['c_fma'] or {}).get('gflops'), 1)} GFLOP/s, "
            f"torch.mm {_f((ceiling['torch_mm'] or {}).get('gflops'), 1)} GFLOP/s")
    per = {}
    for w in ws:
        per[w.name] = run_workload(w, names, model, out_dir, reps or p.repetitions, dtype,
                                   startup_timeout, progress, log,
                                   p.one_at_a_time if one_at_a_time is None else one_at_a_time,
                                   tensor_parallel_degree, vllm_dir, clients, params,
                                   (ceiling or {}).get("peak_gflops"), peer_dirs, {a.name: a for a in arms}, slo)
    first = per[ws[0].name]
    results = {**first, "machine": machine, "preset": p.name, "model_dir": model, "dtype": dtype,
               "parameters": params, "peak": ceiling, "slo": slo.describe() if slo else None,
               "arms": {a.name: {"strategy": a.strategy, "checkout": a.root, "properties": dict(a.extra)}
                        for a in arms},
               "model_saved_dtype": saved_dtype(model),
               "tensor_parallel_degree": tensor_parallel_degree,
               "elapsed_s": time.monotonic() - t0, "workloads": per}
    write_results(results, out_dir)
    log(f"wrote {out_dir}/results.json, results.md, results.png in {results['elapsed_s']:.0f} s")
    return results


def saved_dtype(model_dir: str) -> str | None:
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    return c.get("dtype") or c.get("torch_dtype")


# ------------------------------------------------------------------ reports
def _f(x, digits=2, scale=1.0):
    return "–" if x is None else f"{x * scale:.{digits}f}"


COLUMNS = [  # header, key, digits, scale
    ("req/s", "requests_per_s", 2, 1), ("goodput/s", "goodput_per_s", 2, 1),
    ("out tok/s", "output_tokens_per_s", 0, 1),
    ("LMI req/s", "lmi_requests_per_s", 2, 1), ("TTFT p50/p99 ms", ("ttft_p50", "ttft_p99"), 0, 1e3),
    ("TPOT p50/p99 ms", ("tpot_p50", "tpot_p99"), 1, 1e3),
    ("latency p50/p90/p99 s", ("latency_p50", "latency_p90", "latency_p99"), 2, 1),
    ("errors", "errors", 0, 1), ("CPU-s / 1k out tok", "cpu_s_per_1k_output_tokens", 2, 1),
    ("× dynamic", "vs_dynamic", 2, 1), ("× hf_naive", "vs_hf_naive", 2, 1),
    ("× transformers_cb", "vs_transformers_cb", 2, 1), ("× vllm_cpu", "vs_vllm_cpu", 2, 1),
    ("× openvino", "vs_openvino", 2, 1), ("× llamacpp", "vs_llamacpp", 2, 1),
    ("share of ideal", "share_of_ideal", 2, 1), ("GFLOP/s", "gflops", 1, 1), ("% of peak", "pct_of_peak", 0, 1),
]


def markdown(results: dict) -> str:
    m = results["machine"]
    out = [f"# Batching benchmark: preset `{results['preset']}`", "",
           f"Machine: {m['platform']}, {m['cpus']} CPUs, GPU {m['cuda'] or 'none'}, torch {m['torch']}, "
           f"transformers {m['transformers']}, {m['date']}. Whole run {results['elapsed_s']:.0f} s. "
           f"dtype {results.get('dtype') or 'the servers default'} for every server.", "",
           "req/s and out tok/s are wall clock (completed / duration, repetitions pooled); LMI req/s "
           "is clients / mean latency, as LMI's load client computes it. CPU-s / 1k out tok: user + "
           "system CPU seconds of the server's whole process tree over the measured runs, per 1,000 "
           "output tokens. × columns divide req/s. "
           "Share of ideal = (× dynamic) / the ideal speedup of perfect iteration-level batching.", ""]
    if results.get("slo"):
        out += [f"goodput/s: requests that met the objective ({results['slo']}; TTFT and TPOT as the client "
                "measured them) per wall-clock second.", ""]
    for name, arm in (results.get("arms") or {}).items():
        out += [f"Cell `{name}`: `{arm['strategy']}`"
                + (f" from the checkout {arm['checkout']}" if arm.get("checkout") else "")
                + "".join(f", `{k}={v}`" for k, v in arm["properties"].items()) + ".", ""]
    pk = results.get("peak")
    if results.get("parameters"):
        out += [f"GFLOP/s = 2 x {results['parameters']:,} parameters x (prompt + output tokens) / wall second "
                "(dense multiply-adds only; attention's score/value products left out). % of peak: of the "
                + (f"fp32 FMA peak measured before the servers on {pk['threads']} threads: C FMA loop "
                   f"{_f((pk['c_fma'] or {}).get('gflops'), 1)} GFLOP/s (the ceiling used), torch.mm "
                   f"{_f((pk['torch_mm'] or {}).get('gflops'), 1)} GFLOP/s (load average "
                   f"{', '.join(f'{x:.2f}' for x in pk['load_average'])})." if pk else "peak (not measured)."), ""]
    tp = results.get("tensor_parallel_degree", 1)
    if tp > 1:
        out += [f"Tensor parallel degree {tp} for our strategies (the peers run one process)"
                + ("." if m["cuda"] else ": on CPU the gloo ranks share the host's cores, so these "
                   "figures are a correctness run, not a speed comparison."), ""]
    for name, r in results["workloads"].items():
        w = r["workload"]
        ideal = w["ideal"]
        out += [f"## Workload `{name}`", "", w["note"] + ".", "",
                f"{w['requests']} requests, {w['concurrency']} clients, prompts of {w['prompt_tokens']} tokens"
                + (f" (unique; drawn {w['prompt_tokens_drawn']['min']}..{w['prompt_tokens_drawn']['max']})"
                   if w.get("unique_prompts") and w.get("prompt_tokens_drawn") else "") + ", "
                f"max_new_tokens from {list(w['max_new_tokens'])}"
                + (f", EOS after K in {w['eos_after'][0]}..{w['eos_after'][1]}" if w["eos_after"] else "")
                + f", KV capacity {w['kv_cache_tokens']} tokens for every server, {w['repetitions']} "
                f"interleaved repetitions. Ideal speedup over dynamic at batch width {ideal['batch_width']}: "
                f"{ideal['from_draws']:.2f} from these draws ({ideal['expected']:.2f} expected).", "",
                "| server | " + " | ".join(c[0] for c in COLUMNS) + " |",
                "|---|" + "---:|" * len(COLUMNS)]
        for group in ("strategies", "peers"):
            for sname, e in r[group].items():
                label = sname if group == "strategies" else f"{sname} (peer)"
                if "skipped" in e:
                    out.append(f"| {label} | skipped: {e['skipped']} |" + " |" * (len(COLUMNS) - 1))
                    continue
                if "requests_per_s" not in e:
                    out.append(f"| {label} | failed: {e.get('error', '?')[:120]} |" + " |" * (len(COLUMNS) - 1))
                    continue
                cells = []
                for _, key, d, sc in COLUMNS:
                    keys = key if isinstance(key, tuple) else (key,)
                    cells.append(" / ".join(_f(e.get(k), d, sc) for k in keys))
                out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
        if r.get("curve"):
            out += curve_markdown(r)
    return "\n".join(out)


def curve_markdown(r: dict) -> list[str]:
    """One row per (server, client count): the load curve of one workload."""
    w = r["workload"]
    out = [f"### Load curve: clients {w['curve_clients']}", "",
           "Requests per point: " + ", ".join(f"{c} clients: {n}" for c, n in w["curve_requests"].items())
           + " (a prefix of the same list; every repetition runs every point on the same server start).", "",
           "| server | clients | req/s | goodput/s | out tok/s | TTFT p50/p90 ms | TPOT p50/p90 ms | "
           "CPU-s / 1k out tok | GFLOP/s | % of peak | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, pts in r["curve"].items():
        for pt in pts:
            if "error" in pt:
                out.append(f"| {name} | – | failed: {pt['error'][:100]} | | | | | | | | |")
                continue
            out.append(f"| {name} | {pt['clients']} | {_f(pt['requests_per_s'])} | {_f(pt.get('goodput_per_s'))} | "
                       f"{_f(pt['output_tokens_per_s'], 0)} | "
                       f"{_f(pt['ttft_p50'], 0, 1e3)} / {_f(pt['ttft_p90'], 0, 1e3)} | "
                       f"{_f(pt['tpot_p50'], 1, 1e3)} / {_f(pt['tpot_p90'], 1, 1e3)} | "
                       f"{_f(pt['cpu_s_per_1k_output_tokens'])} | {_f(pt['gflops'], 1)} | {_f(pt['pct_of_peak'], 0)} | "
                       f"{pt['errors']} |")
    return out + [""]


def chart(results: dict, path: str) -> None:
    # A bare Figure renders with Agg and leaves pyplot's backend alone (a notebook keeps inline).
    from matplotlib.figure import Figure

    wl = results["workloads"]
    fig = Figure(figsize=(6 * len(wl), 4.2))
    axes = fig.subplots(1, len(wl), squeeze=False)
    for ax, (name, r) in zip(axes[0], wl.items()):
        peers = {f"{k}*": v for k, v in r["peers"].items() if "skipped" not in v}
        entries = {**r["strategies"], **peers}
        labels = list(entries)
        vals = [entries[k].get("requests_per_s") or 0 for k in labels]
        bars = ax.bar(labels, vals, color=["#4C72B0"] * len(r["strategies"]) + ["#999999"] * len(peers))
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{name}: requests/s (wall clock{', ' + results['dtype'] if results.get('dtype') else ''})")
        ax.tick_params(axis="x", rotation=30)
    fig.text(0.01, 0.01, "* peer", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def curve_chart(results: dict, path: str) -> bool:
    """req/s, TTFT p50 and TPOT p50 against clients, one line per server, per workload with a
    curve; False when no workload has one."""
    from matplotlib.figure import Figure

    wl = {n: r for n, r in results["workloads"].items() if r.get("curve")}
    if not wl:
        return False
    fig = Figure(figsize=(15, 4.2 * len(wl)))
    axes = fig.subplots(len(wl), 3, squeeze=False)
    for row, (name, r) in zip(axes, wl.items()):
        for ax, (key, label, scale) in zip(row, (("requests_per_s", "requests/s", 1), ("ttft_p50", "TTFT p50 ms", 1e3),
                                                 ("tpot_p50", "TPOT p50 ms", 1e3))):
            for server, pts in r["curve"].items():
                ok = [p for p in pts if "error" not in p and p.get(key) is not None]
                if ok:
                    ax.plot([p["clients"] for p in ok], [p[key] * scale for p in ok], marker="o", label=server)
            ax.set_xscale("log")
            ax.set_xticks(r["workload"]["curve_clients"], [str(c) for c in r["workload"]["curve_clients"]])
            ax.set_xlabel("clients")
            ax.set_title(f"{name}: {label} ({results.get('dtype')})")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_results(results: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(results))
    chart(results, os.path.join(out_dir, "results.png"))
    curve_chart(results, os.path.join(out_dir, "curve.png"))
