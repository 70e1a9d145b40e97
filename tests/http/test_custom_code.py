"""LMI's custom code contract (handler/http/custom.py, the djl_python package): a model directory's model.py
with @input_formatter / @output_formatter around the built-in handler, or handle(inputs) in its place.

The model.py files are LMI's documented examples and integration-test files, unchanged
(tests/http/lmi_examples/README.md names each source: djl-serving serving/docs/lmi/user_guides/
input_formatter_schema.md, output_formatter_schema.md, serving/docs/modes.md,
tests/integration/examples/custom_formatters/, custom_handlers/). Requests go through Flask's test client
against the real app and engine with a fake runner (test_hardening.make_app); the start-up failures
through `python -m handler serve`."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from handler.http import custom
from tests.http.test_hardening import assert_json_error, make_app

EXAMPLES = pathlib.Path(__file__).parent / "lmi_examples"
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def app(demo_model_factory, tmp_path_factory):
    """One app (fake runner) whose custom code each test sets."""
    state, client = make_app(demo_model_factory("llama"), tmp_path_factory.mktemp("custom"), "",
                             max_model_len=1024)
    yield state, client
    state.engine.runner.hold.set()
    state.engine.shutdown()


def use(state, example: str, properties: dict | None = None, entry_point="djl_python.huggingface",
        explicit=False):
    state.custom = custom.load(str(EXAMPLES / example), entry_point, explicit, properties or {})
    return state.custom


def post(client, body, **kw):
    return client.post("/invocations", data=json.dumps(body), content_type="application/json", **kw)


# ---- formatters around the built-in handler -------------------------------------------------
def test_documented_base_formatters(app):
    state, client = app
    code = use(state, "formatters_base")
    assert code.handle is None and code.input_formatter.where.startswith("model.py:6 custom_input_formatter")
    before = int(time.time())
    # The input formatter renames inputPrompt and defaults max_new_tokens to 256 (fake model: no EOS).
    r = post(client, {"inputPrompt": "What is Deep Learning?", "parameters": {"details": True}})
    assert r.status_code == 200, r.get_data(as_text=True)
    out = r.get_json()
    assert out["details"]["generated_tokens"] == 256
    assert out["custom_formatter_applied"] is True and before <= out["formatter_timestamp"] <= time.time()
    assert out["generated_text"].startswith("[BASE] ")
    assert out["original_length"] == len(out["generated_text"]) - len("[BASE] ")
    # A request's own max_new_tokens stays (setdefault); streamed, each line goes through the formatter.
    r = post(client, {"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 3}, "stream": True})
    lines = [json.loads(x) for x in r.get_data(as_text=True).splitlines()]
    assert len(lines) == 3 and "generated_text" not in lines[0]
    assert lines[-1]["generated_text"].startswith("[BASE] ") and lines[-1]["custom_formatter_applied"]
    # Chat bodies pass through the input formatter too (and their answers have no generated_text).
    r = post(client, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and "custom_formatter_applied" not in r.get_json()
    state.custom = None


def test_documented_adapter_formatters_replace_the_models(app, monkeypatch):
    from handler.http.routes import common
    state, client = app
    use(state, "formatters_base")
    state.adapter_custom = custom.load_adapters(str(EXAMPLES / "formatters_base"), {})
    assert list(state.adapter_custom) == ["my_adapter"]
    seen = []
    # LoRA is off in this app: the request runs on the base model, the choice of formatters is what is tested.
    monkeypatch.setattr(common, "pick_adapter", lambda client_, gen, cfg: seen.append((gen.prompts, gen.params)))
    r = post(client, {"inputs": "hi", "adapters": "my_adapter"})
    assert r.status_code == 200, r.get_data(as_text=True)
    out = r.get_json()
    assert seen[0][0] == ["[ADAPTER_PREFIX] hi"] and seen[0][1].max_new_tokens == 512
    assert seen[0][1].temperature == 0.7 and seen[0][1].do_sample       # current LMI: temperature samples
    assert out["adapter_name"] == "my_adapter" and out["generated_text"].startswith("[ADAPTER] ")
    assert "custom_formatter_applied" not in out
    # SageMaker's adapter header picks it too; another adapter (or none) gets the model's formatters.
    r = post(client, {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
             headers={"X-Amzn-SageMaker-Adapter-Identifier": "my_adapter"})
    assert r.get_json()["adapter_name"] == "my_adapter"
    r = post(client, {"inputs": "hi", "adapters": "other", "parameters": {"max_new_tokens": 2}})
    assert r.get_json()["custom_formatter_applied"] is True and "adapter_name" not in r.get_json()
    state.custom, state.adapter_custom = None, {}


@pytest.mark.parametrize("example, message", [
    ("input_formatter_failed", "Input formatter intentionally failed"),
    ("output_formatter_failed", "Output formatter intentionally failed"),
])
def test_a_raising_formatter_is_424_naming_it(example, message, app, caplog):
    state, client = app
    use(state, example)
    with caplog.at_level("ERROR", logger="lmi.custom"):
        r = post(client, {"inputs": "x", "parameters": {"max_new_tokens": 2}})
    body = assert_json_error(r, 424)
    assert body["error"].startswith("Custom formatter failed: model.py:") and message in body["error"]
    assert "at model.py:7: RuntimeError" in body["error"]
    assert any("Traceback" in rec.getMessage() for rec in caplog.records)    # logged with the traceback
    assert post(client, {"inputs": "x", "parameters": {"max_new_tokens": 2}}).status_code == 424   # still serving
    state.custom = None
    assert post(client, {"inputs": "x", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_a_formatter_of_the_wrong_type_is_424(tmp_path, app):
    state, client = app
    (tmp_path / "model.py").write_text(
        "from djl_python.input_parser import input_formatter\n"
        "from djl_python.output_formatter import output_formatter\n\n"
        "@output_formatter\ndef out(response):\n    return 42\n")
    state.custom = custom.load(str(tmp_path), "djl_python.huggingface", False, {})
    body = assert_json_error(post(client, {"inputs": "x", "parameters": {"max_new_tokens": 2}}), 424)
    assert body["error"] == "Custom formatter failed: model.py:4 out() returned int, not a dict"
    # streamed: LMI's error line ends the stream
    r = post(client, {"inputs": "x", "parameters": {"max_new_tokens": 2}, "stream": True})
    last = json.loads(r.get_data(as_text=True).splitlines()[-1])
    assert last["code"] == 424 and "returned int" in last["error"]
    (tmp_path / "model.py").write_text(
        "from djl_python.input_parser import input_formatter\n\n"
        "@input_formatter\ndef fmt(payload, tokenizer=None):\n    return 'inputs'\n")
    state.custom = custom.load(str(tmp_path), "djl_python.huggingface", False, {})
    body = assert_json_error(post(client, {"inputs": "x"}), 424)
    assert "model.py:3 fmt() returned str, not a dict" in body["error"]
    state.custom = None


# ---- handle() in place of the built-in handler --------------------------------------------------
def test_handle_answers_with_the_input_output_api(app):
    state, client = app
    code = use(state, "handle_sync", {"model_id": "demo", "tensor_parallel_degree": "1"})
    assert code.handle.where == "model.py:7 handle()"
    r = post(client, {"inputs": "hello"})
    assert r.status_code == 200 and r.mimetype == "application/json"
    assert r.get_json() == {"echo": "HELLO", "model_id": "demo", "as_string": '{"inputs"'}
    r = client.post("/invocations", data="plain words", content_type="text/plain")
    assert r.get_json()["echo"] == "PLAIN WORDS"
    # Output.error(): its code and LMI's {"code", "message", "error"} body
    r = post(client, {"prompt": "no inputs"})
    assert r.status_code == 400
    assert r.get_json() == {"code": 400, "message": "invoke handler failure", "error": "the body needs inputs"}
    state.custom = None


def test_a_raising_handle_is_424_with_file_and_line(app, caplog):
    state, client = app
    use(state, "runtime_error")                     # async def handle: awaited
    with caplog.at_level("ERROR", logger="lmi.custom"):
        body = assert_json_error(post(client, {"inputs": "x"}), 424)
    assert body["error"] == ("model.py:4 handle() raised at model.py:6: RuntimeError: "
                             "Custom handler intentional failure")
    assert any("Traceback" in rec.getMessage() for rec in caplog.records)


def test_handle_returning_the_wrong_type_is_424(tmp_path, app):
    state, client = app
    (tmp_path / "model.py").write_text("def handle(inputs):\n    if inputs.is_empty():\n        return None\n"
                                       "    return {'not': 'an Output'}\n")
    state.custom = custom.load(str(tmp_path), "djl_python.huggingface", False, {})
    body = assert_json_error(post(client, {"inputs": "x"}), 424)
    assert body["error"] == "model.py:1 handle() returned dict, not a djl_python Output"
    state.custom = None


def test_async_handle_with_create_non_stream_output(tmp_path, app):
    # The shape of vllm_user_guide.md's custom handler (its vLLM call replaced: no vLLM here).
    state, client = app
    (tmp_path / "model.py").write_text(
        "from djl_python import Input, Output\n"
        "from djl_python.encode_decode import decode\n"
        "from djl_python.async_utils import create_non_stream_output\n\n"
        "async def handle(inputs: Input) -> Output:\n"
        "    if inputs.is_empty():\n        return None\n"
        "    batch = inputs.get_batches()\n"
        "    raw_request = batch[0]\n"
        "    content_type = raw_request.get_property('Content-Type')\n"
        "    decoded_payload = decode(raw_request, content_type)\n"
        "    prompt = decoded_payload.get('inputs', 'Hello')\n"
        "    return create_non_stream_output({'generated_text': prompt[::-1]})\n")
    state.custom = custom.load(str(tmp_path), "djl_python.huggingface", False, {})
    r = post(client, {"inputs": "abc"})
    assert r.status_code == 200 and r.get_json() == {"generated_text": "cba"}
    state.custom = None


# ---- which file, and what is used ------------------------------------------------------------
def test_entry_point_chooses_the_file(tmp_path):
    (tmp_path / "custom_handler.py").write_text("def handle(inputs):\n    return None\n")
    code = custom.load(str(tmp_path), "custom_handler.py", True, {})
    assert code.handle is not None and code.path.endswith("custom_handler.py")
    with pytest.raises(custom.CustomCodeError) as e:
        custom.load(str(tmp_path), "absent.py", True, {})
    assert str(e.value) == f"option.entryPoint=absent.py: {tmp_path / 'absent.py'} does not exist"
    assert custom.load(str(tmp_path), "djl_python.huggingface", False, {}) is None     # no model.py
    # A module entryPoint: model.py's formatters apply, its handle() does not (as LMI).
    (tmp_path / "model.py").write_text(
        "from djl_python.output_formatter import output_formatter\n"
        "def handle(inputs):\n    raise RuntimeError('never called')\n"
        "@output_formatter\ndef f(r):\n    return r\n")
    code = custom.load(str(tmp_path), "djl_python.lmi_vllm.vllm_async_service", True, {})
    assert code.handle is None and code.output_formatter is not None


def test_model_py_without_hooks_is_not_used():
    assert custom.load(str(EXAMPLES / "missing_handle"), "djl_python.huggingface", False, {}) is None


def test_start_up_call_gets_the_properties(tmp_path):
    (tmp_path / "model.py").write_text(
        "seen = []\n"
        "def handle(inputs):\n    seen.append((inputs.is_empty(), dict(inputs.get_properties())))\n")
    code = custom.load(str(tmp_path), "djl_python.huggingface", False,
                       custom.model_properties({"option.model_id": "m", "batch_size": "1"}))
    assert sys.modules[code.handle.fn.__module__].seen == [(True, {"model_id": "m", "batch_size": "1"})]


# ---- start-up failures: one line naming file and line, exit 2 ----------------------------------
def _model_dir_with(src_dir, tmp_path, model_py: str) -> pathlib.Path:
    d = tmp_path / "model"
    d.mkdir()
    for f in os.listdir(src_dir):
        os.symlink(os.path.join(src_dir, f), d / f)
    (d / "model.py").write_text(model_py)
    return d


@pytest.mark.parametrize("source, line, what", [
    ((EXAMPLES / "import_error" / "model.py").read_text(), 2,
     "cannot import: ModuleNotFoundError: No module named 'non_existent_module'"),
    ("from djl_python.input_parser import input_formatter\n"        # LMI's load_formatter_failed.py
     "from djl_python.output_formatter import output_formatter\n\n"
     "@input_formatter\n"
     "def custom_input_formatter(decoded_payload, **kwargs):\n"
     "    invalid syntax here to cause load error\n", 6, "cannot import: SyntaxError: invalid syntax"),
    ("def handle(inputs):\n    raise ValueError('no weights')\n", 2,
     "the start-up call failed: model.py:1 handle() raised at model.py:2: ValueError: no weights"),
])
def test_bad_model_py_stops_the_start_in_one_line(source, line, what, demo_model_factory, tmp_path):
    d = _model_dir_with(demo_model_factory("llama"), tmp_path, source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SM_"))}
    r = subprocess.run([sys.executable, "-m", "handler", "serve", "--model-dir", str(d), "--port", "0"],
                       capture_output=True, text=True, cwd=REPO, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert errors == [f"error: {d / 'model.py'}:{line}: {what}"] if "start-up call" not in what else \
        errors == [f"error: {d / 'model.py'}: {what}"], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
