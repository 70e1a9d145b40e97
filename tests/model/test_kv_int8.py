"""option.kv_cache_dtype=int8 end to end on the tiny models (the real ones: tests/test_kv_int8_real.py):
the configuration's one-line refusals, the KV sizing (the same memory holds about twice the bf16
tokens), the runner's int8 pools and scales (block copies carry them), the one-call C stack against
the Python layers bit for bit over int8 pools, the torch backend over the same pools, and the engine
under every strategy, preemption and prefix caching.

Greedy output is not expected to equal the unquantized cache's token for token: int8 rows move the
logits a little. What is asserted: the same tokens where the quantization is the only difference
(same pools, other code paths), and agreement with `auto` at a stated threshold."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from handler.config import ConfigError, load_config
from handler.config import sizing
from handler.engine.request import SamplingParams
from kernels import cpu as cpu_ext
from kernels.cpu import elementwise as cpu_elementwise
from tests.model.test_lora import lora_models  # noqa: F401  (the fixture)
from tests.support.engine import STRATEGIES, assert_drained, make_engine, run_all

BUILD = cpu_ext.current()[0]
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "def add(a, b):\n    return",
           "Once upon a time", "1, 2, 3, 4, 5,"]


def _props(tmp_path, **kv) -> str:
    path = tmp_path / "serving.properties"
    path.write_text("".join(f"{k}={v}\n" for k, v in kv.items()))
    return str(path)


# ---------------------------------------------------------------------------- configuration
def test_config_takes_auto_and_int8_and_refuses_the_rest_in_one_line(demo_model_dir, tmp_path):
    assert load_config(_props(tmp_path), demo_model_dir, env={}, gpu_count=0).kv_cache_dtype == "auto"
    cfg = load_config(_props(tmp_path, **{"option.kv_cache_dtype": "INT8"}), demo_model_dir, env={}, gpu_count=0)
    assert cfg.kv_cache_dtype == "int8"
    cases = [("q4_0", 0, "allowed: auto, int8, fp8, fp8_e4m3, fp8_e5m2"),
             ("fp8", 0, "needs a CUDA GPU"), ("fp8_e5m2", 0, "needs a CUDA GPU"),
             ("int8", 1, "is not built for CUDA"), ("fp8_e4m3", 1, "is not built for CUDA")]
    for value, gpus, says in cases:
        with pytest.raises(ConfigError) as e:
            load_config(_props(tmp_path, **{"option.kv_cache_dtype": value}), demo_model_dir, env={}, gpu_count=gpus)
        line = str(e.value)
        assert "option.kv_cache_dtype" in line and says in line and "\n" not in line, line
    env = {"OPTION_KV_CACHE_DTYPE": "int8"}             # the environment form, as every key
    assert load_config(_props(tmp_path), demo_model_dir, env=env, gpu_count=0).kv_cache_dtype == "int8"


def test_runner_refuses_what_the_device_cannot_hold(demo_model_dir):
    from handler.model.runner import ModelLoadError, ModelRunner
    with pytest.raises(ModelLoadError, match=r"option.kv_cache_dtype=fp8 needs a CUDA GPU"):
        ModelRunner(demo_model_dir, device="cpu", kv_cache_dtype="fp8")


def test_int8_bytes_per_token_count_the_scales():
    # 2 (K, V) x layers x kv heads x (D int8 bytes + a 4-byte scale), against D x 2 bytes in bf16
    assert sizing.bytes_per_token(30, 3, 64, 2, "int8") == 2 * 30 * 3 * (64 + 4)
    assert sizing.bytes_per_token(30, 3, 64, 2) == 2 * 30 * 3 * 64 * 2
    ratio = sizing.bytes_per_token(24, 2, 64, 2) / sizing.bytes_per_token(24, 2, 64, 2, "int8")
    assert 1.88 < ratio < 1.89                   # 128 / 68: about twice the tokens in the same memory


def test_the_same_memory_holds_about_twice_the_bf16_tokens(demo_model_dir, monkeypatch):
    from handler.config import hardware
    from handler.model.runner import ModelRunner
    monkeypatch.setattr(hardware, "cpu_available_memory", lambda: 1 << 30)     # 1 GiB: a 204 MiB pool
    tokens = {}
    for kvd in ("auto", "int8"):
        r = ModelRunner(demo_model_dir, dtype="bf16", device="cpu", block_size=16, max_running=10 ** 6,
                        kv_cache_dtype=kvd, cpu_kernels=BUILD or "torch")
        tokens[kvd] = r.kv.tokens
        layers, hkv, d = r.kv.num_layers, r.kv.num_kv_heads, r.kv.head_dim
        pool = r.kv_cache[0][0]
        assert pool.dtype == (torch.int8 if kvd == "int8" else torch.bfloat16)
        if kvd == "int8":
            assert pool.scales.shape == pool.shape[:3]
    want = (2 * d * 2) / (2 * (d + 4))            # bf16 bytes a row over int8 + scale
    assert tokens["int8"] / tokens["auto"] == pytest.approx(want, rel=0.02)
    assert tokens["int8"] > 1.7 * tokens["auto"]


def test_config_explain_counts_the_int8_bytes(demo_model_dir, tmp_path):
    out = {}
    for kvd in ("auto", "int8"):
        props = _props(tmp_path, **{"option.kv_cache_dtype": kvd, "option.dtype": "bf16", "option.device": "cpu"})
        r = subprocess.run([sys.executable, "-m", "handler", "config", "--explain", "--json", "--properties", props,
                            "--model-dir", demo_model_dir, "--cpu-memory-gib", "4"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        out[kvd] = json.loads(r.stdout)
    g = sizing.read_geometry(demo_model_dir)
    assert out["int8"]["kv_bytes_per_token"] == 2 * g.layers * g.kv_heads * (g.head_dim + 4)
    assert out["auto"]["kv_bytes_per_token"] == 2 * g.layers * g.kv_heads * g.head_dim * 2
    assert "int8" in out["int8"]["kv_bytes_per_token_formula"] and out["int8"]["kv_cache_dtype"] == "int8"


# ---------------------------------------------------------------------------- the runner and the C stack
def _runner(model_dir, dtype="fp32", kvd="int8", stack=True, kernels=None):
    from handler.model.runner import ModelRunner
    r = ModelRunner(model_dir, dtype=dtype, device="cpu", block_size=4, kv_cache_tokens=256, max_running=8,
                    kv_cache_dtype=kvd, cpu_kernels=kernels or BUILD or "torch")
    r.prepack_cpu()
    if not stack:
        r.model.decode_stack = None
    return r


def _pools_equal(a, b) -> bool:
    return all(torch.equal(x.data, y.data) and torch.equal(x.scales, y.scales)
               for (ak, av), (bk, bv) in zip(a.kv_cache, b.kv_cache) for x, y in ((ak, bk), (av, bv)))


_STACK_WHY = "" if BUILD and cpu_ext.gemm_available() and cpu_elementwise._silu_ready() and cpu_ext.silu_exact(
    torch.get_num_threads()) else f"the one-call C stack does not run on this build ({BUILD})"


@pytest.mark.skipif(bool(_STACK_WHY), reason=_STACK_WHY)
@pytest.mark.parametrize("family,dtype", [("llama", "fp32"), ("qwen2", "fp32"),
                                          pytest.param("llama", "bf16", marks=pytest.mark.skipif(
                                              not cpu_ext.gemm_bf16_available(),
                                              reason="no bf16 dot-product GEMM here (AVX512-BF16)"))])
def test_stack_over_int8_pools_gives_the_python_layers_values_bit_for_bit(demo_model_factory, family, dtype):
    from tests.model.test_cpu_stack import _steps
    path = demo_model_factory(family)
    fast, slow = _runner(path, dtype), _runner(path, dtype, stack=False)
    assert fast.model.decode_stack is not None and slow.model.decode_stack is None
    assert fast.kv_cache[0][0].dtype == torch.int8
    calls = []
    got, _ = _steps(fast, calls)
    want, _ = _steps(slow, [])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert _pools_equal(fast, slow)
    assert calls == [True] * 8                   # prompts, the mixed step and the decode steps all in C
    # and the cache moved the logits, a little, from the unquantized cache's
    plain, _ = _steps(_runner(path, dtype, kvd="auto"), [])
    diff = max((g - p).abs().max().item() for g, p in zip(got, plain))
    assert 0 < diff < 0.05 * max(p.abs().max().item() for p in plain)


def test_torch_backend_reads_the_same_int8_pools(demo_model_dir):
    # option.cpu_kernels=torch: the reference quantizes on write and dequantizes on read; the same
    # rows and scales as the C kernels up to a rounding flip (the fp32 sums' order differs, and a
    # value at a rounding edge lands one step apart), logits within 1e-2 (measured: 5e-3 of logits
    # up to ~7; the auto cache's paths differ by 1e-5).
    if BUILD is None:
        pytest.skip("no C kernel build on this CPU to compare the torch backend with")
    from tests.model.test_cpu_stack import _steps
    c_run = _runner(demo_model_dir)
    got, _ = _steps(c_run, [])
    try:
        t_run = _runner(demo_model_dir, kernels="torch")
        assert cpu_ext.load() is None and t_run.kv_cache[0][0].dtype == torch.int8
        want, _ = _steps(t_run, [])
    finally:
        cpu_ext.select(None)
    assert all((g - w).abs().max().item() < 1e-2 for g, w in zip(got, want))
    for (ck, cv), (tk, tv) in zip(c_run.kv_cache, t_run.kv_cache):
        for a, b in ((ck, tk), (cv, tv)):    # the same rows up to a rounding flip from the fp32 sums' order
            assert (a.data.int() - b.data.int()).abs().max() <= 1
            assert torch.allclose(a.scales, b.scales, rtol=1e-2, atol=1e-6)


def test_block_copies_carry_the_scales(demo_model_dir):
    r = _runner(demo_model_dir, stack=False)
    k = r.kv_cache[0][0]
    k.data[2] = 7
    k.scales[2] = 0.5
    r._copy_blocks(torch.tensor([2]), torch.tensor([5]))
    assert torch.equal(k.data[5], k.data[2]) and torch.equal(k.scales[5], k.scales[2])


# ---------------------------------------------------------------------------- the engine
def _agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_serves_int8_and_agrees_with_auto(demo_model_dir, tmp_path, strategy):
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in PROMPTS]
    out = {}
    for kvd in ("auto", "int8"):
        engine = make_engine(demo_model_dir, tmp_path, {**STRATEGIES[strategy], "option.kv_cache_dtype": kvd})
        try:
            out[kvd] = [ids for ids, _ in run_all(engine, PROMPTS, params)]
            assert engine.runner.kv_cache[0][0].dtype == (torch.int8 if kvd == "int8" else torch.float32)
            assert_drained(engine)
        finally:
            engine.shutdown()
    assert all(len(ids) == 12 for ids in out["int8"])
    # the tiny random model's logits are nearly flat: agreement on the first tokens of most prompts
    agree = [_agreement(a, b) for a, b in zip(out["auto"], out["int8"])]
    assert sum(n >= 4 for n in agree) >= len(PROMPTS) - 1, agree


def test_preemption_and_prefix_caching_over_int8_give_the_unpressed_tokens(demo_model_dir, tmp_path):
    # Every attention reads the rows as the pool holds them (a prompt's own included), so a
    # recompute after preemption and a prefix-cache hit read the values a plain run reads.
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [SamplingParams(max_new_tokens=20 + 2 * i, ignore_eos=True) for i in range(8)]
    base = {**STRATEGIES["paged"], "option.kv_cache_dtype": "int8", "option.block_size": "4",
            "option.max_rolling_batch_size": "8", "option.max_rolling_batch_prefill_tokens": "4096"}
    runs = {}
    for name, extra in (("plain", {"option.kv_cache_tokens": "2048"}),
                        ("preempted", {"option.kv_cache_tokens": "128"}),
                        ("cached", {"option.kv_cache_tokens": "2048", "option.enable_prefix_caching": "true"})):
        engine = make_engine(demo_model_dir, tmp_path, {**base, **extra})
        try:
            if name == "cached":   # one after another: later prompts hit the cached prefixes
                res = [run_all(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
                assert engine.scheduler.stats["cached_prompt_tokens"] > 0
            else:
                res = run_all(engine, prompts, params)
            if name == "preempted":
                assert engine.scheduler.stats["preemptions"] > 0
            runs[name] = [ids for ids, _ in res]
            assert_drained(engine)
        finally:
            engine.shutdown()
    for name in ("preempted", "cached"):
        agree = [_agreement(a, b) for a, b in zip(runs["plain"], runs[name])]
        assert sum(n == len(a) for n, a in zip(agree, runs["plain"])) >= 7, (name, agree)


@pytest.mark.slow
def test_tensor_parallel_degree_2_over_int8_pools(demo_model_factory, tmp_path):
    # Two gloo ranks, each with its own heads' int8 pool: every strategy runs, and the prompt
    # log-probs stay as near the fp32 model's as one rank's int8 cache keeps them (a rank with
    # wrong scales or blocks would be off by nats).
    from tests.model.test_tp import _load, _run_parity
    from tests.support.tp_parity import NEW_TP
    model_dir = demo_model_factory("llama")
    out = _run_parity(model_dir, tmp_path, "cpu", "", "int8")
    assert out["kv_dtype"] == "torch.int8"
    for strategy in STRATEGIES:
        assert [len(ids) for ids in out[strategy]] == NEW_TP[:len(out[strategy])]
    prefill = out["prefill"]
    ids = [t for t, _, _ in prefill]
    _, model = _load(model_dir)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    errs = [abs(lp - ref[i - 1, ids[i]].item()) for i, (_, _, lp) in enumerate(prefill) if i]
    assert 0 < sum(errs) / len(errs) < 0.05 and max(errs) < 0.2, errs


def test_lora_over_int8_pools_follows_the_merged_models(lora_models, tmp_path):
    # Adapters in one batch over an int8 cache: each prompt's log-probs (prompt log-probs, every
    # position) against PEFT's merged model in fp32 without a cache: off by the int8 rounding only,
    # far less than an adapter moves them. (Greedy tokens are no oracle on the random tiny model:
    # its near-ties flip under any rounding.)
    from tests.model.test_lora import PROMPTS as LORA_PROMPTS
    model_dir, merged, tok = lora_models("llama")
    eng = make_engine(model_dir, tmp_path, {"option.rolling_batch": "auto", "option.max_rolling_batch_size": 8,
                                            "option.enable_lora": "true", "option.max_loras": 3,
                                            "option.dtype": "fp32", "option.device": "cpu",
                                            "option.kv_cache_dtype": "int8"})
    try:
        assert eng.runner.kv_cache[0][0].dtype == torch.int8
        lora = eng.runner.lora
        jobs = [(p, name) for p in LORA_PROMPTS[:3] for name in (None, "a1", "a2", "a3")]
        params = [SamplingParams(max_new_tokens=1, decoder_input_details=True,
                                 adapter=None if name is None else lora.get(name)) for _, name in jobs]
        done = [d for _, d in run_all(eng, [p for p, _ in jobs], params)]
    finally:
        eng.shutdown()

    def ref(name, ids):
        with torch.no_grad():
            lp = torch.log_softmax(merged[name](torch.tensor([ids])).logits[0].float(), -1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]

    for (prompt, name), d in zip(jobs, done):
        ids = [t for t, _, _ in d.prefill]
        got = [lp for _, _, lp in d.prefill][1:]
        err = max(abs(a - b) for a, b in zip(got, ref(name, ids)))
        assert err < 0.1, (prompt, name, err)
        if name is not None:      # the adapter moves them more than the cache does
            assert max(abs(a - b) for a, b in zip(ref(name, ids), ref(None, ids))) > 2 * err, (prompt, name)


def test_key_rescaling_keeps_the_logits_and_flattens_the_key_bias(demo_model_factory):
    # Qwen2's k_proj bias dominates a few key channels; for an int8 cache the runner divides each
    # rotary pair above ModelRunner.KEY_BIAS_LEVEL down and multiplies the queries that read it:
    # the same logits (fp32 cache, fp32 rounding), keys without the outlier.
    from tests.model.test_cpu_stack import _steps
    from handler.model.runner import ModelRunner
    path = demo_model_factory("qwen2")
    r = ModelRunner(path, dtype="fp32", device="cpu", block_size=4, kv_cache_tokens=256, max_running=8, fuse=False,
                    cpu_kernels=BUILD or "torch")
    k = r.model.model.layers[1].self_attn.k_proj
    d = r.kv.head_dim
    with torch.no_grad():
        k.bias[3] = 40.0                 # channel pair (3, 3 + D/2) of KV head 0
        k.bias[3 + d // 2] = -30.0
    want, _ = _steps(r, [])
    assert r._rescale_keys(r.kv.num_kv_heads, d) >= 1
    assert k.bias.abs().max().item() <= ModelRunnerLevel() * 1.001
    for reset in r.kv_cache:             # a fresh pool for the second run
        for pool in reset:
            for t in pool.tensors():
                t.zero_()
    got, _ = _steps(r, [])
    assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-4) for g, w in zip(got, want))


def ModelRunnerLevel() -> float:
    from handler.model.runner import ModelRunner
    return ModelRunner.KEY_BIAS_LEVEL
