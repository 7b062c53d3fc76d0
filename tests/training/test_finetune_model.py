"""Fine-tuning heads, MODEL loading and the Hugging Face export of a fine-tuned model.

The export must load in `transformers.AutoModelForSequenceClassification` /
`AutoModelForQuestionAnswering` with no missing or unexpected keys and give our logits (fp32,
atol 1e-5); the losses must be Hugging Face's too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from bertforge.training.finetune.export import export_finetuned
from bertforge.training.finetune.load import load_pretrained
from bertforge.training.finetune.model import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    task_model,
)
from bertforge.training.hf_interop import HF_CONFIG_NAME
from tests.support.finetune_data import VOCAB, tiny_bert_dir, write_vocab
from tests.training.test_model import random_batch

ATOL = 1e-5


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> str:
    return tiny_bert_dir(str(tmp_path_factory.mktemp("model")))


def trained(model: torch.nn.Module, batch: dict, steps: int = 3) -> torch.nn.Module:
    """A few AdamW steps, so that no head or encoder tensor is at its initial value."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(**batch)["loss"].backward()
        optimizer.step()
    return model.eval()


def inputs(config, seed: int = 0) -> dict[str, torch.Tensor]:
    batch = random_batch(config, batch_size=4, seq_len=16, seed=seed)
    return {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}


def load_in_transformers(auto_class, path: str):
    model, info = auto_class.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("num_labels", [3, 1])
def test_classifier_export_gives_our_logits_and_loss_in_transformers(bert_dir, tmp_path,
                                                                     num_labels) -> None:
    pretrained = load_pretrained(bert_dir)
    torch.manual_seed(0)
    model = BertForSequenceClassification(pretrained.config, num_labels)
    model.load_encoder(pretrained.state_dict)
    batch = inputs(pretrained.config)
    labels = torch.tensor([0, 2, 1, 2]) if num_labels == 3 else torch.tensor([0.5, 3.0, 4.2, 1.0])
    trained(model, {**batch, "labels": labels})
    names = ("neg", "neutral", "pos") if num_labels == 3 else None
    path = export_finetuned(model, pretrained.vocab_path, True, str(tmp_path / "hf"),
                            labels=names, task="t")

    hf = load_in_transformers(transformers.AutoModelForSequenceClassification, path)
    assert type(hf).__name__ == "BertForSequenceClassification"
    with torch.no_grad():
        ours, theirs = model(**batch, labels=labels), hf(**batch, labels=labels)
    torch.testing.assert_close(ours["logits"], theirs.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours["loss"], theirs.loss, atol=ATOL, rtol=0)
    config = json.load(open(os.path.join(path, HF_CONFIG_NAME), encoding="utf-8"))
    if num_labels == 3:
        assert config["id2label"] == {"0": "neg", "1": "neutral", "2": "pos"}
        assert config["problem_type"] == "single_label_classification"
    else:
        assert config["problem_type"] == "regression" and hf.config.num_labels == 1


def test_question_answering_export_gives_our_logits_and_loss_in_transformers(bert_dir,
                                                                             tmp_path) -> None:
    pretrained = load_pretrained(bert_dir)
    torch.manual_seed(0)
    model = BertForQuestionAnswering(pretrained.config)
    model.load_encoder(pretrained.state_dict)
    batch = inputs(pretrained.config)
    # The last position is outside the window (16): clamped and ignored, as Hugging Face's.
    positions = {"start_positions": torch.tensor([1, 3, 0, 16]),
                 "end_positions": torch.tensor([2, 5, 0, 17])}
    trained(model, {**batch, **positions})
    path = export_finetuned(model, pretrained.vocab_path, True, str(tmp_path / "hf"))

    hf = load_in_transformers(transformers.AutoModelForQuestionAnswering, path)
    with torch.no_grad():
        ours, theirs = model(**batch, **positions), hf(**batch, **positions)
    torch.testing.assert_close(ours["start_logits"], theirs.start_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours["end_logits"], theirs.end_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours["loss"], theirs.loss, atol=ATOL, rtol=0)


def test_encoder_from_a_hugging_face_directory_is_its_bert_model(bert_dir) -> None:
    """The loaded encoder gives transformers' BertModel outputs for the same directory."""
    pretrained = load_pretrained(bert_dir)
    assert pretrained.provenance["kind"] == "hf_dir" and pretrained.provenance["step"] is None
    model = task_model(pretrained.config, 2)
    model.load_encoder(pretrained.state_dict)
    model.eval()
    hf = transformers.BertModel.from_pretrained(bert_dir).eval()
    batch = inputs(pretrained.config, seed=1)
    with torch.no_grad():
        ours = model.bert.pooler(model._encode(**batch)[:, 0])
        theirs = hf(**batch).pooler_output
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_bare_bert_model_and_fine_tuned_exports_are_accepted_as_model(bert_dir,
                                                                       tmp_path) -> None:
    """A `BertModel.save_pretrained` directory (no `bert.` prefix, maybe no pooler) and an
    earlier fine-tuned export are BERT encoders too."""
    bare = tmp_path / "bare"
    hf = transformers.BertModel.from_pretrained(bert_dir, add_pooling_layer=False)
    hf.save_pretrained(bare)
    write_vocab(str(bare / "vocab.txt"))
    loaded = load_pretrained(str(bare))
    assert "pooler" in loaded.provenance and "bert.pooler.dense.weight" not in loaded.state_dict
    reference = load_pretrained(bert_dir).state_dict
    for name, tensor in loaded.state_dict.items():
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0)

    model = BertForQuestionAnswering(loaded.config)
    model.load_encoder(loaded.state_dict)
    exported = export_finetuned(model, loaded.vocab_path, True, str(tmp_path / "qa"))
    again = load_pretrained(exported)
    assert again.state_dict["bert.embeddings.word_embeddings.weight"].shape[0] >= len(VOCAB)


def test_a_directory_transformers_5_saved_with_a_tokenizer_json_only_is_accepted(
        bert_dir, tmp_path) -> None:
    """transformers 5 saves a tokenizer as tokenizer.json alone: such a directory was refused
    ("has no vocab.txt") though its WordPiece vocabulary is in that file."""
    saved = tmp_path / "saved"
    transformers.BertModel.from_pretrained(bert_dir).save_pretrained(saved)
    transformers.AutoTokenizer.from_pretrained(bert_dir).save_pretrained(saved)
    if (saved / "vocab.txt").exists():  # a transformers that still writes one
        (saved / "vocab.txt").unlink()
    loaded = load_pretrained(str(saved))
    with open(loaded.vocab_path, encoding="utf-8") as f:
        assert f.read().splitlines() == list(VOCAB)
    assert loaded.provenance["vocab_sha256"] == load_pretrained(bert_dir).provenance[
        "vocab_sha256"]

    tokenizer = json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["model"]["type"] = "BPE"
    (saved / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    with pytest.raises(ValueError, match="holds a BPE tokenizer, not BERT's WordPiece"):
        load_pretrained(str(saved))


def test_a_load_reads_the_tokenizer_json_once(bert_dir, tmp_path, monkeypatch) -> None:
    """The vocabulary, the casing, vocab.txt's agreement and the added tokens each read and
    parsed the whole tokenizer.json again: 4 times per load (bert-base-uncased's is 700 KB)."""
    import builtins

    saved = tmp_path / "saved"
    transformers.BertModel.from_pretrained(bert_dir).save_pretrained(saved)
    transformers.AutoTokenizer.from_pretrained(bert_dir).save_pretrained(saved)
    (saved / "tokenizer_config.json").unlink()  # no do_lower_case: tokenizer.json says it
    real_open, reads = builtins.open, []

    def counting_open(file, *args, **kwargs):
        if os.path.basename(str(file)) == "tokenizer.json":
            reads.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    for vocab_txt in (True, False):  # beside a vocab.txt, and alone (transformers 5's save)
        if vocab_txt:
            write_vocab(str(saved / "vocab.txt"))
        else:
            (saved / "vocab.txt").unlink()
        reads.clear()
        assert load_pretrained(str(saved)).lower_case is True
        assert len(reads) == 1, f"tokenizer.json read {len(reads)} times in one load"


@pytest.mark.parametrize("lower_case", [False, True])
def test_a_tokenizer_saved_without_do_lower_case_keeps_its_own_casing(
        bert_dir, tmp_path, lower_case) -> None:
    """A tokenizer saved as a generic PreTrainedTokenizerFast writes no do_lower_case: a cased
    one was taken as uncased, and the model fine-tuned on other ids than its tokenizer gives."""
    from bertforge.pipelines.contract.tokenization import load_tokenizer
    from bertforge.training.hf_interop import build_hf_tokenizer_json
    from bertforge.training.inputs import hf_lower_case

    saved = tmp_path / "saved"
    transformers.BertModel.from_pretrained(bert_dir).save_pretrained(saved)
    (tmp_path / "tokenizer.json").write_text(
        build_hf_tokenizer_json(os.path.join(bert_dir, "vocab.txt"), lower_case), "utf-8")
    own = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), unk_token="[UNK]", pad_token="[PAD]",
        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    own.save_pretrained(saved)
    assert "do_lower_case" not in (saved / "tokenizer_config.json").read_text("utf-8")
    loaded = load_pretrained(str(saved))
    assert loaded.lower_case is lower_case
    assert hf_lower_case(str(saved)) is lower_case  # train --init-from's and eval's check
    text = "Good movie , GREAT acting"
    ours = load_tokenizer(loaded.vocab_path, loaded.lower_case).encode(text).ids
    assert ours == own(text, add_special_tokens=False)["input_ids"]


def test_a_tokenizer_with_tokens_added_beyond_its_vocabulary_is_refused(bert_dir,
                                                                        tmp_path) -> None:
    """`add_tokens` (domain words) or `add_special_tokens` ([E1] entity markers) and
    `resize_token_embeddings`: their ids were never produced, each such word fine-tuned as
    WordPiece pieces and the export's tokenizer left without it, silently."""
    from bertforge.pipelines.contract.tokenization import load_tokenizer

    saved = tmp_path / "saved"
    tokenizer = transformers.AutoTokenizer.from_pretrained(bert_dir)
    tokenizer.add_tokens(["goodish"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["[E1]"]})
    model = transformers.BertForPreTraining.from_pretrained(bert_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    with pytest.raises(ValueError) as error:
        load_pretrained(str(saved))
    assert str(error.value) == (
        f"model {saved}: its tokenizer adds 2 token(s) that fine-tuning here, with its "
        "WordPiece vocabulary alone, would split into pieces (goodish, [E1]); write each word "
        "of them into its vocab.txt at its id (WordPiece then reads it whole), or fine-tune it "
        "with its own tokenizer in transformers")
    # What it says to do, for the word: its id is then the model's own tokenizer's. A marker
    # in brackets is still split by BERT's pre-tokenizer, so it stays refused.
    (saved / "vocab.txt").write_text("\n".join([*VOCAB, "goodish", "[E1]"]) + "\n", "utf-8")
    with pytest.raises(ValueError, match=r"adds 1 token\(s\) .* \(\[E1\]\)"):
        load_pretrained(str(saved))
    words = tmp_path / "words"
    tokenizer = transformers.AutoTokenizer.from_pretrained(bert_dir)
    tokenizer.add_tokens(["goodish"])
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(words)
    tokenizer.save_pretrained(words)
    (words / "vocab.txt").write_text("\n".join([*VOCAB, "goodish"]) + "\n", "utf-8")
    loaded = load_pretrained(str(words))
    text = "a goodish film , very good"
    ours = load_tokenizer(loaded.vocab_path, loaded.lower_case).encode(text).ids
    assert ours == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_sharded_save_is_read_whole_and_a_missing_shard_named(bert_dir, tmp_path) -> None:
    """`save_pretrained(max_shard_size=...)` writes model-0000k-of-0000n.safetensors and an
    index: such a directory was "neither a complete checkpoint, ... nor a Hugging Face
    directory"."""
    from bertforge.training.warm_start import read_initial_weights

    sharded = tmp_path / "sharded"
    transformers.BertForPreTraining.from_pretrained(bert_dir).save_pretrained(
        sharded, max_shard_size="20KB")
    transformers.AutoTokenizer.from_pretrained(bert_dir).save_pretrained(sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    whole = load_pretrained(bert_dir).state_dict
    loaded = load_pretrained(str(sharded)).state_dict
    assert loaded.keys() == whole.keys()
    assert all(torch.equal(loaded[name], whole[name]) for name in whole)
    assert read_initial_weights(str(sharded)).lacking == ()  # train --init-from's and eval's
    shards[-1].unlink()
    with pytest.raises(ValueError, match=f"names shard\\(s\\) the directory lacks: "
                                         f"{shards[-1].name}"):
        load_pretrained(str(sharded))


def test_a_vocab_txt_that_its_tokenizer_json_disagrees_with_is_refused(bert_dir,
                                                                       tmp_path) -> None:
    """vocab.txt edited (a word in place of another) and tokenizer.json left as it was:
    AutoTokenizer reads tokenizer.json, fine-tuning read vocab.txt, each text other ids."""
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(bert_dir, edited)
    lines = (edited / "vocab.txt").read_text("utf-8").splitlines()
    lines[5] = "covid"
    (edited / "vocab.txt").write_text("\n".join(lines) + "\n", "utf-8")
    with pytest.raises(ValueError) as error:
        load_pretrained(str(edited))
    assert str(error.value) == (
        f"model {edited}: its vocab.txt and tokenizer.json hold different vocabularies (id 5 is "
        f"'covid' in vocab.txt but {VOCAB[5]!r} in tokenizer.json): transformers' fast "
        "tokenizer reads tokenizer.json, fine-tuning here vocab.txt; remove the stale one")
    (edited / "tokenizer.json").unlink()  # what it says: vocab.txt is then the tokenizer
    assert load_pretrained(str(edited)).vocab_path == str(edited / "vocab.txt")


def test_random_init_keeps_the_architecture_and_vocabulary_only(bert_dir) -> None:
    pretrained = load_pretrained(bert_dir)
    fresh = load_pretrained(bert_dir, random_init=True)
    assert fresh.state_dict is None and fresh.config == pretrained.config
    assert fresh.provenance["random_init"] is True
    assert fresh.vocab_path == pretrained.vocab_path
    torch.manual_seed(0)
    model = task_model(fresh.config, 2)
    model.init_encoder_randomly()
    weight = model.bert.embeddings.word_embeddings.weight
    assert weight.shape[0] == fresh.config.vocab_size
    ours = pretrained.state_dict["bert.embeddings.word_embeddings.weight"][: weight.shape[0]]
    assert not torch.allclose(weight, ours)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gpt2", "n_layer": 2}, "is not a BERT model: its config.json says "
                                           "model_type 'gpt2'"),
    ({"model_type": "bert", "hidden_act": "relu"}, "hidden_act='relu' is not supported"),
])
def test_a_directory_that_is_not_bert_is_refused(tmp_path, config, message) -> None:
    (tmp_path / HF_CONFIG_NAME).write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_pretrained(str(tmp_path))


def test_a_directory_with_no_model_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="is none of a bertforge checkpoint"):
        load_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no such directory"):
        load_pretrained(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json: a file, not a directory"):
        load_pretrained(str(tmp_path / "config.json"))


def test_bert_config_with_foreign_weights_is_refused(bert_dir, tmp_path) -> None:
    """config.json says BERT, the weights are of another shape: one clear error."""
    target = tmp_path / "odd"
    target.mkdir()
    config = json.load(open(os.path.join(bert_dir, HF_CONFIG_NAME), encoding="utf-8"))
    config["num_hidden_layers"] = 3  # the weights have 2
    (target / HF_CONFIG_NAME).write_text(json.dumps(config), encoding="utf-8")
    for name in ("model.safetensors", "vocab.txt"):
        os.symlink(os.path.join(bert_dir, name), target / name)
    with pytest.raises(ValueError, match="does not hold a BERT encoder of its config.json"):
        load_pretrained(str(target))


def test_checkpoint_and_run_directory_sources_give_the_checkpoints_encoder(tmp_path) -> None:
    """A run directory means its newest committed checkpoint; provenance says which and its
    step; the encoder is the checkpoint's fp32 weights."""
    from bertforge.training import checkpoint
    from bertforge.training.config import TrainConfig
    from bertforge.training.loop import train
    from tests.training.conftest import write_dataset

    data = write_dataset(str(tmp_path / "shards"), {"train": [40], "validation": [8]})
    run_dir = str(tmp_path / "run")
    train(TrainConfig(data_dir=data, run_dir=run_dir, max_steps=2, micro_batch_size=8,
                      model={"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2,
                             "intermediate_size": 64},
                      precision="fp32", zero_stage=0, learning_rate=1e-3))
    latest = checkpoint.latest_checkpoint(run_dir)
    reference, metadata = checkpoint.load_model(latest)

    from_run = load_pretrained(run_dir)
    from_checkpoint = load_pretrained(latest)
    assert from_run.provenance["kind"] == "run_dir" and from_run.provenance["step"] == 2
    assert from_checkpoint.provenance["kind"] == "checkpoint"
    assert from_run.provenance["checkpoint"] == os.path.abspath(latest)
    assert from_run.provenance["vocab_sha256"] == metadata["vocab_sha256"]
    assert from_run.lower_case == metadata["lower_case"]
    model = task_model(from_run.config, 2)
    model.load_encoder(from_run.state_dict)
    for name, tensor in model.bert.state_dict().items():
        expected = reference.bert.state_dict()[name]
        torch.testing.assert_close(tensor, expected[: tensor.shape[0]], atol=0, rtol=0)
