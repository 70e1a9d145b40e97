"""Hub model ids (handler/model/hf_hub.py) against a local hub (tests/support/fake_hub.py) reached through
HF_ENDPOINT: what is fetched, where, with which revision and token; offline starts from the cache; every
failure one line naming the id. huggingface_hub reads its variables at import, so each fetch runs in a
fresh interpreter, as the server's start-up does; the last test is a SageMaker SDK style deployment
(HF_MODEL_ID, no model directory) of a real server."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import requests

from handler.config import ConfigError, load_config
from tests.support.fake_hub import FakeHub
from tests.support.server import Server

REPO = pathlib.Path(__file__).resolve().parents[2]
FETCH = ("import json, sys\nfrom handler.model.hf_hub import HubModelError, resolve_model_dir\n"
         "try:\n    print(json.dumps({'path': resolve_model_dir(sys.argv[1], sys.argv[2] or None)}))\n"
         "except HubModelError as e:\n    print(json.dumps({'error': str(e)}))\n")


@pytest.fixture(scope="module")
def hub(demo_model_factory, tmp_path_factory):
    """The demo model as org/tiny (with files serving does not need beside it) and org/private (HF_TOKEN)."""
    src = tmp_path_factory.mktemp("hub-src")
    for f in os.listdir(demo_model_factory("llama")):
        shutil.copy(os.path.join(demo_model_factory("llama"), f), src / f)
    (src / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    (src / "model.Q4_0.gguf").write_bytes(b"GGUF")
    (src / "README.md").write_text("# tiny\n")
    with FakeHub() as h:
        h.add("org/tiny", str(src))
        h.add("org/private", str(src), token="hf_secret")
        h.src = src
        yield h


def fetch(hub, cache, model_id, revision="", **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OPTION_", "LMI_MODEL_CACHE"))}
    r = subprocess.run([sys.executable, "-c", FETCH, model_id, revision], capture_output=True, text=True,
                       cwd=REPO, timeout=120,
                       env={**clean, "HF_ENDPOINT": hub.url, "LMI_MODEL_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
                            "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fetches_only_what_serving_needs_into_the_model_cache(hub, tmp_path):
    out = fetch(hub, tmp_path, "org/tiny")
    path = pathlib.Path(out["path"])
    assert path.is_relative_to(tmp_path / "hub")
    got = sorted(p.name for p in path.iterdir())
    skipped = ("pytorch_model.bin", "model.Q4_0.gguf", "README.md", "DEMO_MODEL.json")   # not read to serve
    want = sorted(n for n in os.listdir(hub.src) if n not in skipped)
    assert got == want and "model.safetensors" in got and "config.json" in got
    for name in got:
        assert (path / name).read_bytes() == (hub.src / name).read_bytes(), name
    assert not any(p.endswith(skipped) for _m, p, _a in hub.requests)
    # Offline (HF_HUB_OFFLINE=1), the cached snapshot serves, and nothing is asked of the hub.
    asked = len(hub.requests)
    assert fetch(hub, tmp_path, "org/tiny", HF_HUB_OFFLINE="1") == out
    assert len(hub.requests) == asked


def test_revision_and_token(hub, tmp_path):
    sha = hub.repos["org/tiny"]["sha"]
    assert pathlib.Path(fetch(hub, tmp_path, "org/tiny", sha)["path"]).name == sha
    err = fetch(hub, tmp_path, "org/tiny", "v9")["error"]
    assert err == f"option.revision=v9: no such revision of hub model org/tiny at {hub.url}"
    err = fetch(hub, tmp_path, "org/private")["error"]
    assert err.startswith("hub model org/private not found at") and "HF_TOKEN" in err
    out = fetch(hub, tmp_path, "org/private", HF_TOKEN="hf_secret")
    assert (pathlib.Path(out["path"]) / "config.json").is_file()
    assert ("GET", "/api/models/org/private/revision/main", "Bearer hf_secret") in hub.requests


@pytest.mark.parametrize("model_id, env, needle", [
    ("org/unknown", {}, "hub model org/unknown not found at"),
    ("org/tiny", {"HF_ENDPOINT": "http://127.0.0.1:9"}, "hub model org/tiny: the hub at http://127.0.0.1:9 "
                                                         "cannot be reached and"),
    ("org/tiny", {"HF_HUB_OFFLINE": "1"}, "hub model org/tiny: HF_HUB_OFFLINE is set and"),
])
def test_failures_are_one_line_naming_the_id(model_id, env, needle, hub, tmp_path):
    err = fetch(hub, tmp_path, model_id, **env)["error"]
    assert needle in err and "\n" not in err


def test_config_takes_hub_ids_and_still_refuses_paths(tmp_path):
    cfg = load_config(None, str(tmp_path), env={"HF_MODEL_ID": "org/tiny", "HF_REVISION": "v1"}, gpu_count=0)
    assert (cfg.model_id, cfg.model_dir, cfg.revision) == ("org/tiny", "", "v1")
    for bad in ("../absent", "./absent", "/abs/absent", "a--b/c"):
        with pytest.raises(ConfigError) as e:
            load_config(None, str(tmp_path), env={"OPTION_MODEL_ID": bad}, gpu_count=0)
        assert "neither a local directory, an s3:// URI nor a hub model id" in str(e.value)


@pytest.mark.slow
def test_sagemaker_sdk_style_deployment_from_the_hub(hub, tmp_path):
    """HuggingFaceModel(env={"HF_MODEL_ID": ..., "SM_NUM_GPUS": ...}): no model directory, no properties."""
    empty = tmp_path / "opt-ml-model"
    empty.mkdir()
    srv = Server("", str(empty), tmp_path,
                 env={"HF_MODEL_ID": "org/tiny", "SM_NUM_GPUS": "1", "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0",
                      "LMI_MODEL_CACHE": str(tmp_path / "cache"), "OPTION_MAX_MODEL_LEN": "128"})
    try:
        r = srv.post({"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 4, "details": True}})
        assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 4
        assert "LMI behaviour line current" in srv.output()
        assert "model org/tiny: fetching from the hub" in srv.output()
        assert requests.get(srv.url + "/ping").json()["strategy"] == "paged"
    finally:
        srv.stop()
