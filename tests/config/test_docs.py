"""One declaration per key and per switch: the generated docs blocks match the declarations
(handler/config/schema.py, handler/config/switches.py), the declarations match ServingConfig, and
every LMI_* variable the code reads is declared."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil

import pytest

from handler.config import ENV_ALIASES, IGNORED_KEYS, KNOWN_KEYS, TYPED_KEYS, ServingConfig, load_config
from handler.config import docs
from handler.config.numerics import LEGACY_ENV
from handler.config.schema import ALIASES, KEYS, SCHEMA
from handler.config.switches import SWITCHES, switch

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_generated_docs_blocks_match_the_schema():
    # docs/PROPERTIES.md always; README.md's summary when its markers are there.
    problems = docs.sync(str(REPO), write=False)
    assert problems == [], ("\n".join(problems) + "\nregenerate with: python -m handler.config.docs --write")


def test_readme_without_markers_is_skipped_and_a_stale_block_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "docs" / "PROPERTIES.md", tmp_path / "docs" / "PROPERTIES.md")
    (tmp_path / "README.md").write_text("# no markers here\n")
    assert docs.sync(str(tmp_path)) == []
    (tmp_path / "README.md").write_text("x\n<!-- properties-summary:begin -->\nold\n<!-- properties-summary:end -->\ny\n")
    assert docs.sync(str(tmp_path)) == ["README.md: block properties-summary is stale"]
    assert docs.sync(str(tmp_path), write=True) == ["README.md: block properties-summary is stale"]
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("x\n<!-- properties-summary:begin -->\n| key | default | environment variable |\n")
    assert text.endswith("| (port) | `8080` | `SAGEMAKER_BIND_TO_PORT` |\n<!-- properties-summary:end -->\ny\n")
    assert docs.sync(str(tmp_path)) == []
    # docs/PROPERTIES.md must keep its markers
    (tmp_path / "docs" / "PROPERTIES.md").write_text("# reference\n")
    assert "docs/PROPERTIES.md: no <!-- properties:begin --> / <!-- properties:end --> markers" in docs.sync(str(tmp_path))


def test_docs_cli(tmp_path, capsys):
    assert docs.main(["--check"]) == 0
    assert docs.main(["--print", "properties-summary"]) == 0
    assert "| `option.max_rolling_batch_size` | 256 (0.26: 32) | `OPTION_MAX_ROLLING_BATCH_SIZE`, `MAX_BATCH_SIZE` |" \
        in capsys.readouterr().out


def test_public_tables_are_derived_from_the_schema():
    assert list(TYPED_KEYS) == [k.name for k in KEYS]
    assert KNOWN_KEYS == set(TYPED_KEYS) | IGNORED_KEYS
    assert sorted(ENV_ALIASES) == sorted((v, k.name) for k in KEYS for v in k.env)
    # per key, the aliases' precedence: the first one set wins
    assert [v for v, k in ENV_ALIASES if k == "option.tensor_parallel_degree"] == ["TENSOR_PARALLEL_DEGREE",
                                                                                   "SM_NUM_GPUS"]
    assert ALIASES == {"option.model_id": ("option.s3url",), "request_timeout": ("option.predict_timeout",),
                       "option.max_rolling_batch_prefill_tokens": ("option.max_num_batched_tokens",),
                       "option.quantize": ("option.quantization",)}


def test_every_key_field_is_a_serving_config_field_with_the_schemas_default(tmp_path):
    fields = {f.name: f for f in dataclasses.fields(ServingConfig)}
    for k in KEYS:
        if k.field_name:
            assert k.field_name in fields, k.name
            f = fields[k.field_name]
            if f.default is not dataclasses.MISSING and k.default is not None:
                assert f.default == k.default, k.name
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(None, str(tmp_path), env={}, check_model=False, gpu_count=0)
    for k in KEYS:
        if k.field_name and k.default is not None:
            assert getattr(cfg, k.field_name) == k.default, k.name


def test_every_lmi_variable_read_in_the_code_is_a_declared_switch():
    literal = re.compile(r"""["'](LMI_[A-Z0-9_]+)["']""")
    found = {}
    for top in ("handler", "kernels"):
        for path in (REPO / top).rglob("*.py"):
            for name in literal.findall(path.read_text()):
                found.setdefault(name, path.relative_to(REPO).as_posix())
    # (the retired numerics variables are only warned about: handler/config/numerics.py LEGACY_ENV)
    undeclared = {n: p for n, p in found.items() if n not in SWITCHES and n not in LEGACY_ENV}
    assert not undeclared, f"declare these in handler/config/switches.py: {undeclared}"
    for s in SWITCHES.values():
        readers = [REPO / p.strip() for p in s.read_by.split(",")]
        assert any(s.name in r.read_text() for r in readers), (s.name, s.read_by)


def test_switch_reads_the_environment_at_call_time(monkeypatch):
    monkeypatch.delenv("LMI_BENCH_EOS_AFTER", raising=False)
    assert switch("LMI_BENCH_EOS_AFTER") is False
    for on in ("1", " True ", "yes"):
        monkeypatch.setenv("LMI_BENCH_EOS_AFTER", on)
        assert switch("LMI_BENCH_EOS_AFTER") is True
    for off in ("0", " False ", "no", "OFF"):
        monkeypatch.setenv("LMI_BENCH_EOS_AFTER", off)
        assert switch("LMI_BENCH_EOS_AFTER") is False
    monkeypatch.delenv("LMI_CPU_HUGEPAGES", raising=False)
    assert switch("LMI_CPU_HUGEPAGES") == "auto"
    monkeypatch.delenv("LMI_CPU_MALLOC", raising=False)
    assert switch("LMI_CPU_MALLOC") == "tcmalloc"
    monkeypatch.setenv("LMI_CPU_MALLOC", " System ")
    assert switch("LMI_CPU_MALLOC") == "system"
    assert switch("LMI_HTTP_WORKER", {"LMI_HTTP_WORKER": ""}) == ""      # the reader decides (gevent)
    assert switch("LMI_TP_TIMEOUT_S", {}) == 600.0
    assert switch("LMI_TP_TIMEOUT_S", {"LMI_TP_TIMEOUT_S": "12.5"}) == 12.5
    assert switch("LMI_TP_TIMEOUT_S", {"LMI_TP_TIMEOUT_S": "soon"}) == 600.0
    assert switch("LMI_MODEL_CACHE", {"LMI_MODEL_CACHE": ""}) == "/tmp/lmi-serve/models"
    assert switch("LMI_TP_MASTER_PORT", {}) is None
    with pytest.raises(KeyError):
        switch("LMI_NOT_DECLARED")


def test_enumerated_keys_name_their_allowed_values():
    assert SCHEMA["option.rolling_batch"].allowed == ("auto", "scheduler", "lmi-dist", "vllm", "disable")
    assert SCHEMA["option.enable_lora"].allowed == ("true", "false")
    assert SCHEMA["batch_size"].allowed == ()
    assert SCHEMA["engine"].explicit_env == ("SERVING_ENGINE", "OPTION_ENGINE")
    assert SCHEMA["option.entryPoint"].explicit_env == ("OPTION_ENTRYPOINT",)


def test_readme_is_a_front_page_under_16_kb_and_names_python_3_11():
    data = (REPO / "README.md").read_bytes()
    assert len(data) < 16_000, f"README.md is {len(data)} bytes; move detail into docs/"
    assert b"Python 3.11+" in data and b"3.10" not in data
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11"' in pyproject
