"""serving.properties + environment -> ServingConfig: validation, strategy, env, model location, CLI."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from handler.config import (ENV_ALIASES, IGNORED_KEYS, TYPED_KEYS, ConfigError, ServingConfig,
                            config_to_dict, load_config, main)
from tests.support.properties import REF_CONTINUOUS, REF_DYNAMIC, REF_PAGED

REPO = pathlib.Path(__file__).resolve().parents[2]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable

LMI_LINES = ("is not an LMI version line; allowed: current, 0.31, 0.26 (or any 0.N version: up to 0.26 behaves "
             "as 0.26, 0.27-0.31 as 0.31, 0.32 and later as current)")
REFERENCES = [("dynamic", REF_DYNAMIC), ("rolling", REF_CONTINUOUS), ("paged", REF_PAGED)]


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return str(d)


@pytest.fixture
def load(tmp_path, model_dir):
    """load(text, env={}, **kw): write text to a properties file and resolve it."""
    def _load(text: str | None, env: dict | None = None, **kw) -> ServingConfig:
        path = None
        if text is not None:
            path = tmp_path / "serving.properties"
            path.write_text(text)
        kw.setdefault("model_dir", model_dir)
        kw.setdefault("gpu_count", 0)
        return load_config(str(path) if path else None, env=env or {}, **kw)
    return _load


def error_of(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---- example files and the reference blocks ------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("none", dict(strategy="none", engine="Python", batch_size=1, rolling_batch="disable", paged_attention=False)),
    ("dynamic", dict(strategy="dynamic", engine="Python", batch_size=64, max_batch_delay_ms=1000)),
    ("rolling", dict(strategy="rolling", engine="MPI", rolling_batch="auto", paged_attention=False,
                     max_rolling_batch_size=64, max_rolling_batch_prefill_tokens=16080)),
    ("paged", dict(strategy="paged", engine="MPI", rolling_batch="auto", paged_attention=True,
                   max_rolling_batch_size=64, max_rolling_batch_prefill_tokens=16080)),
])
def test_example_files(name, expected, model_dir):
    path = REPO / "serving.properties.d" / f"{name}.properties"
    cfg = load_config(str(path), model_dir=model_dir, env={}, gpu_count=0)
    for field, value in expected.items():
        assert getattr(cfg, field) == value, field
    assert cfg.model_dir == model_dir and cfg.model_id == model_dir
    assert cfg.tensor_parallel_degree == 1
    assert cfg.warnings == ()


@pytest.mark.parametrize("strategy, text", REFERENCES)
def test_reference_blocks_run_two_cpu_ranks_here(strategy, text, load):
    cfg = load(text, gpu_count=0)
    assert (cfg.strategy, cfg.tensor_parallel_degree, cfg.device) == (strategy, 2, "auto")


@pytest.mark.parametrize("strategy, text", REFERENCES)
def test_reference_blocks_with_one_gpu_need_two(strategy, text, load):
    msg = error_of(load, text, gpu_count=1)
    assert "option.tensor_parallel_degree=2 needs 2 GPUs (one rank per GPU), 1 visible" in msg


@pytest.mark.parametrize("strategy, text", REFERENCES)
def test_reference_blocks_with_degree_1_resolve(strategy, text, load):
    cfg = load(text.replace("tensor_parallel_degree=2", "tensor_parallel_degree=1"))
    assert cfg.strategy == strategy
    assert cfg.warnings == ()


# ---- typed keys: good and bad values -------------------------------------------------
GOOD = [
    ("engine", "python", "engine", "Python"),
    ("engine", "MPI", "engine", "MPI"),
    ("engine", "deepspeed", "engine", "DeepSpeed"),
    ("batch_size", "8", "batch_size", 8),
    ("max_batch_delay", "0", "max_batch_delay_ms", 0),
    ("max_batch_delay", " 250 ", "max_batch_delay_ms", 250),
    ("job_queue_size", "5", "job_queue_size", 5),
    ("max_idle_time", "30", "max_idle_time_s", 30),
    ("request_timeout", "1.5", "request_timeout_s", 1.5),
    ("request_timeout", "1e3", "request_timeout_s", 1000.0),
    ("option.rolling_batch", "LMI-DIST", "rolling_batch", "lmi-dist"),
    ("option.rolling_batch", "disable", "rolling_batch", "disable"),
    ("option.paged_attention", "FALSE", "paged_attention", False),
    ("option.max_rolling_batch_size", "128", "max_rolling_batch_size", 128),
    ("option.max_rolling_batch_prefill_tokens", "1", "max_rolling_batch_prefill_tokens", 1),
    ("option.block_size", "1", "block_size", 1),
    ("option.block_size", "256", "block_size", 256),
    ("option.enable_prefix_caching", "True", "enable_prefix_caching", True),
    ("option.kv_cache_tokens", "16", "kv_cache_tokens", 16),
    ("option.gpu_memory_utilization", "1", "gpu_memory_utilization", 1.0),
    ("option.gpu_memory_utilization", "0.5", "gpu_memory_utilization", 0.5),
    ("option.max_model_len", "2048", "max_model_len", 2048),
    ("option.dtype", "bfloat16", "dtype", "bf16"),
    ("option.dtype", "float32", "dtype", "fp32"),
    ("option.dtype", "FP16", "dtype", "fp16"),
    ("option.dtype", "auto", "dtype", "auto"),
    ("option.device", "CPU", "device", "cpu"),
    ("option.tensor_parallel_degree", "1", "tensor_parallel_degree", 1),
    ("option.tensor_parallel_degree", "max", "tensor_parallel_degree", 1),
    ("option.trust_remote_code", "true", "trust_remote_code", True),
    ("option.entryPoint", "djl_python.huggingface", "entry_point", "djl_python.huggingface"),
    ("option.output_formatter", "jsonlines", "output_formatter", "jsonlines"),
    ("option.output_formatter", "SSE", "output_formatter", "sse"),
    ("graceful_timeout", "25", "graceful_timeout_s", 25.0),
    ("option.max_payload_mb", "0.5", "max_payload_mb", 0.5),
    ("option.batch_invariant", "TRUE", "batch_invariant", True),
    ("option.enforce_eager", "True", "enforce_eager", True),
    ("option.allow_remote_images", "true", "allow_remote_images", True),
    ("option.max_image_mb", "0.5", "max_image_mb", 0.5),
    ("option.max_image_pixels", "1000000", "max_image_pixels", 1_000_000),
    ("option.max_images_per_request", "0", "max_images_per_request", 0),
    ("option.image_fetch_timeout", "2.5", "image_fetch_timeout_s", 2.5),
    ("option.encoder_cache_mb", "0", "encoder_cache_mb", 0.0),
]


@pytest.mark.parametrize("key, value, field, expected", GOOD)
def test_good_values(key, value, field, expected, load):
    cfg = load(f"{key}={value}\n")
    assert getattr(cfg, field) == expected
    assert not [w for w in cfg.warnings if "unknown" in w]


BAD = [
    ("engine", "TensorRT", "is not supported; allowed: Python, MPI, DeepSpeed, FasterTransformer"),
    ("batch_size", "0", "is not a positive integer"),
    ("batch_size", "abc", "is not a positive integer"),
    ("batch_size", "1.5", "is not a positive integer"),
    ("batch_size", "1_000", "is not a positive integer"),
    ("batch_size", "٣", "is not a positive integer"),
    ("max_batch_delay", "-1", "is not an integer >= 0"),
    ("job_queue_size", "0", "is not a positive integer"),
    ("max_idle_time", "x", "is not a positive integer"),
    ("request_timeout", "0", "is not a positive number of seconds"),
    ("request_timeout", "nan", "is not a positive number of seconds"),
    ("request_timeout", "inf", "is not a positive number of seconds"),
    ("option.rolling_batch", "trtllm", "is not supported; allowed: auto, scheduler, lmi-dist, vllm, disable"),
    ("option.rolling_batch", "tnx", "is not supported; allowed: auto, scheduler, lmi-dist, vllm, disable"),
    ("option.rolling_batch", "deepspeed", "is not supported; allowed: auto, scheduler, lmi-dist, vllm, disable"),
    ("option.paged_attention", "yes", "is not a boolean; allowed: true, false"),
    ("option.max_rolling_batch_size", "abc", "is not a positive integer"),
    ("option.max_rolling_batch_prefill_tokens", "0", "is not a positive integer"),
    ("option.block_size", "12", "is not a power of two from 1 to 256"),
    ("option.block_size", "512", "is not a power of two from 1 to 256"),
    ("option.block_size", "0", "is not a power of two from 1 to 256"),
    ("option.enable_prefix_caching", "1", "is not a boolean; allowed: true, false"),
    ("option.kv_cache_tokens", "-5", "is not a positive integer"),
    ("option.gpu_memory_utilization", "0", "is not a number in (0, 1]"),
    ("option.gpu_memory_utilization", "1.01", "is not a number in (0, 1]"),
    ("option.gpu_memory_utilization", "90%", "is not a number in (0, 1]"),
    ("option.max_model_len", "0", "is not a positive integer"),
    ("option.dtype", "int8", "is not supported; allowed: fp32, fp16, bf16, auto"),
    ("option.device", "tpu", "is not supported; allowed: auto, cpu, cuda"),
    ("option.tensor_parallel_degree", "two", "is not a positive integer or max"),
    ("option.tensor_parallel_degree", "0", "is not a positive integer or max"),
    ("option.trust_remote_code", "on", "is not a boolean; allowed: true, false"),
    ("option.entryPoint", "", "is empty"),
    ("option.output_formatter", "xml", "is not supported; allowed: json, jsonlines, sse, json_chat, jsonlines_chat, sse_chat"),
    ("option.log_format", "yaml", "is not supported; allowed: text, json"),
    ("option.enable_streaming", "maybe", "is not a boolean; allowed: true, false"),
    ("option.tgi_compat", "yes", "is not a boolean; allowed: true, false"),
    ("option.predict_timeout", "-1", "is not a positive number of seconds"),
    ("option.max_num_batched_tokens", "0", "is not a positive integer"),
    ("option.quantize", "awq4", "is not supported; allowed: int8, int8_weight_only, awq, gptq, gguf, fp8, none"),
    ("option.quantization", "awq4", "is not supported; allowed: int8, int8_weight_only, awq, gptq, gguf, fp8, none"),
    ("option.model_impl", "vllm2", "is not supported; allowed: auto, lmi, transformers"),
    ("option.cpu_kernels", "sse4", "is not supported; allowed: auto, avx512, avx2, neon, torch"),
    ("option.kv_cache_dtype", "q4_0", "is not supported; allowed: auto, int8, fp8, fp8_e4m3, fp8_e5m2"),
    ("option.quantize_head", "1", "is not supported; allowed: auto, true, false"),
    ("option.cpu_grouped_activations", "on", "is not supported; allowed: exact, int8"),
    ("option.grouped_code_layout", "5bit", "is not supported; allowed: bytes, packed"),
    ("option.model_id", "", "is empty"),
    ("option.revision", "", "is empty"),
    ("option.chat_template", "", "is empty"),
    ("option.chat_template_content_format", "json", "is not supported; allowed: auto, string, openai"),
    ("option.enable_reasoning", "yes", "is not a boolean; allowed: true, false"),
    ("graceful_timeout", "-1", "is not a positive number of seconds"),
    ("option.max_payload_mb", "0", "is not a positive number of megabytes"),
    ("option.batch_invariant", "sometimes", "is not a boolean; allowed: true, false"),
    ("option.enforce_eager", "eager", "is not a boolean; allowed: true, false"),
    ("option.tool_call_parser", "qwen9", "is not supported; allowed: auto, hermes, llama3_json, mistral, pythonic, granite, qwen3_coder"),
    ("option.enable_auto_tool_choice", "yes", "is not a boolean; allowed: true, false"),
    ("option.reasoning_parser", "think", "is not supported; allowed: none, deepseek_r1, qwen3"),
    ("option.enable_lora", "yes", "is not a boolean; allowed: true, false"),
    ("option.max_loras", "0", "is not a positive integer"),
    ("option.max_lora_rank", "-8", "is not a positive integer"),
    ("option.responses_store_max_items", "-1", "is not an integer >= 0"),
    ("option.responses_store_max_items", "x", "is not an integer >= 0"),
    ("option.responses_store_max_mb", "-2", "is not a number of megabytes >= 0"),
    ("option.allow_remote_images", "yes", "is not a boolean; allowed: true, false"),
    ("option.image_fetch_timeout", "0", "is not a positive number of seconds"),
    ("option.max_image_mb", "0", "is not a positive number of megabytes"),
    ("option.max_image_pixels", "0", "is not a positive integer"),
    ("option.max_images_per_request", "-1", "is not an integer >= 0"),
    ("option.encoder_cache_mb", "-1", "is not a number of megabytes >= 0"),
    ("option.max_cpu_loras", "many", "is not a positive integer"),
    ("option.enable_lora_management", "off", "is not a boolean; allowed: true, false"),
    ("option.lmi_compat", "0.2x", LMI_LINES),
    ("option.lmi_compat", "1.0", LMI_LINES),
    ("option.adapter_roots", "adapters", "has 'adapters': each root is an absolute directory (no '..') or "
                                         "s3://bucket/prefix"),
    ("option.adapter_roots", "s3://b", "has 's3://b', not a valid s3://bucket/prefix"),
    ("option.http_header_timeout", "0", "is not a positive number of seconds"),
    ("option.http_body_timeout", "soon", "is not a positive number of seconds"),
    ("option.http_max_connections", "0", "is not a positive integer"),
    ("option.engine_step_timeout", "-3", "is not a positive number of seconds"),
    ("option.target_tpot_ms", "0", "is not a positive number of milliseconds"),
    ("option.target_tpot_ms", "fast", "is not a positive number of milliseconds"),
    ("option.scheduling_policy", "lifo", "is not supported; allowed: fcfs, priority"),
    ("option.task", "summarize", "is not supported; allowed: text_embedding, classify, rerank, generate"),
    ("option.normalize", "maybe", "is not a boolean; allowed: true, false"),
    ("option.scheduling_aging_ms", "-1", "is not a positive number of milliseconds"),
    ("option.responses_store_max_mb", "lots", "is not a number of megabytes >= 0"),
    # speculative decoding (handler/config/speculative.py)
    ("option.speculative_config", '{"method":"eagle"}', "has method 'eagle'; allowed: ngram, draft_model"),
    ("option.speculative_draft_model", "", "is empty"),
    ("option.speculative_length", "0", "is not a positive integer"),
    ("option.speculative_disable_by_batch_size", "x", "is not a positive integer"),
]


@pytest.mark.parametrize("key, value, problem", BAD)
def test_bad_values(key, value, problem, load, tmp_path):
    msg = error_of(load, f"# a comment\n{key}={value}\n")
    shown = value if value else '""'
    assert msg == f"{tmp_path / 'serving.properties'}:2: {key}={shown} {problem}"


def test_every_typed_key_has_a_bad_value_test():
    assert {k for k, _, _ in BAD} >= set(TYPED_KEYS) - {"option.s3url"}


def test_error_from_the_environment_names_the_variable(load):
    msg = error_of(load, None, env={"OPTION_MAX_ROLLING_BATCH_SIZE": "abc"})
    assert msg == "environment OPTION_MAX_ROLLING_BATCH_SIZE: option.max_rolling_batch_size=abc is not a positive integer"


def test_value_with_control_characters_is_shown_on_one_line(load):
    msg = error_of(load, "batch_size=1\\n2\n")
    assert 'batch_size="1\\n2"' in msg


# ---- strategy resolution -------------------------------------------------------------
@pytest.mark.parametrize("text, strategy, paged", [
    ("", "paged", True),                                   # current LMI: absent = auto
    ("batch_size=1\n", "paged", True),
    ("option.lmi_compat=0.31\n", "paged", True),
    ("option.lmi_compat=0.26\n", "none", False),          # LMI <= 0.26: absent = disable
    ("option.lmi_compat=0.26\nbatch_size=1\n", "none", False),
    ("option.lmi_compat=0.26\noption.rolling_batch=auto\n", "paged", True),
    ("option.rolling_batch=disable\n", "none", False),
    ("batch_size=2\n", "dynamic", False),
    ("batch_size=8\noption.rolling_batch=disable\n", "dynamic", False),
    ("option.rolling_batch=auto\n", "paged", True),
    ("option.rolling_batch=lmi-dist\n", "paged", True),
    ("option.rolling_batch=vllm\n", "paged", True),
    ("option.rolling_batch=scheduler\n", "rolling", False),
    ("option.rolling_batch=scheduler\noption.paged_attention=false\n", "rolling", False),
    ("option.rolling_batch=auto\noption.paged_attention=false\n", "rolling", False),
    ("option.rolling_batch=vllm\noption.paged_attention=false\n", "rolling", False),
    ("option.rolling_batch=auto\noption.paged_attention=true\n", "paged", True),
])
def test_strategy(text, strategy, paged, load):
    cfg = load(text)
    assert (cfg.strategy, cfg.paged_attention) == (strategy, paged)


def test_no_properties_file_gives_defaults(load, model_dir):
    cfg = load(None)
    assert cfg.properties_file is None and cfg.strategy == "paged" and cfg.lmi_compat == "current"
    assert (cfg.batch_size, cfg.max_batch_delay_ms, cfg.job_queue_size, cfg.max_idle_time_s) == (1, 100, 1000, 60)
    assert (cfg.request_timeout_s, cfg.max_rolling_batch_size, cfg.max_rolling_batch_prefill_tokens) == (600.0, 256, 4096)
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.kv_cache_tokens, cfg.max_model_len) == (16, False, None, None)
    assert (cfg.gpu_memory_utilization, cfg.dtype, cfg.device, cfg.tensor_parallel_degree) == (0.9, "auto", "auto", 1)
    assert (cfg.trust_remote_code, cfg.entry_point, cfg.output_formatter, cfg.port) == (
        False, "djl_python.huggingface", "json", 8080)
    assert cfg.engine == "Python" and cfg.rolling_batch == "auto" and cfg.paged_attention and cfg.warnings == ()


# ---- option.lmi_compat: the LMI release line's defaults --------------------------------------
@pytest.mark.parametrize("value, line, strategy, width, tp", [
    (None, "current", "paged", 256, 4),
    ("current", "current", "paged", 256, 4),
    ("latest", "current", "paged", 256, 4),
    ("0.33.0", "current", "paged", 256, 4),
    ("v0.32", "current", "paged", 256, 4),
    ("0.31", "0.31", "paged", 256, 4),
    ("0.28.0", "0.31", "paged", 256, 4),
    ("0.27", "0.31", "paged", 256, 4),
    ("0.26", "0.26", "none", 32, 1),
    ("0.25.0", "0.26", "none", 32, 1),
])
def test_lmi_compat_line_sets_the_defaults(value, line, strategy, width, tp, load):
    text = "" if value is None else f"option.lmi_compat={value}\n"
    cfg = load(text, gpu_count=4)
    assert (cfg.lmi_compat, cfg.strategy, cfg.max_rolling_batch_size, cfg.tensor_parallel_degree) == \
        (line, strategy, width, tp)
    # From the environment as any key; explicit keys win over every line's defaults.
    assert load(None, env={"OPTION_LMI_COMPAT": value or "current"}, gpu_count=4).lmi_compat == line
    cfg = load(text + "option.rolling_batch=scheduler\noption.max_rolling_batch_size=8\n"
               "option.tensor_parallel_degree=2\n", gpu_count=4)
    assert (cfg.strategy, cfg.max_rolling_batch_size, cfg.tensor_parallel_degree) == ("rolling", 8, 2)


def test_lmi_compat_keeps_batch_size_dynamic(load):
    # LMI's recommender: batch_size > 1 turns rolling batch off, whatever the line.
    for line in ("current", "0.31", "0.26"):
        cfg = load(f"option.lmi_compat={line}\nbatch_size=8\n")
        assert (cfg.strategy, cfg.rolling_batch) == ("dynamic", "disable"), line


@pytest.mark.parametrize("env", [{"SM_NUM_GPUS": "2"}, {"TENSOR_PARALLEL_DEGREE": "2"}])
def test_default_degree_takes_lmi_environment(env, load):
    assert load(None, env=env, gpu_count=4).tensor_parallel_degree == 2


@pytest.mark.parametrize("setting", ["option.enable_lora=true", "option.batch_invariant=true",
                                     'option.speculative_config={"method": "ngram"}'])
def test_default_degree_yields_to_single_rank_features(setting, load):
    cfg = load(f"{setting}\n", gpu_count=4)
    assert cfg.tensor_parallel_degree == 1
    assert any("option.tensor_parallel_degree defaults to 1 here, not 4" in w and setting.split("=")[0] in w
               for w in cfg.warnings)
    # An explicit degree is refused as before (one line naming both keys).
    if "lora" in setting or "speculative" in setting:
        msg = error_of(load, f"{setting}\noption.tensor_parallel_degree=4\n", gpu_count=4)
        assert "option.tensor_parallel_degree" in msg and "=4" in msg


def test_default_degree_divides_the_heads(tmp_path, load):
    d = tmp_path / "heads"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 9,
                                               "num_key_value_heads": 3}))
    (d / "model.safetensors").write_bytes(b"")
    cfg = load(None, gpu_count=4, model_dir=str(d))
    assert cfg.tensor_parallel_degree == 3
    assert any("defaults to 3, not 4 (every GPU)" in w and "num_attention_heads=9" in w for w in cfg.warnings)
    msg = error_of(load, "option.tensor_parallel_degree=4\n", gpu_count=4, model_dir=str(d))
    assert "does not divide the heads" in msg


def test_scheduler_with_paged_attention_is_an_error(load):
    msg = error_of(load, "option.rolling_batch=scheduler\noption.paged_attention=true\n")
    assert "option.paged_attention=true" in msg and "option.rolling_batch=scheduler" in msg


def test_rolling_batch_ignores_batch_size_with_a_warning(load):
    cfg = load("option.rolling_batch=auto\nbatch_size=64\n")
    assert cfg.strategy == "paged"
    assert any("batch_size=64 is ignored" in w and "max_rolling_batch_size" in w for w in cfg.warnings)


def test_paged_attention_without_rolling_batch_warns(load):
    assert load("option.paged_attention=true\n").strategy == "paged"    # absent: auto (current LMI)
    cfg = load("option.rolling_batch=disable\noption.paged_attention=true\n")
    assert cfg.strategy == "none" and cfg.paged_attention is False
    assert any("option.paged_attention=true has no effect" in w for w in cfg.warnings)


def test_keys_of_another_strategy_are_named_in_one_warning(load):
    cfg = load("batch_size=4\noption.max_rolling_batch_size=8\noption.max_rolling_batch_prefill_tokens=99\n")
    assert cfg.strategy == "dynamic"
    assert [w for w in cfg.warnings if "ignored with strategy" in w] == [
        "ignored with strategy dynamic: option.max_rolling_batch_size, option.max_rolling_batch_prefill_tokens"]
    cfg = load("option.rolling_batch=auto\nmax_batch_delay=10\n")
    assert cfg.warnings == ("ignored with strategy paged: max_batch_delay",)


def test_latency_policy_keys_resolve_and_are_dropped_at_request_level(load):
    cfg = load("option.rolling_batch=auto\noption.target_tpot_ms=80\noption.scheduling_policy=Priority\n"
               "option.scheduling_aging_ms=1500\n")
    assert (cfg.target_tpot_ms, cfg.scheduling_policy, cfg.scheduling_aging_ms) == (80.0, "priority", 1500.0)
    assert cfg.warnings == ()
    assert load("option.rolling_batch=auto\n").scheduling_policy == "fcfs"
    cfg = load("batch_size=4\noption.target_tpot_ms=80\noption.scheduling_policy=priority\n")
    assert (cfg.target_tpot_ms, cfg.scheduling_policy) == (None, "fcfs")
    assert cfg.warnings == ("ignored with strategy dynamic: option.target_tpot_ms, option.scheduling_policy",)


@pytest.mark.parametrize("setting", ["option.output_formatter=jsonlines", "option.output_formatter=sse",
                                     "option.enable_streaming=true"])
def test_streaming_with_dynamic_batching_is_an_error(setting, load):
    msg = error_of(load, f"batch_size=8\n{setting}\n")
    assert setting in msg and "dynamic batching" in msg
    assert load(f"batch_size=1\noption.rolling_batch=disable\n{setting}\n").strategy == "none"
    assert load(f"option.rolling_batch=auto\n{setting}\n").strategy == "paged"


def test_kv_cache_tokens_must_hold_a_block_and_a_sequence(load):
    msg = error_of(load, "option.block_size=32\noption.kv_cache_tokens=16\n")
    assert "option.kv_cache_tokens=16" in msg and "option.block_size=32" in msg
    msg = error_of(load, "option.kv_cache_tokens=1024\noption.max_model_len=2048\n")
    assert "option.kv_cache_tokens=1024" in msg and "option.max_model_len=2048" in msg
    assert load("option.kv_cache_tokens=2048\noption.max_model_len=2048\n").kv_cache_tokens == 2048


@pytest.mark.parametrize("degree, gpus, expected", [("max", 0, 1), ("max", 1, 1), ("1", 0, 1), ("max", 4, 4),
                                                    ("2", 0, 2), ("4", 4, 4), ("2", 4, 2)])
def test_tensor_parallel_degree_resolves(degree, gpus, expected, load):
    assert load(f"option.tensor_parallel_degree={degree}\n", gpu_count=gpus).tensor_parallel_degree == expected


@pytest.mark.parametrize("degree, gpus, needle", [("2", 1, "needs 2 GPUs (one rank per GPU), 1 visible"),
                                                  ("8", 4, "needs 8 GPUs (one rank per GPU), 4 visible")])
def test_tensor_parallel_degree_errors(degree, gpus, needle, load):
    msg = error_of(load, f"option.tensor_parallel_degree={degree}\n", gpu_count=gpus)
    assert f"option.tensor_parallel_degree={degree}" in msg and needle in msg


def test_gpu_count_defaults_to_torch(load, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    msg = error_of(load, "option.tensor_parallel_degree=4\n", gpu_count=None)
    assert "needs 4 GPUs (one rank per GPU), 3 visible" in msg
    assert load("option.tensor_parallel_degree=max\n", gpu_count=None).tensor_parallel_degree == 3


def test_device_cuda_needs_a_gpu(load):
    assert "option.device=cuda but no CUDA GPU" in error_of(load, "option.device=cuda\n", gpu_count=0)
    assert load("option.device=cuda\n", gpu_count=1).device == "cuda"


# ---- unknown and ignored keys --------------------------------------------------------
def test_unknown_keys_make_one_warning(load):
    cfg = load("option.max_rolling_batchsize=4\nfoo=1\noption.bar=2\n", env={"OPTION_BAZ": "3"})
    unknown = [w for w in cfg.warnings if w.startswith("unknown keys")]
    assert len(unknown) == 1
    for name in ("option.max_rolling_batchsize", "foo", "option.bar", "option.baz (OPTION_BAZ)",
                 "did you mean option.max_rolling_batch_size?"):
        assert name in unknown[0]


def test_ignored_lmi_keys_are_reported_once_as_having_no_effect(load):
    text = "".join(f"{k}=1\n" for k in sorted(IGNORED_KEYS))
    assert load(text).warnings == ("accepted, has no effect here: " + ", ".join(sorted(IGNORED_KEYS)),)


def test_lmi_names_for_our_keys(load):
    cfg = load("option.predict_timeout=30\noption.max_num_batched_tokens=512\noption.rolling_batch=auto\n")
    assert (cfg.request_timeout_s, cfg.max_rolling_batch_prefill_tokens, cfg.warnings) == (30.0, 512, ())
    cfg = load("request_timeout=9\noption.predict_timeout=30\noption.max_rolling_batch_prefill_tokens=64\n"
               "option.max_num_batched_tokens=512\noption.rolling_batch=auto\n")
    assert (cfg.request_timeout_s, cfg.max_rolling_batch_prefill_tokens) == (9.0, 64)   # ours win
    cfg = load(None, env={"SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS": "45", "OPTION_ENGINE": "MPI",
                          "OPTION_TGI_COMPAT": "true", "OPTION_OUTPUT_FORMATTER": "sse_chat",
                          "OPTION_ROLLING_BATCH": "auto"})
    assert (cfg.request_timeout_s, cfg.engine, cfg.tgi_compat, cfg.output_formatter) == (45.0, "MPI", True, "sse_chat")
    assert cfg.warnings == ()
    assert load("engine=Python\n", env={"OPTION_ENGINE": "MPI"}).engine == "Python"   # the file wins


def test_quantize_takes_int8_and_its_names_and_refuses_the_rest_with_one_line(load):
    assert load("option.quantize=int8\n").quantize == "int8"
    assert load("option.quantize=W8A8\n").quantize == "int8"
    assert load(None, env={"HF_MODEL_QUANTIZE": "int8_dynamic"}).quantize == "int8"
    assert load("option.dtype=bf16\n").quantize is None
    msg = error_of(load, None, env={"HF_MODEL_QUANTIZE": "bitsandbytes"})
    assert "environment HF_MODEL_QUANTIZE" in msg and "allowed: int8" in msg
    assert load("option.quantization=w8a8\n").quantize == "int8"      # vLLM's name
    assert "option.quantization=awq4" in error_of(load, "option.quantization=awq4\n")


def test_chat_streaming_formatter_is_refused_with_dynamic_batching(load):
    msg = error_of(load, "batch_size=4\noption.output_formatter=jsonlines_chat\n")
    assert "dynamic batching" in msg


def test_file_keys_match_known_keys_case_insensitively(load):
    cfg = load("option.entrypoint=djl_python.huggingface\nOPTION.ROLLING_BATCH=auto\n")
    assert cfg.strategy == "paged" and cfg.warnings == ()
    assert "option.entryPoint" in cfg.properties


def test_other_entry_point_warns(load):
    cfg = load("option.entryPoint=my_company.handler\n")
    assert any("option.entryPoint=my_company.handler is not run" in w for w in cfg.warnings)
    assert load("option.entryPoint=djl_python.lmi_vllm.vllm_async_service\n").warnings == ()   # LMI's own: ours
    cfg = load("option.entryPoint=model.py\n")     # a file: its handle() runs (handler/http/custom.py)
    assert cfg.entry_point == "model.py" and cfg.warnings == ()


# ---- environment ---------------------------------------------------------------------
@pytest.mark.parametrize("env, field, expected", [
    ({"OPTION_ROLLING_BATCH": "auto"}, "strategy", "paged"),
    ({"OPTION_ENTRYPOINT": "djl_python.huggingface"}, "entry_point", "djl_python.huggingface"),
    ({"OPTION_MAX_ROLLING_BATCH_SIZE": "7"}, "max_rolling_batch_size", 7),
    ({"OPTION_DTYPE": "float16"}, "dtype", "fp16"),
    ({"SERVING_BATCH_SIZE": "4"}, "strategy", "dynamic"),
    ({"SERVING_MAX_BATCH_DELAY": "5"}, "max_batch_delay_ms", 5),
    ({"SERVING_ENGINE": "mpi"}, "engine", "MPI"),
    ({"SERVING_JOB_QUEUE_SIZE": "9"}, "job_queue_size", 9),
    ({"MAX_BATCH_SIZE": "16"}, "max_rolling_batch_size", 16),
    ({"MAX_CONCURRENT_REQUESTS": "77"}, "job_queue_size", 77),
    ({"MAX_BATCH_PREFILL_TOKENS": "512"}, "max_rolling_batch_prefill_tokens", 512),
    ({"SM_NUM_GPUS": "1"}, "tensor_parallel_degree", 1),
    ({"HF_MODEL_TRUST_REMOTE_CODE": "true"}, "trust_remote_code", True),
    ({"SAGEMAKER_MODEL_SERVER_TIMEOUT": "90"}, "request_timeout_s", 90.0),
    ({"SAGEMAKER_BIND_TO_PORT": "9000"}, "port", 9000),
    ({"OPTION_ROLLING_BATCH": "", "OPTION_LMI_COMPAT": "0.26"}, "strategy", "none"),  # empty means unset
])
def test_environment(env, field, expected, load):
    assert getattr(load(None, env=env), field) == expected


def test_sm_num_gpus_is_checked_like_the_property(load):
    msg = error_of(load, None, env={"SM_NUM_GPUS": "4"}, gpu_count=2)
    assert msg.startswith("environment SM_NUM_GPUS: option.tensor_parallel_degree=4 needs 4 GPUs")


def test_bad_port(load):
    assert error_of(load, None, env={"SAGEMAKER_BIND_TO_PORT": "http"}) == \
        "environment SAGEMAKER_BIND_TO_PORT=http is not a port number (1-65535)"


def test_file_wins_over_environment_and_says_so(load):
    cfg = load("option.max_rolling_batch_size=64\noption.rolling_batch=auto\n",
               env={"OPTION_MAX_ROLLING_BATCH_SIZE": "8", "OPTION_ROLLING_BATCH": "auto", "MAX_BATCH_SIZE": "4"})
    assert cfg.max_rolling_batch_size == 64
    assert len(cfg.warnings) == 1 and "OPTION_MAX_ROLLING_BATCH_SIZE=8 is overridden by" in cfg.warnings[0]
    assert cfg.properties["option.max_rolling_batch_size"] == "64"


def test_explicit_option_variable_wins_over_alias(load):
    cfg = load(None, env={"OPTION_MAX_ROLLING_BATCH_SIZE": "8", "MAX_BATCH_SIZE": "4",
                          "SERVING_JOB_QUEUE_SIZE": "3", "MAX_CONCURRENT_REQUESTS": "5"})
    assert (cfg.max_rolling_batch_size, cfg.job_queue_size) == (8, 3)


def test_unrelated_environment_is_ignored(load):
    cfg = load(None, env={"PATH": "/bin", "HOME": "/root", "BATCH_SIZE": "8", "OPTIONAL": "x"})
    assert cfg.strategy == "paged" and cfg.warnings == () and cfg.properties == {}


def test_normalised_known_keys_are_distinct():
    from handler.config.properties import KNOWN_KEYS, _norm
    assert len({_norm(k) for k in KNOWN_KEYS}) == len(KNOWN_KEYS)


# ---- where the model is --------------------------------------------------------------
def test_model_id_relative_to_properties_file(tmp_path, model_dir):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "p.properties").write_text("option.model_id=../model\n")
    cfg = load_config(str(conf / "p.properties"), model_dir="/nonexistent", env={}, gpu_count=0)
    assert cfg.model_id == "../model" and cfg.model_dir == model_dir


def test_model_id_relative_to_cwd(tmp_path, model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, model_dir="/nonexistent", env={"HF_MODEL_ID": "model"}, gpu_count=0)
    assert cfg.model_dir == model_dir and cfg.model_id == "model"


def test_hf_model_id_absolute_and_option_model_id_wins(load, model_dir, tmp_path):
    cfg = load(None, env={"HF_MODEL_ID": "/nowhere", "OPTION_MODEL_ID": model_dir}, model_dir=str(tmp_path))
    assert cfg.model_dir == model_dir


@pytest.mark.parametrize("uri", ["s3://my-bucket/models/llama", "s3://my-bucket", "s3://my.bucket/a/"])
def test_s3_model_id(uri, load):
    cfg = load(f"option.model_id={uri}\n", model_dir="/nonexistent")
    assert (cfg.model_id, cfg.model_dir) == (uri, "")


def test_legacy_s3url(load):
    cfg = load("option.s3url=s3://bucket-a/x\n")
    assert (cfg.model_id, cfg.model_dir) == ("s3://bucket-a/x", "")


def test_bad_s3_uri(load):
    assert "is not a valid s3://bucket/prefix URI" in error_of(load, "option.model_id=s3://x\n")


def test_hub_id_is_fetched_at_start_up_and_a_missing_path_is_a_clear_error(load):
    cfg = load("option.model_id=meta-llama/Llama-2-7b-hf\noption.revision=main\n")   # handler/model/hf_hub.py
    assert (cfg.model_id, cfg.model_dir, cfg.revision) == ("meta-llama/Llama-2-7b-hf", "", "main")
    msg = error_of(load, "option.model_id=./meta-llama/Llama-2-7b-hf\n")
    assert "option.model_id=./meta-llama/Llama-2-7b-hf is neither a local directory, an s3:// URI nor a hub " \
           "model id (org/name)" in msg and "--model-dir" in msg


def test_model_dir_checks(tmp_path, load):
    d = tmp_path / "m"
    assert "model directory" in error_of(load, None, model_dir=str(d)) and "does not exist" in error_of(
        load, None, model_dir=str(d))
    d.mkdir()
    msg = error_of(load, None, model_dir=str(d))
    assert str(d) in msg and "no config.json" in msg
    (d / "config.json").write_text("{}")
    msg = error_of(load, None, model_dir=str(d))
    assert str(d) in msg and "no *.safetensors" in msg
    (d / "pytorch_model.bin").write_bytes(b"")
    msg = error_of(load, None, model_dir=str(d))
    assert "pytorch_model.bin" in msg and "safetensors weights are required" in msg
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert load(None, model_dir=str(d)).model_dir == str(d)


def test_check_model_false_skips_the_checks(load, tmp_path):
    cfg = load(None, model_dir=str(tmp_path / "absent"), check_model=False)
    assert cfg.model_dir == str(tmp_path / "absent")


def test_default_properties_file_in_model_dir(model_dir):
    pathlib.Path(model_dir, "serving.properties").write_text("batch_size=4\n")
    cfg = load_config(model_dir=model_dir, env={}, gpu_count=0)
    assert cfg.strategy == "dynamic" and cfg.properties_file == os.path.join(model_dir, "serving.properties")


def test_missing_properties_file(load, tmp_path):
    assert "does not exist" in error_of(load_config, str(tmp_path / "nope.properties"), env={})


def test_syntax_and_encoding_errors_name_the_file(tmp_path, model_dir):
    p = tmp_path / "x.properties"
    p.write_text("a=1\nb=\\u12\n")
    assert error_of(load_config, str(p), model_dir=model_dir, env={}).startswith(f"{p}:2: malformed \\uXXXX")
    p.write_bytes(b"a=\xff\n")
    assert error_of(load_config, str(p), model_dir=model_dir, env={}).startswith(f"{p}: not UTF-8")


# ---- output --------------------------------------------------------------------------
def test_config_is_frozen_and_dict_is_json(load):
    cfg = load("option.rolling_batch=auto\nfoo=1\n")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 2  # type: ignore[misc]
    assert hash(cfg) == hash(dataclasses.replace(cfg))
    d = json.loads(json.dumps(config_to_dict(cfg)))
    assert next(iter(d)) == "strategy" and d["strategy"] == "paged"
    assert set(d) == {f.name for f in dataclasses.fields(ServingConfig)}
    assert d["properties"] == {"foo": "1", "option.rolling_batch": "auto"} and len(d["warnings"]) == 1


def test_main_prints_json(tmp_path, model_dir, capsys, monkeypatch):
    for var in [v for v in os.environ if v.startswith(("OPTION_", "SERVING_", "SM_", "SAGEMAKER_", "HF_MODEL"))]:
        monkeypatch.delenv(var)
    p = tmp_path / "p.properties"
    p.write_text("option.rolling_batch=scheduler\nbogus=1\n")
    assert main(["--properties", str(p), "--model-dir", model_dir]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["strategy"] == "rolling"
    assert err.startswith("warning: unknown keys ignored: bogus")


def test_main_error_exit_code(tmp_path, model_dir, capsys):
    p = tmp_path / "p.properties"
    p.write_text("batch_size=abc\n")
    assert main(["--properties", str(p), "--model-dir", model_dir]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {p}:1: batch_size=abc is not a positive integer\n"


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OPTION_", "SERVING_", "SM_", "SAGEMAKER_", "HF_MODEL", "MAX_"))}


@pytest.mark.parametrize("name, strategy", [("none", "none"), ("dynamic", "dynamic"), ("paged", "paged")])
def test_cli_subprocess(name, strategy, model_dir):
    probe = ("import sys, runpy; sys.argv = ['handler'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('handler', run_name='__main__')\n"
             "finally:\n    print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules), "
             "file=sys.stderr)\n")
    r = subprocess.run([PY, "-c", probe, "config", "--properties",
                        str(REPO / "serving.properties.d" / f"{name}.properties"), "--model-dir", model_dir],
                       capture_output=True, text=True, cwd=REPO, env=_clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["strategy"] == strategy
    assert "HEAVY []" in r.stderr  # neither torch nor transformers imported


def test_cli_subprocess_bad_file(tmp_path, model_dir):
    p = tmp_path / "bad.properties"
    p.write_text("option.rolling_batch=trtllm\n")
    r = subprocess.run([PY, "-m", "handler", "config", "--properties", str(p), "--model-dir", model_dir],
                       capture_output=True, text=True, cwd=REPO, env=_clean_env(), timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"error: {p}:1: option.rolling_batch=trtllm is not supported; "
                        "allowed: auto, scheduler, lmi-dist, vllm, disable\n")
    assert "Traceback" not in r.stderr


# ---- the reference table documents every key -----------------------------------------
@pytest.mark.parametrize("doc_path", ["docs/PROPERTIES.md"])   # README links it (under 16 KB)
def test_properties_doc_covers_every_key_and_variable(doc_path):
    doc = (REPO / doc_path).read_text()
    for key in TYPED_KEYS:
        assert f"`{key}`" in doc, key
    for var, _ in ENV_ALIASES:
        assert f"`{var}`" in doc, var
    assert "`SAGEMAKER_BIND_TO_PORT`" in doc


def test_cpu_kernels_the_cpu_cannot_run_stop_the_start_up_in_one_line(tmp_path, monkeypatch):
    from handler.config import hardware
    from kernels import isa
    props = tmp_path / "serving.properties"
    missing = [i for i in isa.ISAS if i not in isa.host_isas()]     # an AVX-512 host lacks neon; Arm lacks avx2
    props.write_text(f"option.cpu_kernels={missing[0]}\noption.device=cpu\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(props), str(tmp_path), check_model=False, env={})
    line = str(e.value)
    assert f"option.cpu_kernels={missing[0]}" in line and "cannot run it" in line and "it runs:" in line
    assert "\n" not in line
    for ok in isa.host_isas() + ["torch", "auto"]:
        props.write_text(f"option.cpu_kernels={ok}\noption.device=cpu\n")
        assert load_config(str(props), str(tmp_path), check_model=False, env={}).cpu_kernels == ok
    # the environment names it too (OPTION_CPU_KERNELS, LMI_CPU_KERNELS), resolved alike
    props.write_text("option.device=cpu\n")
    assert load_config(str(props), str(tmp_path), check_model=False,
                       env={"LMI_CPU_KERNELS": "torch"}).cpu_kernels == "torch"
    # the resolution itself, on flags of other CPUs
    assert isa.resolve("auto", {"avx2", "fma"}, "x86_64") == ("avx2", "auto: the best this CPU runs (of avx2, torch)")
    assert isa.resolve("auto", {"asimd", "asimddp"}, "aarch64")[0] == "neon"
    assert isa.resolve("auto", {"sse2"}, "x86_64")[0] is None
    with pytest.raises(ValueError, match="cannot run it"):
        isa.resolve("avx512", {"avx2", "fma"}, "x86_64")
    assert hardware.cpu_kernels("torch") == (None, "option.cpu_kernels=torch")


def test_numerics_keys_resolve_into_one_record_and_config_explain_shows_them(load, demo_model_dir, capsys):
    from handler.config import explain
    from handler.config.numerics import Numerics
    cfg = load(None)
    assert cfg.numerics == Numerics("exact", "auto", "bytes")
    cfg = load("option.cpu_grouped_activations=INT8\noption.quantize_head=false\noption.grouped_code_layout=packed\n")
    assert cfg.numerics == Numerics("int8", "false", "packed")
    assert cfg.numerics.act8 and cfg.numerics.packed_codes
    e = explain.explain(cfg, explain.read_geometry(demo_model_dir), device="cpu", model_dir=demo_model_dir)
    said = ("option.cpu_grouped_activations=int8, option.quantize_head=false, option.grouped_code_layout=packed")
    assert e["numerics"] == said and f"numerics: {said}" in explain.render(e)


def test_the_old_numerics_variables_only_warn(load):
    # LMI_CPU_Q_ACT8 / LMI_QUANT_HEAD / LMI_QUANT_PACKED_CODES chose numerics before they were keys: set, each
    # gets one warning naming its key, and the resolved values are the file's (here its defaults).
    old = {"LMI_CPU_Q_ACT8": "1", "LMI_QUANT_HEAD": "0", "LMI_QUANT_PACKED_CODES": "1"}
    cfg = load("option.rolling_batch=auto\n", env=old)
    assert cfg.numerics == load("option.rolling_batch=auto\n").numerics
    for name, key in (("LMI_CPU_Q_ACT8", "option.cpu_grouped_activations"), ("LMI_QUANT_HEAD", "option.quantize_head"),
                      ("LMI_QUANT_PACKED_CODES", "option.grouped_code_layout")):
        said = [w for w in cfg.warnings if w.startswith(f"{name}=")]
        assert len(said) == 1 and "is no longer read" in said[0] and f"use {key}=" in said[0], cfg.warnings
    assert not any("no longer read" in w for w in load("option.rolling_batch=auto\n").warnings)
