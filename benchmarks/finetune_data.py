"""Fine-tuning's data layer on the real GLUE and SQuAD files: seconds to read and encode each,
against `transformers.BertTokenizerFast` doing the same tokenization in the same run, and how
often SQuAD's gold answer spans read back as the gold text (needs `../shared/data`).

    python benchmarks/finetune_data.py [--data ../shared/data] [--max-seq-length 128]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

from bertforge.pipelines.contract.tokenization import load_tokenizer, read_vocab
from bertforge.training.finetune.features import encode_examples
from bertforge.training.finetune.glue_data import read_examples
from bertforge.training.finetune.metrics import normalize_answer, squad_evaluate
from bertforge.training.finetune.squad import postprocess_predictions, read_squad, squad_features
from bertforge.training.finetune.tasks import GLUE_TASKS, glue_dir_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


def glue_rows(data: str, tokenizer, hf, max_seq_length: int) -> list[str]:
    rows = []
    for name, spec in GLUE_TASKS.items():
        for path in glue_dir_files(os.path.join(data, "glue"), spec):
            examples, read_s = timed(read_examples, path, spec)
            batch, ours_s = timed(encode_examples, tokenizer, examples, max_seq_length)
            texts_b = [e.text_b for e in examples] if examples[0].text_b is not None else None
            theirs, hf_s = timed(hf, [e.text_a for e in examples], texts_b, truncation=True,
                                 max_length=max_seq_length, padding="max_length")  # fmt: skip
            same = batch["input_ids"].tolist() == theirs["input_ids"]
            where = f"{name} {os.path.basename(path)}"
            rows.append(f"| {where} | {len(examples):,} | {read_s:.2f} | {ours_s:.2f} "
                        f"| {hf_s:.2f} | {same} |")  # fmt: skip
    return rows


def squad_rows(data: str, tokenizer, hf) -> list[str]:
    examples, read_s = timed(read_squad, os.path.join(data, "squad", "dev-v1.1.json"))
    features, ours_s = timed(squad_features, tokenizer, examples, 384, 128, 64, training=True)
    _, hf_s = timed(hf, [e.question.lstrip() for e in examples], [e.context for e in examples],
                    truncation="only_second", max_length=384, stride=128, padding="max_length",
                    return_overflowing_tokens=True, return_offsets_mapping=True)  # fmt: skip
    starts, ends = features["start_positions"], features["end_positions"]
    labelled = (starts > 0).nonzero().flatten().tolist()
    exact = 0
    for row in labelled:
        example = examples[int(features["example_index"][row])]
        offsets = features["offset_mapping"][row]
        text = example.context[offsets[starts[row], 0] : offsets[ends[row], 1]]
        exact += normalize_answer(text) == normalize_answer(example.answers[0])
    start_logits = torch.zeros(features["input_ids"].shape)
    end_logits = torch.zeros(features["input_ids"].shape)
    rows = torch.arange(len(starts))
    start_logits[rows, starts], end_logits[rows, ends] = 10.0, 10.0
    start_logits[:, 0] = end_logits[:, 0] = 0.0  # [CLS] labels carry no peak
    predictions, post_s = timed(postprocess_predictions, examples, features, start_logits,
                                end_logits)  # fmt: skip
    score = squad_evaluate(examples, predictions)
    return [
        f"| squad dev-v1.1.json (384/128) | {len(examples):,} questions, {len(starts):,} windows "
        f"| {read_s:.2f} | {ours_s:.2f} | {hf_s:.2f} | - |",
        "",
        f"gold spans that read back as the gold text: {exact:,}/{len(labelled):,} "
        f"= {exact / len(labelled):.4f}; post-processing of peaks on them: {post_s:.2f} s, "
        f"EM {score['exact_match']:.2f}, F1 {score['f1']:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_data = os.path.join(REPO, "..", "shared", "data")
    parser.add_argument("--data", default=default_data, help="holds glue/, squad/ and the vocab")
    parser.add_argument("--max-seq-length", type=int, default=128)
    args = parser.parse_args()
    vocab = os.path.join(args.data, "bert-base-uncased-vocab.txt")
    tokenizer = load_tokenizer(vocab, True)
    hf = transformers.BertTokenizerFast(vocab=read_vocab(vocab), do_lower_case=True)
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print("| file | examples | read s | encode s (ours) | encode s (BertTokenizerFast) "
          "| same ids |\n|---|---|---|---|---|---|")  # fmt: skip
    print("\n".join(glue_rows(args.data, tokenizer, hf, args.max_seq_length)))
    print("\n".join(squad_rows(args.data, tokenizer, hf)))


if __name__ == "__main__":
    main()
