"""Our own Llama family (handler/model/llama.py) against transformers' models of the same checkpoints:
the runner picks ours for every family it covers, its logits equal transformers' on packed steps
(fp32, bit for bit), greedy output equals `model.generate` under every strategy, and
option.model_impl chooses between the two."""
from __future__ import annotations

import os
import pathlib

import pytest
import torch

from handler.engine.request import SamplingParams
from handler.engine.types import StepItem
from handler.model.runner import ModelLoadError, ModelRunner, pack_step
from tests.support.engine import NEW, PROMPTS, STRATEGIES, assert_drained, make_engine, run_all
from tests.support.reference import hf_greedy


def _cfg(cls, **kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2)
    base.update(kw)
    return lambda ids: getattr(__import__("transformers"), cls)(**base, **ids)


# Each family and each flag our forward has: biases, q/k norms, sliding windows, multipliers,
# fused checkpoint weights, post-norms, tied embeddings, and the rope_scaling kinds.
FAMILIES = {
    "llama": _cfg("LlamaConfig"),
    "smollm-tied": _cfg("LlamaConfig", tie_word_embeddings=True, num_key_value_heads=1),
    "mistral-window": _cfg("MistralConfig", sliding_window=5),
    "qwen2-bias": _cfg("Qwen2Config", tie_word_embeddings=False),
    "qwen3-qk-norm": _cfg("Qwen3Config", head_dim=16, tie_word_embeddings=True),
    "granite": _cfg("GraniteConfig", embedding_multiplier=3.0, attention_multiplier=0.2,
                    residual_multiplier=0.5, logits_scaling=2.0),
    "phi3-fused": _cfg("Phi3Config"),
    "olmo2-post-norms": _cfg("Olmo2Config"),
    # Gemma 3: 1 + weight norms around each sublayer, per-head q/k norms, GELU-tanh, sqrt(hidden) embeddings,
    # query_pre_attn_scalar, a 5-token window on local layers with their own rope theta, the global layer's
    # rope linearly scaled by 8 (transformers 5: rope_parameters per layer type), tied embeddings
    "gemma3": _cfg("Gemma3TextConfig", head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                   num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
    # Gemma 2: no q/k norms, one rope, attention and final logit soft-caps (small: the caps bite)
    "gemma2-softcaps": _cfg("Gemma2Config", head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                            layer_types=["sliding_attention", "full_attention"]),
}
ROPES = {
    "rope-linear": _cfg("LlamaConfig", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "rope-llama3": _cfg("LlamaConfig", rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    "rope-yarn": _cfg("LlamaConfig", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 256}),
    "rope-dynamic": _cfg("LlamaConfig", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                         "rope_theta": 10000.0}),
}


@pytest.fixture(scope="module")
def family_dirs(demo_model_dir, tmp_path_factory):
    """name -> a tiny random checkpoint of that family (safetensors + the demo tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    out = {}
    for name, make in {**FAMILIES, **ROPES}.items():
        path = str(tmp_path_factory.mktemp(name))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make(ids))
        if name == "qwen2-bias":   # random biases: zeros would not show a bias read wrongly
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = path
    return out


def _step_logits(runner: ModelRunner, seed: int = 0) -> list[torch.Tensor]:
    """Logits of two packed steps: two prompts (one spanning blocks), then a decode row each."""
    g = torch.Generator().manual_seed(seed)
    v = runner.model.config.vocab_size
    a, b = (torch.randint(0, v, (n,), generator=g).tolist() for n in (37, 5))
    p = SamplingParams(max_new_tokens=2)
    prefill, _ = pack_step([StepItem(0, a, 0, [0, 1, 2], True, p, a), StepItem(1, b, 0, [3], True, p, b)], 16)
    decode, _ = pack_step([StepItem(0, [7], 37, [0, 1, 2], True, p, a + [7]),
                           StepItem(1, [9], 5, [3], True, p, b + [9])], 16)
    return [runner.forward(prefill), runner.forward(decode)]     # as serving calls it: inference mode


@pytest.mark.parametrize("name", list(FAMILIES) + list(ROPES))
def test_our_forward_equals_transformers_bit_for_bit_in_fp32(name, family_dirs):
    ours = ModelRunner(family_dirs[name], dtype="fp32", device="cpu", kv_cache_tokens=128)
    theirs = ModelRunner(family_dirs[name], dtype="fp32", device="cpu", kv_cache_tokens=128,
                         model_impl="transformers")
    assert ours.own and type(ours.model).__name__ == "LlamaFamilyForCausalLM"
    assert not theirs.own
    for got, want in zip(_step_logits(ours), _step_logits(theirs)):
        assert got.shape == want.shape
        assert torch.equal(got, want), (name, (got - want).abs().max().item())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_generate_every_family_and_strategy(name, strategy, family_dirs, tmp_path):
    model_dir = family_dirs[name]
    engine = make_engine(model_dir, tmp_path, STRATEGIES[strategy])
    try:
        assert engine.runner.own
        results = run_all(engine, PROMPTS[:4], [SamplingParams(max_new_tokens=n) for n in NEW[:4]])
        for p, n, (ids, _) in zip(PROMPTS, NEW, results):
            assert ids == hf_greedy(model_dir, p, n), (name, strategy, p[:20])
        assert_drained(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", list(ROPES))
def test_greedy_parity_rope_scaling_kinds(name, family_dirs, tmp_path):
    model_dir = family_dirs[name]
    engine = make_engine(model_dir, tmp_path, STRATEGIES["paged"])
    try:
        results = run_all(engine, PROMPTS[:3], [SamplingParams(max_new_tokens=n) for n in NEW[:3]])
        for p, n, (ids, _) in zip(PROMPTS, NEW, results):
            assert ids == hf_greedy(model_dir, p, n), (name, p[:20])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_bf16_is_as_close_to_fp32_as_transformers_bf16(family_dirs, name):
    """bf16 rounds differently per implementation (fused norms, kernels): ours must stay as near
    to the fp32 logits as transformers' own bf16 model does (Gemma 3: its embedding scale rounded to
    bf16, its norms in fp32)."""
    def rel(got, want):
        return ((got.float() - want).norm() / want.norm()).item()

    want = _step_logits(ModelRunner(family_dirs[name], dtype="fp32", device="cpu", kv_cache_tokens=128))
    ours = ModelRunner(family_dirs[name], dtype="bf16", device="cpu", kv_cache_tokens=128)
    theirs = ModelRunner(family_dirs[name], dtype="bf16", device="cpu", kv_cache_tokens=128,
                         model_impl="transformers")
    assert ours.own and ours.model.lm_head.weight.dtype == torch.bfloat16
    for got, ref, w in zip(_step_logits(ours), _step_logits(theirs), want):
        assert rel(got, w) <= max(1.5 * rel(ref, w), 0.01), (rel(got, w), rel(ref, w))


def test_model_impl_chooses_and_other_architectures_fall_back(family_dirs, demo_model_factory, tmp_path):
    gpt2 = demo_model_factory("gpt2")
    runner = ModelRunner(gpt2, dtype="fp32", device="cpu", kv_cache_tokens=64)   # auto: transformers'
    assert not runner.own and type(runner.model).__name__ == "GPT2LMHeadModel"
    with pytest.raises(ModelLoadError, match=r"option.model_impl=lmi: .*model_type 'gpt2'"):
        ModelRunner(gpt2, dtype="fp32", device="cpu", kv_cache_tokens=64, model_impl="lmi")
    # the property reaches the runner
    engine = make_engine(family_dirs["llama"], tmp_path, {**STRATEGIES["paged"], "option.model_impl": "transformers"})
    try:
        assert not engine.runner.own
        (ids, _), = run_all(engine, PROMPTS[:1], [SamplingParams(max_new_tokens=5)])
        assert ids == hf_greedy(family_dirs["llama"], PROMPTS[0], 5)
    finally:
        engine.shutdown()


def test_a_checkpoint_that_disagrees_with_its_config_is_a_clear_load_error(family_dirs, tmp_path):
    import json
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(family_dirs["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight: checkpoint shape \[\d+, \d+\] does not fit \[\d+, 96\]|\[96, \d+\]"):
        ModelRunner(str(bad), dtype="fp32", device="cpu", kv_cache_tokens=64)


def test_no_module_reads_transformers_source():
    root = pathlib.Path(__file__).resolve().parents[2] / "handler"
    for path in root.rglob("*.py"):
        text = path.read_text()
        # parsing source is the model code's concern only (the protocols parse clients' pythonic tool calls)
        needles = ("inspect.getsource", "getsource(") + (("ast.parse(",) if "model" in path.parts else ())
        for needle in needles:
            assert needle not in text, f"{path.relative_to(root.parent)} uses {needle}"
    assert os.path.isfile(root / "model" / "llama.py")


@pytest.mark.parametrize("name", ["gemma3", "gemma2-softcaps"])
def test_gemma_stays_on_the_python_layers_and_the_load_log_says_why(name, family_dirs, caplog):
    """The C layer stack does not take Gemma's layer (1 + weight norms around each sublayer, GELU-tanh):
    the stack refuses it by name at load, one log line, and the Python layers serve it."""
    import logging

    from handler.model import cpu_stack
    with caplog.at_level(logging.INFO, logger="lmi.runner"):
        r = ModelRunner(family_dirs[name], dtype="fp32", device="cpu", kv_cache_tokens=128)
        r.prepack_cpu()     # as the server does: where the stack is decided
    assert r.own and r.model.decode_stack is None
    family = r.model.arch.family
    stack, why = cpu_stack.build(r.model, r.kv_cache)
    assert stack is None and why.startswith(f"{family}'s layer (1 + weight norms")
    said = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("CPU: a step's layers")]
    assert said == [f"CPU: a step's layers in Python ({why})"], said
