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
