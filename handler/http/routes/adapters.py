"""LoRA adapters: LMI's management routes (djl-serving docs/adapters_api.md), under /adapters and
/models/<model>/adapters: register (POST), list (GET), describe (GET .../<name>), unregister
(DELETE .../<name>). `src` is checked by handler/http/adapter_src.py before anything is read;
option.enable_lora_management=false turns every route off (404)."""
from __future__ import annotations

from flask import Blueprint, request

from handler.engine.client import AdapterExists, AdapterInvalid
from handler.engine.request import show
from handler.http.adapter_src import SrcRefused, resolve
from handler.http.routes.common import current_state, error_response, json_response, model_name

bp = Blueprint("adapters", __name__)


def client_or_error(model):
    """(the engine client, None), or (None, the error response): another model's name, the model
    still loading, or LoRA not enabled."""
    state = current_state()
    if not getattr(state.cfg, "enable_lora_management", True):
        return None, error_response(404, "the LoRA management routes are turned off on this server "
                                         "(option.enable_lora_management=false)")
    name = model_name(state.cfg)
    if model is not None and model != name:
        return None, error_response(404, f"no model {show(model)}; this server serves {show(name)}")
    client = state.client
    if client is None:
        return None, error_response(503, "the model is still loading")
    if not client.lora_enabled:
        return None, error_response(400, "LoRA adapters are not enabled on this server "
                                         "(set option.enable_lora=true)")
    return client, None


def blocking(fn, *args):
    """fn(*args) in a real thread when requests are gevent greenlets (reading, or downloading
    from S3, must not stop the worker's other requests); else here."""
    if current_state().waker is None:
        return fn(*args)
    from gevent import get_hub
    return get_hub().threadpool.apply(fn, args)


def arg(name):
    v = request.args.get(name)
    if v is None and request.is_json:
        body = request.get_json(silent=True)
        v = body.get(name) if isinstance(body, dict) else None
    return v


@bp.post("/models/<model>/adapters")
@bp.post("/adapters", defaults={"model": None})
def register_adapter(model):
    client, err = client_or_error(model)
    if err:
        return err
    name, src = arg("name"), arg("src")
    for key, v in (("name", name), ("src", src)):
        if not isinstance(v, str) or not v:
            return error_response(400, f"{key} is required (POST .../adapters?name=NAME&src=DIR)", key)
    cfg = current_state().cfg
    try:
        src = resolve(src, cfg.model_dir, getattr(cfg, "adapter_roots", ()))
    except SrcRefused as e:
        return error_response(403, str(e), "src")
    try:
        blocking(client.register_adapter, name, src)
    except AdapterExists:
        return error_response(409, f"adapter {show(name)} is already registered; DELETE it first", "name")
    except AdapterInvalid as e:
        return error_response(400, str(e), "src")
    return json_response({"status": f"Adapter {name} registered"})


@bp.get("/models/<model>/adapters")
@bp.get("/adapters", defaults={"model": None})
def list_adapters(model):
    client, err = client_or_error(model)
    return err or json_response({"adapters": client.adapters()})


@bp.get("/models/<model>/adapters/<name>")
@bp.get("/adapters/<name>", defaults={"model": None})
def describe_adapter(model, name):
    client, err = client_or_error(model)
    if err:
        return err
    found = [a for a in client.adapters() if a["name"] == name]
    return json_response(found) if found else error_response(404, f"no adapter {show(name)}")


@bp.delete("/models/<model>/adapters/<name>")
@bp.delete("/adapters/<name>", defaults={"model": None})
def unregister_adapter(model, name):
    client, err = client_or_error(model)
    if err:
        return err
    if not client.unregister_adapter(name):
        return error_response(404, f"no adapter {show(name)}")
    return json_response({"status": f"Adapter {name} unregistered"})
