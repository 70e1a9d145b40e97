"""A property-based fuzzer driven by /openapi.json (schemathesis, every check, none excluded): a body valid
against the document is accepted and an invalid one refused, every status is one the document declares for
the route, every answer has the declared content type, 405s carry `Allow`, nothing is a 500, and no request
leaves the server unanswered.

The one exception is a refusal for a rule across fields that JSON Schema cannot state (a comparison of two
values, or the loaded chat template's roles): tests/support/fuzz_hooks.py names each rule, and drops a
positive_data_acceptance failure only when the answer carries that rule's message and the body sent really
breaks it (docs/API.md "Rules across fields"); and /invocations' lax line (numbers and flags as vLLM's lax
models read them) is excused only where the body, so read, is valid. LMI_FUZZ_PATHS (a regular expression over paths) narrows a
run while working on the document.

The server is the real one (gunicorn) on the tiny demo model, its length capped so that a body without
max tokens generates quickly; the document it serves is bounded by that model's vocabulary and length."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.server import ROOT, Server

pytestmark = pytest.mark.slow
pytest.importorskip("schemathesis", reason="the fuzzer: pip install -e '.[dev]'")

PROPERTIES = ("option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=8\n"
              "option.max_model_len=64\n")


@pytest.fixture(scope="module")
def srv(demo_model_dir, tmp_path_factory):
    s = Server(PROPERTIES, demo_model_dir, tmp_path_factory.mktemp("fuzz"))
    yield s
    s.stop()


def test_the_document_is_bounded_by_the_loaded_model(srv, demo_model_dir):
    import re

    import requests
    from transformers import AutoTokenizer
    doc = requests.get(srv.url + "/openapi.json", timeout=30).json()
    params = doc["components"]["schemas"]["Parameters"]["properties"]
    vocab = len(AutoTokenizer.from_pretrained(demo_model_dir))
    assert params["max_new_tokens"]["anyOf"][0]["maximum"] == 63           # option.max_model_len - 1
    ids = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert [a["items"]["maximum"] for a in ids if a.get("items", {}).get("type") == "integer"] == [vocab - 1]
    key = re.compile(params["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"])
    assert key.match(str(vocab - 1)) and not key.match(str(vocab)) and not key.match("007")


def test_schemathesis_finds_nothing(srv, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    cmd = [exe, "run", srv.url + "/openapi.json", "--checks", "all",
           "--phases", "examples,coverage,fuzzing", "--max-examples", "12", "--seed", "20261128",
           "--request-timeout", "120", "--max-response-time", "120", "--output-sanitize", "false",
           "--suppress-health-check", "all", "--workers", "1"]   # hypothesis describes lambdas unsafely in threads
    if os.environ.get("LMI_FUZZ_PATHS"):
        cmd += ["--include-path-regex", os.environ["LMI_FUZZ_PATHS"]]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.support.fuzz_hooks", "PYTHONPATH": ROOT,
           "LMI_FUZZ_EXCUSED": str(tmp_path / "excused.tsv")}      # what the hook excused, rule by rule
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = r.stdout + r.stderr
    (tmp_path / "schemathesis.log").write_text(out)
    assert r.returncode == 0, out[-6000:]
