"""`python -m handler bench embed` (issue 59's benchmark preset): its texts, the library peers' front,
and a short real run of our server beside sentence-transformers' that must agree with it."""
from __future__ import annotations

import json
import threading

import pytest

from handler.tools.bench import embed, embed_peer


def test_texts_have_the_asked_token_length(minilm_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    for n in (16, 256):
        texts = embed.make_texts(tok, 12, n, seed=n)
        lens = embed.token_lengths(tok, texts)
        assert len(set(texts)) == 12                      # varied, not one text repeated
        assert all(abs(x - n) <= 2 for x in lens), (n, lens)
    assert embed.make_texts(tok, 3, 16, seed=1) == embed.make_texts(tok, 3, 16, seed=1)


def test_pooling_read_from_sentence_transformers_files(minilm_dir, tmp_path):
    assert embed_peer.pooling_of(minilm_dir) == ("mean", True)      # all-MiniLM-L6-v2: mean, Normalize
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"},
                                                       {"type": "sentence_transformers.models.Pooling", "path": "p"}]))
    assert embed_peer.pooling_of(str(tmp_path)) == ("cls", False)


class Recorder:
    """An engine that records each batch it is given; fails on a text 'boom'."""

    def __init__(self):
        self.batches, self.gate = [], threading.Event()

    def encode(self, texts):
        self.gate.wait(5)
        self.batches.append(list(texts))
        if "boom" in texts:
            raise ValueError("boom")
        return [[float(len(t))] for t in texts]


def test_batcher_batches_what_waits_and_answers_each_its_own():
    eng = Recorder()
    b = embed_peer.Batcher(eng, max_batch=64)
    out = {}
    ts = [threading.Thread(target=lambda t=t: out.__setitem__(t, b.embed([t, t + t]))) for t in ("a", "bb", "ccc")]
    for t in ts:
        t.start()
    eng.gate.set()
    for t in ts:
        t.join(10)
    assert out == {t: [[float(len(t))], [float(2 * len(t))]] for t in ("a", "bb", "ccc")}
    assert sum(len(x) for x in eng.batches) == 6 and len(eng.batches) <= 3


def test_batcher_error_reaches_every_request_of_the_batch():
    eng = Recorder()
    eng.gate.set()
    b = embed_peer.Batcher(eng, max_batch=64)
    with pytest.raises(RuntimeError, match="ValueError: boom"):
        b.embed(["boom"])
    assert b.embed(["ok"]) == [[2.0]]       # the worker survives


def test_cli_refuses_an_unknown_cell(capsys, minilm_dir):
    from handler.tools.bench.cli import main
    assert main(["embed", "--model-dir", minilm_dir, "--out", "x", "--only", "ours,tei"]) == 2
    assert "'tei'" in capsys.readouterr().err


def test_ours_and_sentence_transformers_served_side_by_side(minilm_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LMI_BENCH_ONNX_DIR", str(tmp_path / "no-onnx-here"))
    pytest.importorskip("sentence_transformers", reason="sentence-transformers (the dev extras) is a cell")
    res = embed.run(minilm_dir, str(tmp_path), ["ours", "st", "onnx"], [16], [1, 4], reps=1, requests=8, threads=2,
                    log=print)
    for c in ("ours", "st"):
        runs = res["cells"][c]["runs"]
        assert [(r["clients"], r["texts"], r["errors"]) for r in runs] == [(1, 8, 0), (4, 8, 0)], runs
        assert all(r["texts_per_s"] > 0 and r["p50_ms"] > 0 for r in runs)
    # our vectors are sentence-transformers' (fp32)
    assert res["cells"]["ours"]["cosine_to_st"] >= 0.99999
    # a peer that is not installed is skipped with its install command, not silently
    assert "install-peer onnx" in res["cells"]["onnx"]["skipped"] and not res["cells"]["onnx"]["runs"]
    md = (tmp_path / "results.md").read_text()
    assert "ours / best peer texts/s" in md and "| 16 | 4 | ours |" in md
