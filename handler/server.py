"""`python -m handler serve`: validate the configuration, then run gunicorn (one worker process
holding the model and the engine; its HTTP requests are gevent greenlets, or gthread threads
with LMI_HTTP_WORKER=gthread: handler/http/worker.py)."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import sys
import threading
from dataclasses import replace

from handler.config.numerics import Numerics
from handler.config.sizing import running_width as _width  # sequences the strategy runs at once
from handler.config.switches import switch

log = logging.getLogger("lmi.server")
RANK_FAILURE_EXIT_S = 2.0     # /ping answers "unhealthy" this long before a broken TP server exits


def build_runner(cfg, on_rank_failure=None, arms=None):
    """ServingConfig -> a ModelRunner (loads the model; the slow part). With
    tensor_parallel_degree N > 1 this process becomes rank 0 and starts ranks 1..N-1
    (handler.model.distributed); `on_rank_failure(line)` is called if the rank group breaks.
    `arms` (handler.model.cpu.Arms): the CPU paths' A/B arms, for benchmarks (one rank only); a
    server passes none."""
    from handler.model.runner import ModelRunner

    from handler.model.gguf import hf_dir_for

    kwargs = dict(model_dir=hf_dir_for(cfg.model_dir, cfg.dtype, cfg.device), dtype=cfg.dtype, device=cfg.device,
                  block_size=cfg.block_size,
                  kv_cache_tokens=cfg.kv_cache_tokens, max_running=_width(cfg),
                  gpu_memory_utilization=cfg.gpu_memory_utilization,
                  max_model_len=cfg.max_model_len, trust_remote_code=cfg.trust_remote_code,
                  model_impl=cfg.model_impl, quantize=cfg.quantize, cpu_kernels=cfg.cpu_kernels,
                  kv_cache_dtype=getattr(cfg, "kv_cache_dtype", "auto"),
                  encoder_cache_mb=getattr(cfg, "encoder_cache_mb", 256.0),
                  numerics=dataclasses.asdict(Numerics.of(cfg)))
    if cfg.tensor_parallel_degree == 1:
        lora = getattr(cfg, "enable_lora", False)
        runner = ModelRunner(**kwargs, fuse=not lora, arms=arms)
        if lora:
            enable_lora(cfg, runner)
        runner.prepack_cpu(keep_weights=lora)
        if not cfg.enforce_eager:
            runner.capture_cuda_graphs(_width(cfg))
        spec = getattr(cfg, "speculative", None)
        if spec is not None and spec.method == "draft_model":
            runner.draft_proposer = build_draft(cfg, runner, kwargs)
        return runner
    if arms is not None:
        raise ValueError("A/B arms are for one-rank runners (benchmarks); tensor_parallel_degree > 1 takes none")
    from handler.model.distributed import RankGroup, check_supported
    from handler.model.runner import ModelLoadError, pick_device
    group = RankGroup(cfg.tensor_parallel_degree, pick_device(cfg.device).type, kwargs,
                      on_rank_failure or (lambda line: log.error("error: %s", line))).spawn()
    try:
        check_supported(cfg.model_dir, cfg.tensor_parallel_degree, cfg.trust_remote_code)
    except Exception:
        group.stop(graceful=False)
        raise
    try:
        runner = ModelRunner(**kwargs, ranks=group.join())
    except Exception:
        # Rank 0 usually fails because another rank did (a collective sees it go away);
        # that rank's own reason is the one to report.
        why = group.wait_failure(3.0)
        group.stop(graceful=False)
        if why:
            raise ModelLoadError(why) from None
        raise
    runner.ranks.start_heartbeat()
    runner.rank_group = group
    return runner


def build_draft(cfg, runner, kwargs):
    """The draft model of speculative decoding (handler/model/spec_draft.py): loaded like the target,
    its own KV pool of as many tokens as the target's; a tokenizer that differs is a one-line error."""
    from handler.model.gguf import hf_dir_for
    from handler.model.runner import ModelLoadError, ModelRunner
    from handler.model.spec_draft import DraftProposer, DraftTokenizerMismatch, check_same_tokenizer

    path = cfg.speculative.draft_model
    try:
        draft = ModelRunner(**{**kwargs, "model_dir": hf_dir_for(path, cfg.dtype, cfg.device),
                               "kv_cache_tokens": runner.kv.tokens, "max_model_len": runner.max_model_len,
                               "quantize": None})
    except ModelLoadError as e:
        raise ModelLoadError(f"option.speculative_draft_model={path}: {e}") from None
    try:
        check_same_tokenizer(runner.tokenizer, draft.tokenizer)
    except DraftTokenizerMismatch as e:
        raise ModelLoadError(f"option.speculative_draft_model={path}: its tokenizer is not the model's ({e}); "
                             "allowed: a draft model with the same tokenizer") from None
    draft.prepack_cpu()
    log.info("speculative decoding: draft model %s proposes %d tokens a step", path, cfg.speculative.k)
    return DraftProposer(draft)


def enable_lora(cfg, runner) -> None:
    """Wrap the model for LoRA and read MODEL_DIR/adapters/<name>/ (LMI's layout); a bad
    adapter stops the start-up with its one-line reason."""
    from handler.model.lora import AdapterError
    from handler.model.runner import ModelLoadError
    manager = runner.enable_lora(cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras)
    try:
        names = manager.register_dir(cfg.model_dir)
    except AdapterError as e:
        raise ModelLoadError(str(e)) from None
    log.info("LoRA on: %d adapters from %s/adapters (max_loras=%d, max_lora_rank=%d, max_cpu_loras=%d)",
             len(names), cfg.model_dir, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras)


def engine_for(cfg, runner, on_step=None, waker=None):
    """A started Engine with cfg's strategy over an already loaded runner (on_step, waker:
    Engine's)."""
    from handler.engine.loop import Engine
    from handler.engine.scheduler import SchedulerPolicy

    width = _width(cfg)
    vision = getattr(runner, "vision", None)
    if cfg.batch_invariant and vision is not None and vision.family.bidirectional:
        from handler.model.runner import ModelLoadError
        raise ModelLoadError(f"option.batch_invariant=true feeds one token a forward, and a {vision.family.name} "
                             "model's image tokens attend to each other both ways at prefill: not supported together")
    runner.batch_invariant = cfg.batch_invariant
    if getattr(cfg, "chat_template", None) and runner.tokenizer is not None:
        runner.tokenizer.chat_template = cfg.chat_template     # option.chat_template replaces the tokenizer's
    policy = SchedulerPolicy(cfg.strategy, max_batch_size=width,
                             max_batch_delay_s=cfg.max_batch_delay_ms / 1000.0,
                             prefill_token_budget=cfg.max_rolling_batch_prefill_tokens,
                             max_waiting=cfg.job_queue_size, max_model_len=runner.max_model_len,
                             eos_token_ids=runner.eos_token_ids,
                             max_loras=cfg.max_loras if getattr(cfg, "enable_lora", False) else 0,
                             spec=getattr(cfg, "speculative", None),
                             target_tpot_s=cfg.target_tpot_ms / 1000.0 if cfg.target_tpot_ms else None,
                             scheduling_policy=cfg.scheduling_policy,
                             aging_s=cfg.scheduling_aging_ms / 1000.0)
    # What is loaded by now lives as long as the server: out of the collector's generations, so a
    # full collection stops walking the model's ~400k objects (1-2% of a CPU decode step, measured).
    gc.collect()
    gc.freeze()
    return Engine(runner, policy, runner.block_size, cfg.enable_prefix_caching,
                  step_timeout_s=getattr(cfg, "engine_step_timeout_s", None), on_step=on_step,
                  waker=waker, proposer=runner.draft_proposer).start()


def model_task(cfg) -> str:
    """cfg.task, detected again from the model directory when option.task was not given (an s3:// or hub
    model's directory exists only after the configuration is read)."""
    from handler.config.task import detect_task
    if "option.task" in cfg.properties or os.environ.get("HF_TASK") or not cfg.model_dir:
        return cfg.task
    return detect_task(cfg.model_dir)


def build_pooling_engine(cfg, task: str, waker=None):
    """An embedding / classification / cross-encoder model (option.task) on the pooling engine: batches
    of up to max(batch_size, option.max_rolling_batch_size) inputs and
    option.max_rolling_batch_prefill_tokens tokens, gathered for up to max_batch_delay ms when the file
    sets it (else 0: whatever waits while a forward runs joins the next one)."""
    from handler.engine.pooling import PoolingEngine, PoolingPolicy
    from handler.model.gguf import hf_dir_for
    from handler.model.pooling import PoolingRunner

    if cfg.tensor_parallel_degree > 1:
        from handler.model.runner import ModelLoadError
        raise ModelLoadError(f"option.task={task}: pooling models run on one device "
                             "(option.tensor_parallel_degree=1)")
    runner = PoolingRunner(hf_dir_for(cfg.model_dir, cfg.dtype, cfg.device), task, dtype=cfg.dtype,
                           device=cfg.device, max_model_len=cfg.max_model_len, quantize=cfg.quantize,
                           trust_remote_code=cfg.trust_remote_code, normalize=cfg.normalize)
    delay_ms = cfg.max_batch_delay_ms if "max_batch_delay" in cfg.properties else 0
    policy = PoolingPolicy(max_batch_tokens=max(cfg.max_rolling_batch_prefill_tokens, runner.max_model_len),
                           max_batch_size=_width(cfg), max_batch_delay_s=delay_ms / 1000.0,
                           max_waiting=cfg.job_queue_size)
    gc.collect()
    gc.freeze()
    return PoolingEngine(runner, policy, waker).start()


def build_engine(cfg, on_rank_failure=None, on_step=None, waker=None, arms=None):
    """ServingConfig -> a started Engine (loads the model; `arms`: build_runner's); a pooling model's
    PoolingEngine."""
    task = model_task(cfg)
    if task != "generate":
        return build_pooling_engine(cfg, task, waker)
    return engine_for(cfg, build_runner(cfg, on_rank_failure, arms), on_step, waker)


def check_model_readable(model_dir: str) -> None:
    """Cheap checks in the master process (no torch): config.json parses, safetensors headers read."""
    from safetensors import safe_open

    from handler.config import ConfigError
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {model_dir}: config.json is unreadable ({e})") from None
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(model_dir, name), framework="numpy") as f:
                    f.keys()
            except Exception as e:
                raise ConfigError(f"model {model_dir}: {name} is not a readable safetensors file "
                                  f"({type(e).__name__}: {e})") from None


def create_state(cfg, load_async: bool = True, hub: bool = False, custom=None, adapter_custom=None):
    """The app's state; the engine is built in a background thread so /ping answers meanwhile.
    hub: requests are greenlets of this thread's gevent hub (the gevent worker), which the engine
    wakes once per step (handler/http/hub.py)."""
    from handler.http.app import ServerState

    state = ServerState(cfg)
    state.custom = custom
    state.adapter_custom = adapter_custom or {}
    if hub:
        from handler.http.hub import HubWaker
        state.waker = HubWaker()

    def rank_failed(line: str) -> None:
        # A broken rank group cannot serve again: unhealthy now, exit non-zero shortly after
        # (gunicorn's WORKER_BOOT_ERROR stops the master), never hang.
        if state.error is not None:
            return
        state.error = line
        if state.engine is not None:
            state.engine.healthy = False
        log.error("error: %s", line)
        threading.Timer(RANK_FAILURE_EXIT_S, os._exit, (3,)).start()

    def load():
        try:
            state.engine = build_engine(cfg, rank_failed, on_step=state.metrics.observe_step,
                                        waker=state.waker)
            log.info("ready: strategy=%s model=%s", cfg.strategy, cfg.model_dir)
        except Exception as e:
            if state.error is None:   # else a rank's failure, already reported (one line)
                state.error = str(e)
                log.error("error: %s", e)
            if load_async:
                os._exit(3)   # gunicorn's WORKER_BOOT_ERROR: the master stops with a non-zero code

    if load_async:
        threading.Thread(target=load, name="lmi-load", daemon=True).start()
    else:
        load()
    return state


WORKER_CLASSES = {"gevent": "handler.http.worker.GeventWorker", "gthread": "handler.http.worker.Worker"}


def http_worker(env) -> str:
    """LMI_HTTP_WORKER: gevent (default) or gthread; anything else is a ConfigError."""
    from handler.config import ConfigError
    kind = switch("LMI_HTTP_WORKER", env) or "gevent"
    if kind not in WORKER_CLASSES:
        raise ConfigError(f"LMI_HTTP_WORKER: {kind!r} is not one of {', '.join(WORKER_CLASSES)}")
    return kind


def _gunicorn_app(cfg, host: str, port: int, threads: int, worker: str = "gevent",
                  connections: int = 1000, custom=None, adapter_custom=None):
    from gunicorn.app.base import BaseApplication

    from handler.http import worker as http_worker_mod
    from handler.http.app import create_app

    # The gevent worker's slow-client limits; the worker forks after this and inherits them.
    http_worker_mod.LIMITS = http_worker_mod.HttpLimits(
        cfg.http_header_timeout_s, cfg.http_body_timeout_s, cfg.http_max_connections)
    if worker == "gevent":
        connections = max(connections, http_worker_mod.LIMITS.pool)

    class App(BaseApplication):
        def load_config(self):
            settings = {
                "bind": f"{host}:{port}", "workers": 1, "worker_class": WORKER_CLASSES[worker],
                "threads": threads, "worker_connections": connections, "timeout": 120, "keepalive": 75,
                "graceful_timeout": max(1, math.ceil(cfg.graceful_timeout_s)),
                "errorlog": "-", "loglevel": "info", "accesslog": None,
                # Several servers may share a host (tests, benchmarks): no shared control socket.
                "control_socket_disable": True,
            }
            for k, v in settings.items():
                self.cfg.set(k, v)

        def load(self):
            from handler.http.metrics import configure_logging

            configure_logging(cfg.log_format)      # gunicorn's own log handlers exist by now
            return create_app(create_state(cfg, hub=worker == "gevent", custom=custom,
                                           adapter_custom=adapter_custom))

    return App()


def main(argv: list[str]) -> int:
    from handler.config import ConfigError, check_tp_heads, load_config
    from handler.config.compat import describe as describe_line

    p = argparse.ArgumentParser(prog="python -m handler serve", description="Serve a causal LM "
                                "behind SageMaker's HTTP contract (/ping, /invocations).")
    p.add_argument("--properties", help="serving.properties file (default: MODEL_DIR/serving.properties)")
    p.add_argument("--model-dir", help="model directory (default /opt/ml/model)")
    p.add_argument("--port", type=int, help="port (default $SAGEMAKER_BIND_TO_PORT or 8080)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--threads", type=int, help="HTTP threads with LMI_HTTP_WORKER=gthread (default: enough for "
                   "the queue; gevent: option.http_max_connections bounds connections)")
    a = p.parse_args(argv)
    from handler.http.metrics import configure_logging

    configure_logging("text", switch("LMI_LOG_LEVEL"))
    try:
        cfg = load_config(a.properties, a.model_dir, os.environ)
        if cfg.device != "cuda":    # once, before anything is loaded: tcmalloc (handler/model/cpu.py)
            from handler.model.cpu import preload_env
            env = preload_env(os.environ, cpu_kernels=cfg.cpu_kernels)
            if env is not None:
                os.execve(sys.executable, [sys.executable, "-m", "handler", "serve", *argv], env)
        configure_logging(cfg.log_format)
        if cfg.model_id.startswith("s3://"):
            from handler.model.s3 import S3ModelError, resolve_model_dir
            try:
                cfg = replace(cfg, model_dir=resolve_model_dir(cfg.model_id))
            except S3ModelError as e:
                raise ConfigError(str(e)) from None
            check_tp_heads(cfg.model_dir, cfg.tensor_parallel_degree, cfg.model_id)
        elif not cfg.model_dir:     # a hub model id (handler/config/properties.py is_hub_id)
            from handler.model.hf_hub import HubModelError, resolve_model_dir as hub_model_dir
            try:
                cfg = replace(cfg, model_dir=hub_model_dir(cfg.model_id, cfg.revision))
            except HubModelError as e:
                raise ConfigError(str(e)) from None
            check_tp_heads(cfg.model_dir, cfg.tensor_parallel_degree, cfg.model_id)
        # model.py sits in the model directory (a .gguf file's: the file's), not in its conversion
        code_dir = os.path.dirname(cfg.model_dir) if os.path.isfile(cfg.model_dir) else cfg.model_dir
        from handler.model.gguf import GGUFError, hf_dir_for
        try:    # a GGUF model converted once, here: a bad file is one line and exit 2, not a worker boot error
            cfg = replace(cfg, model_dir=hf_dir_for(cfg.model_dir, cfg.dtype, cfg.device))
        except GGUFError as e:
            raise ConfigError(str(e)) from None
        check_model_readable(cfg.model_dir)
        worker = http_worker(os.environ)
        from handler.http.custom import CustomCodeError, load as load_custom, load_adapters, model_properties
        try:    # model.py: imported once here (the worker forks after), a bad one is one line
            custom = load_custom(code_dir, cfg.entry_point, "option.entryPoint" in cfg.properties,
                                 model_properties(cfg.properties))
            adapter_custom = load_adapters(code_dir, model_properties(cfg.properties)) if cfg.enable_lora else {}
        except CustomCodeError as e:
            raise ConfigError(str(e)) from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in cfg.warnings:
        log.warning("%s", w)
    log.info("%s", describe_line(cfg.lmi_compat))
    for code in ([custom] if custom is not None else []) + list(adapter_custom.values()):
        log.info("%s", code.describe())
    port = a.port or cfg.port
    width = max(cfg.batch_size, cfg.max_rolling_batch_size)
    threads = a.threads or min(1024, max(64, width + cfg.job_queue_size // 4 + 8))
    # gthread: gunicorn's default, or more when --threads asks; gevent: option.http_max_connections
    # (+ the pool's headroom, in _gunicorn_app)
    connections = max(1000, threads) if worker == "gthread" else cfg.http_max_connections
    log.info("strategy=%s model=%s port=%d http=%s (%s)", cfg.strategy, cfg.model_dir, port, worker,
             f"{threads} threads" if worker == "gthread" else
             f"up to {connections} connections, headers within {cfg.http_header_timeout_s:g} s, "
             f"bodies within {cfg.http_body_timeout_s:g} s")
    _gunicorn_app(cfg, a.host, port, threads, worker, connections, custom, adapter_custom).run()
    return 0
