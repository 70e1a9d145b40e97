"""Greedy parity of every strategy on the model's own device and dtype: on CUDA (fp32 and bf16)
and, as the CPU counterpart, bf16 on CPU; the oracle is `model.generate` on the same device and
in the same dtype. bf16 (and, rarely, fp32 in another summation order) may flip a near-tie: the
first token where the streams part must be one (tests/support/reference.near_tie_divergence)."""
from __future__ import annotations


import pytest
import torch

from handler.engine.request import SamplingParams
from tests.support.reference import greedy_ids, model_on, near_tie_divergence
from tests.support.engine import NEW, PROMPTS, STRATEGIES, make_engine, run_all

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NOISE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
DEVICES = [pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
           pytest.param("cuda", torch.float32, id="cuda-fp32", marks=[pytest.mark.gpu, needs_cuda]),
           pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=[pytest.mark.gpu, needs_cuda])]
DTYPE_KEY = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def check_parity(model_dir, tmp_path, props, device, dtype, prompts, news):
    """Run `prompts` through an engine on (device, dtype); returns (exact matches, outputs)."""
    engine = make_engine(model_dir, tmp_path, {**props, "option.device": device,
                                               "option.dtype": DTYPE_KEY[dtype]})
    try:
        assert engine.runner.device.type == device and engine.runner.dtype == dtype
        tok, model = model_on(model_dir, device, dtype)
        results = run_all(engine, prompts, [SamplingParams(max_new_tokens=n) for n in news])
    finally:
        engine.shutdown()
    exact = 0
    for p, n, (got, _) in zip(prompts, news, results):
        ids = tok(p)["input_ids"]
        want = greedy_ids(model, tok, ids, n)
        why = near_tie_divergence(model, ids, want, got, NOISE[dtype])
        assert why is None, (p[:30], why)
        exact += got == want
    return exact, [got for got, _ in results]


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_greedy_parity_on_the_models_device_and_dtype(strategy, family, device, dtype,
                                                      demo_model_factory, tmp_path):
    exact, _ = check_parity(demo_model_factory(family), tmp_path, STRATEGIES[strategy], device, dtype,
                            PROMPTS, NEW)
    # Near-ties are rare: most streams match token for token.
    assert exact >= len(PROMPTS) // 2, f"only {exact} of {len(PROMPTS)} streams equal generate's"


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_runs_triton_kernels():
    import kernels
    assert kernels.triton_available(), "triton does not import on this CUDA machine"


CHAT = ["What is the capital of France?", "Name the three primary colors.",
        "Write a haiku about the sea.", "What is 12 times 12?"]


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("strategy", ["paged", "rolling", "dynamic"])
def test_real_smollm2_answers_like_generate(strategy, device, dtype, real_gguf, tmp_path_factory, tmp_path):
    # From the GGUF in bf16 (the dtype a GPU serves it in), on the device the parameter names.
    from handler.model.gguf import convert_gguf
    model_dir = str(tmp_path_factory.getbasetemp() / "smollm2-bf16")
    convert_gguf(real_gguf, model_dir, "bf16")
    tok, _ = model_on(model_dir, device, dtype)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in CHAT]
    props = {**STRATEGIES[strategy], "option.kv_cache_tokens": "4096", "option.max_rolling_batch_prefill_tokens": "512"}
    exact, outs = check_parity(model_dir, tmp_path, props, device, dtype, prompts, [40] * len(CHAT))
    assert exact >= len(CHAT) // 2
    assert "Paris" in tok.decode(outs[0]), tok.decode(outs[0])
