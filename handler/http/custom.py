"""A model directory's `model.py`: LMI's custom handler and formatter contract.

LMI runs `handle(inputs: Input) -> Output` from the model directory's `model.py` (or the file
`option.entryPoint` names) in place of its built-in handler, calling it once at start-up with an
empty Input that carries the model's properties (serving/docs/modes.md "Python Mode"; an `async def
handle` gets no such call, as LMI's async mode); every request's Input carries them too. It wraps
its built-in handler in the `@input_formatter` / `@output_formatter` functions it finds there
(serving/docs/lmi/user_guides/input_formatter_schema.md, output_formatter_schema.md, the vLLM and
TensorRT-LLM signatures: a decoded body in, a body out; a response dict in, a dict out). The
`djl_python` package at the repository root gives model.py LMI's Input/Output API.

load() imports the file once (in the server's first process, before the HTTP worker forks): a file
that does not import, or a start-up call that raises, is one line naming the file and line. A
request whose handle() or formatter raises, or returns the wrong type, is answered 424 with a message
naming the function, file and line (as LMI: "Custom formatter failed" / "invoke handler failure"),
and the traceback is logged; the worker lives on.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import traceback
from dataclasses import dataclass

log = logging.getLogger("lmi.custom")

class CustomCodeError(Exception):
    """model.py cannot be used: str(e) is one line naming the file and line."""


class CustomCallError(Exception):
    """A model.py function failed on a request: str(e) names it, its file and line."""


@dataclass(frozen=True)
class Hook:
    """A function from model.py and where it is defined (`model.py:12 name`)."""
    fn: object
    where: str

    def call(self, *args, quiet: bool = False, **kwargs):
        """The function's result (an async function's awaited); CustomCallError naming where it raised
        (its traceback logged: as an error, or with quiet at debug level, for a one-line start-up error)."""
        try:
            out = self.fn(*args, **kwargs)
            if inspect.isawaitable(out):
                loop = asyncio.new_event_loop()
                try:
                    out = loop.run_until_complete(out)
                finally:
                    loop.close()
            return out
        except Exception as e:
            log.log(logging.DEBUG if quiet else logging.ERROR, "%s raised:\n%s", self.where, traceback.format_exc())
            raise CustomCallError(f"{self.where} raised {_raised_at(e, self.fn)}{type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class CustomCode:
    path: str
    handle: Hook | None
    input_formatter: Hook | None
    output_formatter: Hook | None

    def describe(self) -> str:
        parts = [f"{what} {h.where}" for what, h in (("handle()", self.handle),
                                                      ("@input_formatter", self.input_formatter),
                                                      ("@output_formatter", self.output_formatter)) if h]
        return f"custom code from {self.path}: " + ", ".join(parts)

    # ---- the formatters around the built-in handler
    def format_input(self, payload, tokenizer=None):
        """The decoded body through @input_formatter (CustomCallError: it raised or gave no dict)."""
        hook = self.input_formatter
        if hook is None:
            return payload
        params = inspect.signature(hook.fn).parameters
        takes = "tokenizer" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        out = hook.call(payload, tokenizer=tokenizer) if takes else hook.call(payload)
        if not isinstance(out, dict):
            raise CustomCallError(f"{hook.where} returned {type(out).__name__}, not a dict (the decoded body)")
        return out

    def format_output(self, body):
        """A response body through @output_formatter (dict, list or str back)."""
        hook = self.output_formatter
        if hook is None:
            return body
        out = hook.call(body)
        if hasattr(out, "model_dump"):       # a pydantic model, as LMI serializes it
            out = out.model_dump()
        if not isinstance(out, (dict, list, str)):
            raise CustomCallError(f"{hook.where} returned {type(out).__name__}, not a dict")
        return out

    def format_lines(self, lines, sse: bool):
        """A streamed answer's lines, each line's object through @output_formatter; a failure ends the
        stream with LMI's error line ({"error", "code": 424})."""
        for text in lines:
            if self.output_formatter is None:
                yield text
                continue
            raw = text[len("data: "):] if sse and text.startswith("data: ") else text
            try:
                out = self.format_output(json.loads(raw))
            except CustomCallError as e:
                out = {"generated_text": None, "error": f"Custom formatter failed: {e}", "code": 424}
                yield _line(out, sse)
                return
            yield _line(out, sse)

    # ---- handle()
    def invoke(self, body: bytes, headers: dict, properties: dict):
        """handle() on one request -> (status, body bytes, content type)."""
        from djl_python import Input, Output
        out = self.handle.call(Input.of(body, {**properties, **headers}))
        if out is None:
            return 200, b"", "application/json"
        if not isinstance(out, Output):
            raise CustomCallError(f"{self.handle.where} returned {type(out).__name__}, not a djl_python Output")
        ctype = next((v for k, v in out.properties.items() if k.lower() == "content-type"), "application/json")
        return int(out.code), b"".join(v for _k, v in out.content), ctype


def _line(obj, sse: bool) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n" if sse else data + "\n"


def _where(fn) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__name__", repr(fn))
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} {fn.__name__}()"


def _raised_at(e: BaseException, fn) -> str:
    """`at model.py:17: `: the deepest traceback frame in the function's file ('' when none is)."""
    code = getattr(fn, "__code__", None)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if code and f.filename == code.co_filename]
    return f"at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}: " if frames else ""


def model_properties(properties: dict) -> dict:
    """What Input.get_properties() gives model.py: the configuration's keys, `option.` dropped (LMI)."""
    return {k.removeprefix("option."): v for k, v in properties.items()}


def find(model_dir: str, entry_point: str, explicit: bool) -> tuple[str | None, bool]:
    """(the file to load, whether its handle() is the handler). An entryPoint ending in .py names the
    file (relative to the model directory); else the model directory's model.py, whose handle() runs
    unless option.entryPoint names a module (then only its formatters apply, as LMI)."""
    if entry_point.endswith(".py"):
        path = entry_point if os.path.isabs(entry_point) else os.path.join(model_dir, entry_point)
        if not os.path.isfile(path):
            raise CustomCodeError(f"option.entryPoint={entry_point}: {path} does not exist")
        return path, True
    path = os.path.join(model_dir, "model.py") if model_dir else ""
    if not path or not os.path.isfile(path):
        return None, False
    return path, not explicit


def load_adapters(model_dir: str, properties: dict) -> dict[str, CustomCode]:
    """The formatters of each MODEL_DIR/adapters/<name>/model.py (LMI: they apply to that adapter's
    requests instead of the model's; a handle() there is not run)."""
    root = os.path.join(model_dir, "adapters")
    out = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        path = os.path.join(root, name, "model.py")
        if os.path.isfile(path):
            code = _load(path, False, properties, "an adapter's model.py gives formatters only")
            if code is not None:
                out[name] = code
    return out


def load(model_dir: str, entry_point: str, explicit: bool, properties: dict) -> CustomCode | None:
    """Import model.py once and run its handle() start-up call; None when there is none.
    CustomCodeError: one line naming the file and line."""
    path, use_handle = find(model_dir, entry_point, explicit)
    if path is None:
        return None
    return _load(path, use_handle, properties, f"option.entryPoint={entry_point} names a module (its formatters "
                                               "apply)")


def _load(path: str, use_handle: bool, properties: dict, why_no_handle: str) -> CustomCode | None:
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:          # model.py imports its neighbours (LMI puts the model dir first)
        sys.path.insert(0, folder)
    name = "lmi_model_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise CustomCodeError(f"{path}:{e.lineno}: cannot import: SyntaxError: {e.msg}") from None
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        line = frames[-1].lineno if frames else 1
        raise CustomCodeError(f"{path}:{line}: cannot import: {type(e).__name__}: {e}") from None
    sys.modules[name] = module

    def marked(attr):
        found = [f for f in vars(module).values() if callable(f) and getattr(f, attr, False)]
        if len(found) > 1:
            raise CustomCodeError(f"{path}: {len(found)} functions are marked {attr.replace('is_', '@')} "
                                  f"({', '.join(_where(f) for f in found)}); keep one")
        return Hook(found[0], _where(found[0])) if found else None

    handle = getattr(module, "handle", None)
    if handle is not None and not callable(handle):
        handle = None
    if handle is not None and not use_handle:
        log.warning("%s: handle() is not run: %s", path, why_no_handle)
        handle = None
    code = CustomCode(path, Hook(handle, _where(handle)) if handle else None,
                      marked("is_input_formatter"), marked("is_output_formatter"))
    if code.handle is None and code.input_formatter is None and code.output_formatter is None:
        log.warning("%s has no handle() and no @input_formatter/@output_formatter: nothing of it is used", path)
        return None
    if code.handle is not None and not inspect.iscoroutinefunction(code.handle.fn):
        # Python mode's start-up call (modes.md): no content, the model's properties. LMI's async mode
        # (an `async def handle`, vllm_user_guide.md) makes none: its handler sets up on its first request.
        from djl_python import Input
        try:
            code.handle.call(Input(properties), quiet=True)
        except CustomCallError as e:
            raise CustomCodeError(f"{path}: the start-up call failed: {e}") from None
    return code
