"""Tiny fine-tuning inputs: a random-init BERT as a Hugging Face directory, SST-2-style TSVs."""

from __future__ import annotations

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


def tiny_bert_dir(root: str, seed: int = 0) -> str:
    """bert_tiny on VOCAB with random weights, exported like a pretraining run's HF directory."""
    from bertforge.training.hf_interop import export_hf_directory
    from bertforge.training.model import BertConfig, BertForPreTraining

    os.makedirs(root, exist_ok=True)
    vocab_path = write_vocab(os.path.join(root, "vocab-src.txt"))
    torch.manual_seed(seed)
    config = BertConfig(len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
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
