"""A replica's answers follow its serving.properties, whatever its environment (handler/config/numerics.py).

Two loads of the engine from the same properties file, one under an empty environment of the old
numerics variables and one with LMI_CPU_Q_ACT8 / LMI_QUANT_HEAD / LMI_QUANT_PACKED_CODES set against the
file, give the same packed layers (the int8-activation flag and code width each pack carries, the head
quantized or not) and the same greedy tokens. Each load is what `serve` does in a fresh process
(handler/server.py: load_config over os.environ, then build_engine), with the C library reloaded in
between as a new process would load it: two servers over HTTP would add only the HTTP layer, which
has no say in the numbers, at ten times the start-up cost."""
from __future__ import annotations

import os

import pytest

from handler.config import load_config
from handler.engine.request import SamplingParams
from handler.model.quant_int4 import GroupedPack, is_grouped
from handler.server import build_engine
from kernels import cpu as cpu_ext
from tests.support.engine import NEW, PROMPTS, STRATEGIES, run_all

pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
from tests.model.test_gguf_blocks import tiny_qwen2_gguf  # noqa: E402,F401 (a fixture)

OLD = ("LMI_CPU_Q_ACT8", "LMI_QUANT_HEAD", "LMI_QUANT_PACKED_CODES")


def _serve(model_dir, tmp_path, props, env, monkeypatch):
    """(each grouped layer's (name, act8, bits), the head's kind, the greedy tokens) of one load under `env`."""
    for name in OLD:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cpu_ext.load.cache_clear()          # as a new process: the library loaded (and its environment read) again
    path = tmp_path / "serving.properties"
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    cfg = load_config(str(path), model_dir, env=os.environ)
    engine = build_engine(cfg)
    try:
        model = engine.runner.model
        packs = sorted((n, m.pack.qpack.act8, m.pack.bits) for n, m in model.named_modules()
                       if is_grouped(m) and isinstance(m.pack, GroupedPack))
        head = type(getattr(model.get_output_embeddings(), "pack", None)).__name__     # NoneType: a plain layer
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW[:3]]
        tokens = [ids for ids, _ in run_all(engine, PROMPTS[:3], params)]
    finally:
        engine.shutdown()
        cpu_ext.load.cache_clear()
    return packs, head, tokens, cfg.warnings


needs_q = pytest.mark.skipif(not cpu_ext.gemm_q_available(), reason="kernels/cpu_gemm_q4.c does not run here")


@needs_q
@pytest.mark.parametrize("act8,layout,env", [
    ("exact", "bytes", {"LMI_CPU_Q_ACT8": "1", "LMI_QUANT_PACKED_CODES": "1"}),
    ("int8", "packed", {"LMI_CPU_Q_ACT8": "0", "LMI_QUANT_PACKED_CODES": "0"})])
def test_a_gguf_replica_answers_as_its_file_says_whatever_its_environment(tiny_qwen2_gguf, tmp_path, monkeypatch,
                                                                         act8, layout, env):
    props = {**STRATEGIES["paged"], "option.dtype": "fp32", "option.quantize": "gguf",
             "option.cpu_grouped_activations": act8, "option.grouped_code_layout": layout}
    packs, head, tokens, _ = _serve(tiny_qwen2_gguf, tmp_path, props, {}, monkeypatch)
    packs2, head2, tokens2, warned = _serve(tiny_qwen2_gguf, tmp_path, props, env, monkeypatch)
    assert packs and packs2 == packs and head2 == head and tokens2 == tokens
    assert {a for _, a, _ in packs} == {act8 == "int8"}                     # the file's choice, in every pack
    assert ({5, 6} <= {b for *_, b in packs}) == (layout == "packed")
    assert sum("is no longer read" in w for w in warned) == len(env)


@needs_q
def test_a_w8a16_replica_quantizes_the_head_as_its_file_says_whatever_its_environment(demo_model_dir, tmp_path,
                                                                                      monkeypatch):
    props = {**STRATEGIES["paged"], "option.dtype": "fp32", "option.quantize": "int8_weight_only"}
    for setting, env in (("auto", {"LMI_QUANT_HEAD": "0"}), ("false", {"LMI_QUANT_HEAD": "1"})):
        props["option.quantize_head"] = setting
        packs, head, tokens, _ = _serve(demo_model_dir, tmp_path, props, {}, monkeypatch)
        packs2, head2, tokens2, _ = _serve(demo_model_dir, tmp_path, props, env, monkeypatch)
        assert head == head2 and (head == "GroupedPack") == (setting == "auto")
        assert packs2 == packs and tokens2 == tokens
