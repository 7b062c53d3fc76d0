"""training.hf_interop: name map, export a trained model to a HF directory, import one back."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import bertforge.training.hf_interop as hf_interop
from bertforge.pipelines.contract.tokenization import load_tokenizer
from bertforge.training.hf_interop import (
    config_from_hf_dict,
    export_hf_directory,
    from_hf_state_dict,
    hf_name_map,
    strip_wrapper_prefixes,
    to_hf_state_dict,
)
from bertforge.training.model import BertConfig, BertForPreTraining, bert_tiny
from bertforge.training.warm_start import read_initial_weights
from tests.training.test_model import TOLERANCE, random_batch

VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "the", "cat", "sat", "on", "mat", "dog", "ran", "a", "house", "in",
    ".", ",", "!", "un", "##believ", "##able", "##s", "##ed", "play", "café", "The",
]  # fmt: skip
SENTENCE = "The cats played on the mat, unbelievable! Café?"
# Google's files put [unused*] first and the specials at 100..103: nothing may assume 0..4.
GOOGLE_LAYOUT = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [
    token for token in VOCAB if not token.startswith("[")
]


@pytest.fixture
def vocab_path(tmp_path) -> str:
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    return str(path)


def trained_tiny_model(steps: int = 3) -> BertForPreTraining:
    """bert_tiny on the test vocab after a few AdamW steps, so no tensor is at its init value."""
    return trained_tiny_model_of(bert_tiny(vocab_size=len(VOCAB)), steps)


def trained_tiny_model_of(config: BertConfig, steps: int = 3) -> BertForPreTraining:
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = random_batch(config, batch_size=4, seq_len=16)
    for _ in range(steps):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    return model.eval()


def test_name_map_covers_every_stored_tensor_of_both_sides() -> None:
    config = BertConfig(50, 32, 3, 2, 64)
    names = hf_name_map(config.num_hidden_layers)
    ours = set(BertForPreTraining(config).state_dict())
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert set(names) == ours - tied
    hf_model = transformers.BertForPreTraining(transformers.BertConfig(**config.to_dict()))
    hf_names = [hf for parts in names.values() for hf in parts]
    assert len(hf_names) == len(set(hf_names))  # each HF tensor comes from one of ours
    assert set(hf_names) == set(hf_model.state_dict()) - tied


def test_fused_qkv_and_vocabulary_padding_convert_both_ways() -> None:
    """Export splits QKV in query, key, value order and drops the padding rows; import
    concatenates and pads with zeros: a round trip gives the model's own tensors."""
    config = BertConfig(50, 32, 1, 2, 64)
    model = trained_tiny_model_of(config)
    state_dict = model.state_dict()
    exported = to_hf_state_dict(state_dict, config)
    qkv = state_dict["bert.encoder.layer.0.attention.self.qkv.weight"]
    for index, part in enumerate(("query", "key", "value")):
        block = exported[f"bert.encoder.layer.0.attention.self.{part}.weight"]
        assert torch.equal(block, qkv[index * 32 : (index + 1) * 32])
    assert exported["bert.embeddings.word_embeddings.weight"].shape == (50, 32)
    assert exported["cls.predictions.bias"].shape == (50,)
    imported = from_hf_state_dict(exported, config)
    for name, tensor in state_dict.items():
        assert torch.equal(imported[name], tensor), name
    assert imported["bert.embeddings.word_embeddings.weight"].shape == (64, 32)
    assert imported["cls.predictions.decoder.weight"] is imported[
        "bert.embeddings.word_embeddings.weight"]
    wrong = {**exported, "cls.predictions.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="64 rows.*vocab_size is 50"):
        from_hf_state_dict(wrong, config)


def test_wrapper_prefixes_are_stripped() -> None:
    assert strip_wrapper_prefixes("module._orig_mod.bert.pooler.dense.bias") == (
        "bert.pooler.dense.bias"
    )
    assert strip_wrapper_prefixes("_orig_mod.cls.predictions.bias") == "cls.predictions.bias"
    config = BertConfig(50, 32, 1, 2, 64)
    state_dict = BertForPreTraining(config).state_dict()
    wrapped = {f"module._orig_mod.{name}": tensor for name, tensor in state_dict.items()}
    assert set(to_hf_state_dict(wrapped, config)) == set(to_hf_state_dict(state_dict, config))


def test_to_hf_state_dict_rejects_missing_and_foreign_names() -> None:
    config = BertConfig(50, 32, 1, 2, 64)
    state_dict = BertForPreTraining(config).state_dict()
    with pytest.raises(ValueError, match="missing"):
        to_hf_state_dict({k: v for k, v in state_dict.items() if "pooler" not in k}, config)
    with pytest.raises(ValueError, match="unexpected"):
        to_hf_state_dict({**state_dict, "bert.extra.weight": torch.zeros(1)}, config)


def test_export_loads_in_transformers_with_equal_logits(vocab_path, tmp_path) -> None:
    model = trained_tiny_model()
    output_dir = export_hf_directory(
        model.state_dict(), model.config, vocab_path, True, str(tmp_path / "hf")
    )
    hf_model, info = transformers.BertForPreTraining.from_pretrained(
        output_dir, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    batch = random_batch(model.config, batch_size=3, seq_len=12, seed=1)
    predicted = batch["labels"] != -100
    with torch.no_grad():
        ours, theirs = model(**batch), hf_model.eval()(**batch)
    diff = (ours.prediction_logits - theirs.prediction_logits[predicted]).abs().max().item()
    print(f"export round trip: max |logit diff| {diff:.3g}")
    assert diff <= TOLERANCE
    torch.testing.assert_close(
        ours.seq_relationship_logits, theirs.seq_relationship_logits, atol=TOLERANCE, rtol=0
    )
    torch.testing.assert_close(ours.loss, theirs.loss, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("vocab", [VOCAB, GOOGLE_LAYOUT], ids=["specials-first", "google"])
@pytest.mark.parametrize("lower_case", [True, False])
def test_exported_tokenizer_matches_pipeline_tokenizer(tmp_path, vocab, lower_case) -> None:
    vocab_path = tmp_path / "vocab.txt"
    vocab_path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    model = BertForPreTraining(bert_tiny(vocab_size=len(vocab)))
    output_dir = export_hf_directory(
        model.state_dict(), model.config, str(vocab_path), lower_case, str(tmp_path / "hf")
    )
    hf_tokenizer = transformers.BertTokenizerFast.from_pretrained(output_dir)
    ours = load_tokenizer(str(vocab_path), lower_case).encode(SENTENCE).ids
    assert vocab.index("[UNK]") in ours and len(ours) > 10  # pieces and unknowns both exercised
    cls_id, sep_id = vocab.index("[CLS]"), vocab.index("[SEP]")
    assert hf_tokenizer(SENTENCE)["input_ids"] == [cls_id, *ours, sep_id]
    pair = hf_tokenizer("the cat", "a dog")
    the, cat, a, dog = (vocab.index(word) for word in ("the", "cat", "a", "dog"))
    assert pair["input_ids"] == [cls_id, the, cat, sep_id, a, dog, sep_id]
    assert pair["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]
    assert hf_tokenizer.model_max_length == 512
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["do_lower_case"] is lower_case


def test_export_is_atomic_and_refuses_to_overwrite(vocab_path, tmp_path, monkeypatch) -> None:
    model = BertForPreTraining(bert_tiny(vocab_size=len(VOCAB)))
    target = str(tmp_path / "out" / "hf")

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_interop, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export_hf_directory(model.state_dict(), model.config, vocab_path, True, target)
    assert os.listdir(tmp_path / "out") == []  # neither the target nor a staging directory
    monkeypatch.undo()

    export_hf_directory(model.state_dict(), model.config, vocab_path, True, target)
    with pytest.raises(FileExistsError):
        export_hf_directory(model.state_dict(), model.config, vocab_path, True, target)
    export_hf_directory(model.state_dict(), model.config, vocab_path, False, target, overwrite=True)
    assert os.listdir(tmp_path / "out") == ["hf"]
    assert sorted(os.listdir(target)) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]


def test_export_rejects_a_vocab_larger_than_the_model(vocab_path, tmp_path) -> None:
    model = BertForPreTraining(BertConfig(len(VOCAB) - 1, 32, 1, 2, 64))
    with pytest.raises(ValueError, match="vocab_size"):
        export_hf_directory(model.state_dict(), model.config, vocab_path, True, str(tmp_path / "x"))


def test_import_from_hugging_face_directory_gives_equal_logits(tmp_path) -> None:
    config = BertConfig(120, 64, 2, 4, 128, layer_norm_eps=1e-7)
    torch.manual_seed(0)
    hf_model = transformers.BertForPreTraining(transformers.BertConfig(**config.to_dict())).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    imported = read_initial_weights(str(tmp_path / "hf"))  # what --init-from reads
    imported_config, state_dict = imported.config, imported.state_dict
    assert imported_config == config and imported.lacking == ()
    ours = BertForPreTraining(imported_config).eval()
    ours.load_state_dict(state_dict)  # strict: every name present, tied ones included
    batch = random_batch(config, batch_size=2, seq_len=10)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(**batch).loss, hf_model(**batch).loss, atol=TOLERANCE, rtol=0
        )
        inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
        full_ours, full_hf = ours(**inputs), hf_model(**inputs)
    torch.testing.assert_close(
        full_ours.prediction_logits, full_hf.prediction_logits, atol=TOLERANCE, rtol=0
    )


def test_import_from_pytorch_model_bin_with_legacy_names(tmp_path) -> None:
    """Google's converted checkpoints: pytorch_model.bin, LayerNorm gamma/beta, position_ids."""
    config = BertConfig(60, 64, 1, 1, 128)
    torch.manual_seed(0)
    hf_model = transformers.BertForPreTraining(transformers.BertConfig(**config.to_dict()))
    renames = {"LayerNorm.weight": "LayerNorm.gamma", "LayerNorm.bias": "LayerNorm.beta"}
    legacy = {}
    for name, tensor in hf_model.state_dict().items():
        for new, old in renames.items():
            name = name.replace(new, old)
        legacy[name] = tensor
    legacy["bert.embeddings.position_ids"] = torch.arange(512)[None]
    os.makedirs(tmp_path / "legacy")
    torch.save(legacy, tmp_path / "legacy" / "pytorch_model.bin")
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(config.to_dict()))
    imported = read_initial_weights(str(tmp_path / "legacy"))
    imported_config, state_dict = imported.config, imported.state_dict
    assert imported_config == config
    expected = from_hf_state_dict(hf_model.state_dict(), config)
    assert state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state_dict[name], tensor), name


def test_export_then_import_restores_the_state_dict(vocab_path, tmp_path) -> None:
    model = trained_tiny_model(steps=1)
    export_hf_directory(model.state_dict(), model.config, vocab_path, True, str(tmp_path / "hf"))
    imported = read_initial_weights(str(tmp_path / "hf"))
    config, state_dict = imported.config, imported.state_dict
    assert config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(state_dict[name], tensor), name


def test_import_refuses_untied_decoder_and_foreign_weights(tmp_path) -> None:
    config = BertConfig(50, 64, 1, 1, 128)
    state_dict = transformers.BertForPreTraining(
        transformers.BertConfig(**config.to_dict())
    ).state_dict()
    untied = {**state_dict, "cls.predictions.decoder.weight": torch.zeros(50, 64)}
    with pytest.raises(ValueError, match="untied"):
        from_hf_state_dict(untied, config)
    os.makedirs(tmp_path / "roberta")
    (tmp_path / "roberta" / "config.json").write_text(json.dumps(config.to_dict()))
    torch.save({"roberta.embeddings.word_embeddings.weight": torch.zeros(5, 4)},
               tmp_path / "roberta" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="does not hold a BERT of its config.json's shape"):
        read_initial_weights(str(tmp_path / "roberta"))


@pytest.mark.parametrize(
    "values, message",
    [
        ({"model_type": "roberta"}, "not a BERT config"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"tie_word_embeddings": False}, "untied"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "not divisible"),
    ],
)
def test_config_from_hf_dict_refuses_what_we_cannot_load(values, message) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_hf_dict({"model_type": "bert", **values})
