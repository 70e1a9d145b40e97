"""GGUF model files: where option.model_id / --model-dir may name one, and the errors for bad ones."""
from __future__ import annotations

import subprocess
import sys

import pytest

from handler.config import ConfigError, load_config
from handler.model.gguf import GGUFError, find_gguf, hf_dir_for
from tests.support.server import ROOT


def props(tmp_path, text: str) -> str:
    p = tmp_path / "serving.properties"
    p.write_text(text)
    return str(p)


def test_model_id_may_name_a_gguf_file_or_a_directory_holding_one(tmp_path):
    f = tmp_path / "m" / "tiny.Q8_0.gguf"
    f.parent.mkdir()
    f.write_bytes(b"GGUF")
    cfg = load_config(props(tmp_path, f"option.model_id={f}\n"), None, env={})
    assert cfg.model_dir == str(f)
    cfg = load_config(None, str(f.parent), env={})
    assert cfg.model_dir == str(f.parent) and find_gguf(cfg.model_dir) == str(f)
    (f.parent / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"holds 2 \.gguf files \(other\.gguf, tiny\.Q8_0\.gguf\); name one"):
        load_config(None, str(f.parent), env={})


def test_a_hugging_face_directory_is_loaded_as_it_is(demo_model_dir):
    assert hf_dir_for(demo_model_dir) == demo_model_dir


def test_an_unreadable_gguf_is_one_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    monkeypatch.setenv("LMI_MODEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(GGUFError, match="cannot read broken.gguf"):
        hf_dir_for(str(bad), "fp32", "cpu")
    r = subprocess.run([sys.executable, "-m", "handler", "serve", "--model-dir", str(bad), "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "LMI_MODEL_CACHE": str(tmp_path / "c")})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: transformers cannot read broken.gguf" in r.stderr and "Traceback" not in r.stderr


def test_a_replaced_gguf_file_leaves_no_stale_conversion_in_the_cache(tmp_path, monkeypatch):
    # Conversions are keyed by the file's path, size and mtime; once the file at a path changes, its
    # earlier conversions are unreachable whole models and go. Another file's conversions, the
    # current one in every dtype, and directories that are not finished conversions stay.
    import json
    import os

    src = tmp_path / "models" / "m-v.Q4_0.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF" + b"\0" * 60)
    other = tmp_path / "other" / "m-v.Q4_0.gguf"       # the same name elsewhere: not ours to drop
    other.parent.mkdir()
    other.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    monkeypatch.setenv("LMI_MODEL_CACHE", str(cache))

    def entry(name: str, gguf, dtype="fp32", size=None) -> str:
        d = cache / "gguf" / name
        d.mkdir(parents=True)
        if gguf is not None:
            stamp = {"gguf": str(gguf), "size": size if size is not None else os.path.getsize(gguf), "dtype": dtype}
            (d / "converted_from.json").write_text(json.dumps(stamp))
        return str(d)

    old = [entry("m-v.Q4_0-aaaaaaaaaaaa-fp32", src, size=3), entry("m-v.Q4_0-bbbbbbbbbbbb-bf16", src, "bf16", 3)]
    kept = [entry("m-v.Q4_0-cccccccccccc-fp32", other), entry("m-v.Q4_0-dddddddddddd-fp32", None)]
    # the live conversion, finished (its stamp matches): hf_dir_for reuses it without converting
    from handler.model.gguf import conversion_key
    name, fp = conversion_key(str(src))
    assert name == "m-v.Q4_0"
    live = entry(f"m-v.Q4_0-{fp}-fp32", src)
    live_bf16 = entry(f"m-v.Q4_0-{fp}-bf16", src, "bf16")
    assert hf_dir_for(str(src), "fp32", "cpu") == live
    assert not any(os.path.exists(d) for d in old)
    assert all(os.path.isdir(d) for d in kept + [live, live_bf16])


def test_conversion_stops_at_every_end_of_generation_token(real_gguf, tmp_path):
    # A GGUF file names one EOS (SmolLM2's <|im_end|>); the converted generation_config.json lists it
    # first, then the vocabulary's other end-of-generation special tokens (<|endoftext|>), as
    # llama.cpp stops at any of them; the runner stops at each.
    import json
    import os

    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from handler.model.gguf import convert_gguf
    from handler.model.runner import ModelRunner
    out = convert_gguf(real_gguf, str(tmp_path / "smollm2"), "bf16")
    f = GGUFReader(real_gguf).fields["tokenizer.ggml.eos_token_id"]
    file_eos = int(f.parts[f.data[0]][0])
    with open(os.path.join(out, "generation_config.json")) as fh:
        eos = json.load(fh)["eos_token_id"]
    tok = AutoTokenizer.from_pretrained(out)
    assert eos[0] == file_eos and len(eos) == len(set(eos))
    assert {"<|im_end|>", "<|endoftext|>"} <= set(tok.convert_ids_to_tokens(eos))
    r = ModelRunner(out, dtype="bf16", device="cpu", kv_cache_tokens=64)
    assert set(eos) <= r.eos_token_ids


def test_qwen_generation_config_gains_endoftext(tmp_path):
    # Qwen's own generation_config.json ends at <|im_end|> and <|endoftext|>; its GGUF names only the first.
    import json
    import shutil
    from pathlib import Path

    from handler.model.gguf import write_end_of_generation
    src = Path(__file__).resolve().parents[2] / ".cache" / "models" / "qwen2.5-coder-0.5b"
    if not (src / "tokenizer.json").is_file():
        pytest.skip(f"{src} is absent; build it with: python -m handler build-demo-model --family "
                    "qwen2.5-coder-0.5b .cache/models/qwen2.5-coder-0.5b")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151645}))
    assert write_end_of_generation(str(tmp_path)) == [151645, 151643]
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    assert write_end_of_generation(str(tmp_path)) == [151645, 151643]      # once only
