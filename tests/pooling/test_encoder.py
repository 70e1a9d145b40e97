"""Our encoder forward (handler/model/encoder.py) and pooling runner (handler/model/pooling.py) against
transformers' own models, on tiny random checkpoints built here: packed variable-length batches equal
each sequence run alone by transformers, whatever shares the batch."""
from __future__ import annotations

import json
import os

import pytest
import torch

from handler.engine.pooling import PoolInput
from handler.model.encoder import HFEncoder
from handler.model.pooling import ModelLoadError, PoolingRunner, pooling_spec
from tests.pooling.conftest import build

TEXTS = ["the cat", "paris is the capital of france", "a dog and a kitten with a car in the city of paris " * 3,
         "x", "query: fast model? serve it!"]


def _hf_hidden(model_dir, ids, types=None):
    from transformers import AutoModel
    m = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        kw = {"token_type_ids": torch.tensor([types])} if types is not None else {}
        return m(input_ids=torch.tensor([ids]), **kw).last_hidden_state[0]


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta", "modernbert", "electra", "distilbert", "mpnet",
                                  "deberta-v2"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_packed_embeddings_equal_transformers_per_sequence(kind, pooling, tmp_path):
    d = build(str(tmp_path / kind), kind, pooling=pooling, normalize=pooling != "max", seed=3)
    runner = PoolingRunner(d, "text_embedding", quantize="none")
    # ours where we have the family, else transformers' forward over padded batches
    assert isinstance(runner.model, HFEncoder) == (kind in ("mpnet", "deberta-v2"))
    inputs = [PoolInput(runner.tokenizer(t)["input_ids"]) for t in TEXTS]
    got = torch.tensor(runner.pool(inputs, "embed"))
    for i, x in enumerate(inputs):
        h = _hf_hidden(d, x.ids)
        want = {"mean": h.mean(0), "cls": h[0], "max": h.max(0).values}[pooling]
        if pooling != "max":
            want = torch.nn.functional.normalize(want, dim=-1)
        torch.testing.assert_close(got[i], want, atol=2e-5, rtol=1e-4)
    # the same input alone gives the same vector as inside the batch
    alone = torch.tensor(runner.pool([inputs[2]], "embed"))[0]
    torch.testing.assert_close(alone, got[2], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "roberta", "modernbert", "electra", "distilbert", "mpnet", "deberta-v2"])
@pytest.mark.parametrize("labels", [1, 3])
def test_cross_encoder_logits_equal_transformers(kind, labels, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    d = build(str(tmp_path / kind), kind, classifier=True, num_labels=labels, seed=5)
    runner = PoolingRunner(d, "rerank" if labels == 1 else "classify", quantize="none")
    tok = AutoTokenizer.from_pretrained(d)
    pairs = [("paris", "paris is the capital of france"), ("a dog", "the cat"), ("water", "fire and money " * 4)]
    inputs = []
    for q, t in pairs:
        enc = tok(q, t)
        inputs.append(PoolInput(enc["input_ids"], enc.get("token_type_ids")))
    got = torch.tensor(runner.pool(inputs, "classify"))
    hf = AutoModelForSequenceClassification.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, (q, t) in enumerate(pairs):
            enc = tok(q, t, return_tensors="pt")
            if kind not in ("bert", "electra"):     # models of one segment: their tokenizers send no segment ids
                enc.pop("token_type_ids", None)
            want = hf(**enc).logits[0]
            torch.testing.assert_close(got[i], want, atol=2e-5, rtol=1e-4)
    assert got.shape == (3, labels)


def test_decoder_embedder_pools_the_last_token(demo_model_factory):
    from transformers import AutoModel
    d = demo_model_factory("qwen2")
    runner = PoolingRunner(d, "text_embedding", quantize="none")
    assert runner.spec.mode == "lasttoken" and runner.spec.normalize
    ids = [runner.tokenizer(t)["input_ids"] for t in ("def f(x):\n    return x", "import os", "a")]
    got = torch.tensor(runner.pool([PoolInput(x) for x in ids], "embed"))
    hf = AutoModel.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, x in enumerate(ids):
            want = torch.nn.functional.normalize(hf(input_ids=torch.tensor([x])).last_hidden_state[0, -1], dim=-1)
            torch.testing.assert_close(got[i], want, atol=2e-5, rtol=1e-4)


def test_int8_embeddings_stay_close(tiny_bert):
    ref = PoolingRunner(tiny_bert, "text_embedding", quantize="none")
    q8 = PoolingRunner(tiny_bert, "text_embedding", quantize="int8")
    assert q8.quantized and "int8" in q8.quantized
    inputs = [PoolInput(ref.tokenizer(t)["input_ids"]) for t in TEXTS]
    cos = torch.nn.functional.cosine_similarity(torch.tensor(q8.pool(inputs, "embed")),
                                                torch.tensor(ref.pool(inputs, "embed")))
    assert cos.min() > 0.999, cos


def test_pooling_spec_from_sentence_transformers_files(tmp_path):
    d = str(tmp_path)
    assert pooling_spec(d, decoder=False).mode == "cls"         # no modules.json: [CLS], normalized
    assert pooling_spec(d, decoder=True).mode == "lasttoken"
    with open(os.path.join(d, "modules.json"), "w") as f:
        json.dump([{"path": "", "type": "sentence_transformers.models.Transformer"},
                   {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], f)
    os.makedirs(os.path.join(d, "1_Pooling"))
    with open(os.path.join(d, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_mean_sqrt_len_tokens": True}, f)
    spec = pooling_spec(d, decoder=False)
    assert (spec.mode, spec.dense, spec.normalize) == ("mean_sqrt_len", ("2_Dense",), False)
    with open(os.path.join(d, "modules.json"), "w") as f:
        json.dump([{"path": "", "type": "sentence_transformers.models.Transformer"},
                   {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}], f)
    with pytest.raises(ModelLoadError, match=r"LayerNorm \(2_LayerNorm\) is not supported here"):
        pooling_spec(d, decoder=False)


@pytest.mark.parametrize("activation", ["Tanh", "Identity"])
def test_dense_modules_as_sentence_transformers_applies_them(tmp_path, activation):
    # A sentence-transformers model with a Dense projection (32 -> 16) saved by the library itself:
    # our runner's vectors are its encode()'s.
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (the dev extras) is the oracle")
    base = build(str(tmp_path / "bert"), "bert", pooling=None, seed=7)
    act = getattr(torch.nn, activation)()
    from sentence_transformers.sentence_transformer import modules as stm
    model = st.SentenceTransformer(modules=[stm.Transformer(base), stm.Pooling(32, "mean"),
                                            stm.Dense(32, 16, activation_function=act), stm.Normalize()],
                                   device="cpu")
    out = str(tmp_path / "st")
    model.save(out)
    runner = PoolingRunner(out, "text_embedding", quantize="none")
    assert runner.spec.dense and runner.hidden_size == 16
    got = torch.tensor(runner.pool([PoolInput(runner.tokenizer(t)["input_ids"]) for t in TEXTS], "embed"))
    want = torch.tensor(model.encode(TEXTS, convert_to_numpy=True))
    assert got.shape == (len(TEXTS), 16)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_classification_task_needs_a_classifier(tiny_bert):
    with pytest.raises(ModelLoadError, match="option.task=rerank needs a sequence-classification encoder"):
        PoolingRunner(tiny_bert, "rerank")


def test_attention_is_one_c_call_a_layer_over_the_packed_batch(tmp_path, monkeypatch):
    from kernels import cpu as cpu_ext
    if not cpu_ext.encoder_attention_available(torch.float32):
        pytest.skip("no C kernels in this build: attention runs in torch (the test above covers it)")
    d = build(str(tmp_path / "bert"), "bert", pooling="mean", normalize=True, seed=5)
    runner = PoolingRunner(d, "text_embedding", quantize="none")
    inputs = [PoolInput(runner.tokenizer(t)["input_ids"]) for t in TEXTS]
    calls, real = [], cpu_ext.encoder_attention
    monkeypatch.setattr(cpu_ext, "encoder_attention", lambda *a: calls.append(sorted(a[4])) or real(*a))
    got = torch.tensor(runner.pool(inputs, "embed"))
    with open(os.path.join(d, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    assert calls == [sorted(len(x.ids) for x in inputs)] * layers
    want = torch.nn.functional.normalize(_hf_hidden(d, inputs[1].ids).mean(0), dim=-1)
    torch.testing.assert_close(got[1], want, atol=2e-5, rtol=1e-4)
