"""Shared fixtures: tiny models built locally once per test session (no hub)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """An environment where boto3 finds no credentials anywhere (env, files, instance metadata)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
