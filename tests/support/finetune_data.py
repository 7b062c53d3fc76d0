"""Tiny fine-tuning inputs: a random-init BERT as a Hugging Face directory, SST-2-style TSVs."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

POSITIVE = ("good", "great", "fun", "moving", "superb", "charming")
NEGATIVE = ("bad", "dull", "boring", "awful", "weak", "tedious")
FILLERS = ("the", "film", "is", "a", "movie", "plot", "acting", "was", "and", "very", "it", "'s")
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
VOCAB = SPECIALS + POSITIVE + NEGATIVE + FILLERS + ("##s", "##ly", ".", ",")


def write_vocab(path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(VOCAB) + "\n")
    return path


def tiny_bert_dir(root: str, seed: int = 0, vocab_path: str | None = None,
                  max_position_embeddings: int = 512) -> str:
    """A 2-layer, 32-wide BERT with random weights on VOCAB (or the vocabulary at `vocab_path`),
    exported like a pretraining run's Hugging Face directory."""
    from bertforge.pipelines.contract.tokenization import read_vocab
    from bertforge.training.hf_interop import export_hf_directory
    from bertforge.training.model import BertConfig, BertForPreTraining

    os.makedirs(root, exist_ok=True)
    vocab_path = vocab_path or write_vocab(os.path.join(root, "vocab-src.txt"))
    torch.manual_seed(seed)
    config = BertConfig(len(read_vocab(vocab_path)), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=max_position_embeddings)
    model = BertForPreTraining(config)
    return export_hf_directory(model.state_dict(), config, vocab_path, True,
                               os.path.join(root, "tiny-bert"))


def sst2_lines(num_lines: int, seed: int) -> list[tuple[str, int]]:
    """Sentences whose label is the sentiment word they hold: learnable by a tiny model."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(num_lines):
        label = int(rng.integers(0, 2))
        word = rng.choice(POSITIVE if label else NEGATIVE)
        words = [str(w) for w in rng.choice(FILLERS, size=int(rng.integers(3, 9)))]
        words.insert(int(rng.integers(0, len(words) + 1)), str(word))
        lines.append((" ".join(words) + " ", label))
    return lines


def write_sst2_tsv(path: str, num_lines: int, seed: int) -> str:
    """GLUE's SST-2 layout: a `sentence<TAB>label` header, one example a line."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("sentence\tlabel\n")
        for sentence, label in sst2_lines(num_lines, seed):
            f.write(f"{sentence}\t{label}\n")
    return path


def write_squad_json(path: str, num_articles: int = 5, seed: int = 0) -> str:
    """SQuAD v1.1's JSON layout: articles of paragraphs of questions; each answer is the
    sentiment word of its paragraph's first sentence (so answer_start is exact)."""
    rng = np.random.default_rng(seed)
    data = []
    for article in range(num_articles):
        paragraphs = []
        for paragraph in range(2):
            sentences = [sentence for sentence, _ in sst2_lines(4, int(rng.integers(1 << 30)))]
            context = ". ".join(s.strip() for s in sentences) + "."
            qas = []
            for question in range(3):
                word = next(w for w in context.split() if w in POSITIVE + NEGATIVE)
                qas.append({
                    "id": f"a{article}p{paragraph}q{question}",
                    "question": f"what is the {FILLERS[question]} film ?",
                    "answers": [{"text": word, "answer_start": context.index(word)}],
                })
            paragraphs.append({"context": context, "qas": qas})
        data.append({"title": f"Article_{article}", "paragraphs": paragraphs})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"version": "1.1", "data": data}, f)
    return path
