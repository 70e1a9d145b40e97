"""The LoRA management routes' `src`: only <model dir>/adapters/, option.adapter_roots
and their s3:// prefixes; everything else is the same 403, before anything is read, whether the
path exists or not; option.enable_lora_management=false turns the routes off."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from handler.config import load_config
from handler.http.adapter_src import SrcRefused, resolve


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    (d / "adapters" / "a1").mkdir(parents=True)
    (d / "adapters" / "a1" / "adapter_config.json").write_text("{}")
    (tmp_path / "outside" / "adapter").mkdir(parents=True)
    (tmp_path / "outside" / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "extra" / "a9").mkdir(parents=True)
    os.symlink(tmp_path / "outside" / "adapter", d / "adapters" / "escape")
    os.symlink("/etc", d / "adapters" / "etc")
    os.symlink(d / "adapters" / "a1", tmp_path / "extra" / "inside-link")
    return d


def test_resolve_allows_the_adapters_dir_and_the_configured_roots(model, tmp_path):
    real = os.path.realpath
    assert resolve("a1", str(model)) == real(model / "adapters" / "a1")
    assert resolve(str(model / "adapters" / "a1"), str(model)) == real(model / "adapters" / "a1")
    assert resolve("missing", str(model)) == real(model / "adapters" / "missing")   # inside: read later
    roots = (str(tmp_path / "extra"), "s3://Bucket/adapters/")
    assert resolve(str(tmp_path / "extra" / "a9"), str(model), roots) == real(tmp_path / "extra" / "a9")
    assert resolve("s3://bucket/adapters/a1/", str(model), roots) == "s3://bucket/adapters/a1"


@pytest.mark.parametrize("src", [
    "/etc", "/proc/self", "/proc/self/environ", "../../", "../model/adapters/a1", "a1/../../..",
    "/definitely/not/here", "escape", "etc", "etc/passwd", "", "a1\x00", "..\\..\\windows",
    "s3://bucket/adapters/a1", "s3://other/x", "s3://bucket/adapters/../secret",
])
def test_resolve_refuses_everything_else_the_same_way(model, tmp_path, src):
    roots = (str(tmp_path / "extra"), "s3://bucket/adapters/") if src.startswith("s3://bucket/adapters/..") else ()
    with pytest.raises(SrcRefused) as e:
        resolve(src, str(model), roots)
    assert "is not allowed" in str(e.value) and "option.adapter_roots" in str(e.value)


def test_a_root_itself_is_not_an_adapter_of_the_model_dir_and_symlinks_inside_stay_allowed(model, tmp_path):
    with pytest.raises(SrcRefused):
        resolve(str(model / "adapters"), str(model))
    # A link from a configured root into the model's adapters leaves the root that admitted it.
    with pytest.raises(SrcRefused):
        resolve(str(tmp_path / "extra" / "inside-link"), str(model), (str(tmp_path / "extra"),))


class FakeLora:
    def __init__(self):
        self.calls = []

    def register(self, name, src):
        self.calls.append((name, src))
        from handler.model.lora import AdapterError
        if not src.startswith("s3://") and not os.path.isdir(src):
            raise AdapterError(f"adapter {name!r} ({src}): no such directory")

    def list(self):
        return []


def app_client(model, props=""):
    from handler.http.app import ServerState, create_app
    path = model.parent / "serving.properties"
    path.write_text("option.enable_lora=true\n" + props)
    state = ServerState(load_config(str(path), str(model), env={}, check_model=False))
    lora = FakeLora()
    state.engine = SimpleNamespace(runner=SimpleNamespace(lora=lora), tokenizer=None, healthy=True)
    return create_app(state).test_client(), lora


def test_the_route_gives_one_403_for_existing_and_missing_paths_and_reads_nothing(model, tmp_path):
    client, lora = app_client(model)
    route = f"/models/{model.name}/adapters"
    answers = set()
    for src in ["/etc", "/no/such/dir", "/proc/self", "/proc/nope", "../../", "../../nope", "escape",
                str(tmp_path / "outside" / "adapter"), str(tmp_path / "outside" / "missing"),
                "s3://bucket/prefix/"]:
        r = client.post(route, query_string={"name": "x", "src": src})
        assert r.status_code == 403 and r.json["field"] == "src", (src, r.json)
        answers.add(r.json["error"].replace(src, "SRC"))
    assert len(answers) == 1                      # the same answer whatever exists
    assert lora.calls == []                       # nothing was handed on to be read
    r = client.post(route, query_string={"name": "ok", "src": "a1"})
    assert r.status_code == 200 and lora.calls == [("ok", os.path.realpath(model / "adapters" / "a1"))]


def test_configured_roots_and_s3_prefixes_are_allowed(model, tmp_path):
    client, lora = app_client(model, f"option.adapter_roots={tmp_path / 'extra'},s3://bucket/adapters\n")
    r = client.post("/adapters", query_string={"name": "b", "src": str(tmp_path / "extra" / "a9")})
    assert r.status_code == 200, r.json
    r = client.post("/adapters", query_string={"name": "c", "src": "s3://bucket/adapters/c/"})
    assert r.status_code == 200, r.json
    assert lora.calls[-1] == ("c", "s3://bucket/adapters/c")
    r = client.post("/adapters", query_string={"name": "d", "src": "s3://bucket/elsewhere/"})
    assert r.status_code == 403


def test_management_routes_turned_off(model):
    client, lora = app_client(model, "option.enable_lora_management=false\n")
    for r in (client.post("/adapters", query_string={"name": "x", "src": "a1"}), client.get("/adapters"),
              client.get(f"/models/{model.name}/adapters/x"), client.delete("/adapters/x")):
        assert r.status_code == 404 and "option.enable_lora_management=false" in r.json["error"]
    assert lora.calls == []


def test_adapter_roots_property_is_checked(model):
    from handler.config import ConfigError
    for bad in ("relative/dir", "/a/../b", "s3://"):
        with pytest.raises(ConfigError, match="option.adapter_roots"):
            load_config(None, str(model), env={"OPTION_ADAPTER_ROOTS": bad}, check_model=False)
