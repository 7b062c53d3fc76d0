"""Masked-LM and NSP accuracy on a validation split, each beside always guessing the split's
most frequent answer (its commonest token; its commoner NSP label)."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from bertforge.training.config import TrainConfig
from bertforge.training.distributed import all_reduce_sum
from bertforge.training.eval_options import EvalOptions
from bertforge.training.metrics import counted


@dataclass
class EvalResult:
    mlm_accuracy: float
    mlm_baseline_accuracy: float  # always predicting the split's most frequent token
    nsp_accuracy: float | None  # None: a model without a next-sentence head (BertForMaskedLM)
    # Always predicting the split's commoner NSP label: a small split is rarely 50/50 (57 rows,
    # 32 real next: 0.44 looked like a model, and was below the 0.56 of one constant guess).
    nsp_baseline_accuracy: float
    mlm_loss: float
    nsp_loss: float | None
    num_predictions: int
    num_sequences: int

    def to_dict(self) -> dict:
        return asdict(self)


def _to_stderr(line: str) -> None:
    """Progress beside a result: stdout holds `bertforge eval`'s JSON alone (`> result.json`,
    `| jq`), as `prepare`'s summary."""
    print(line, file=sys.stderr, flush=True)


class EvalProgress:
    """`[eval] 120/480 batches | 3.1 batches/s | 39 s` at most every `every_seconds` (and not
    for a split scored in less), so a long evaluation never looks hung."""

    def __init__(self, total: int | None, every_seconds: float = 10.0,
                 say: Callable[[str], None] = _to_stderr) -> None:
        self.total, self.every_seconds, self.say = total, every_seconds, say
        self.started = self.last = time.monotonic()

    def __call__(self, num_batches: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_seconds:
            return
        self.last = now
        elapsed = now - self.started
        of = f"/{self.total}" if self.total is not None else ""
        self.say(f"[eval] {num_batches}{of} batches | {num_batches / elapsed:.1f} batches/s | "
                 f"{elapsed:.0f} s")


@torch.no_grad()
def evaluate(model, batches, *, baseline_token_id: int, device: str = "cpu",
             max_batches: int | None = None,
             progress: Callable[[int], None] | None = None) -> EvalResult:
    """Accuracy over every batch of `batches` (the first `max_batches` of them, if given); sums
    are all-reduced when running distributed. `progress(batches_done)` is called per batch.

    The baseline is scored on exactly the positions the model is scored on. Counts and loss
    sums stay on `device` (the model's: NCCL takes no CPU tensor) and are read once at the
    end, so no batch waits for the one before it to be read back.
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be at least 1, got {max_batches}")
    device = torch.device(device)
    was_training = model.training
    model.eval()
    # correct MLM, predictions, baseline correct, correct NSP, instances, MLM and NSP loss
    # sums, instances whose B is the real next segment (label 0)
    totals = torch.zeros(8, dtype=torch.float64, device=device)
    for num_done, batch in enumerate(itertools.islice(batches, max_batches), start=1):
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        out = model(**batch)
        # Targets in the logits' layout ([N], or [B, W] with unfilled slots -100: see
        # training.model.PreTrainingOutput); NSP labels are [B], or [B, K] with empty slots
        # -100 in a packed batch. An argmax or the baseline id never equals -100.
        targets, nsp_targets = out.prediction_labels, batch["next_sentence_label"]
        predicted, instances = (targets != -100).sum(), (nsp_targets != -100).sum()
        values = (
            (out.prediction_logits.argmax(-1) == targets).sum(),
            predicted,
            (targets == baseline_token_id).sum(),
            (out.seq_relationship_logits.argmax(-1) == nsp_targets).sum(),
            instances,
            # A batch with nothing to score (a blank row: `loop.every_rank_a_row`) has NaN
            # mean losses; it adds 0, where a real NaN loss stays NaN.
            torch.where(predicted > 0, out.mlm_loss.double() * predicted, 0.0),
            torch.where(instances > 0, out.nsp_loss.double() * instances, 0.0),
            (nsp_targets == 0).sum(),
        )
        totals += torch.stack([value.double() for value in values])
        if progress is not None:
            progress(num_done)
    if dist.is_initialized():  # with one rank too: the same code path on any world size
        all_reduce_sum(totals, device)
    model.train(was_training)
    (correct, predicted, baseline, nsp_correct, sequences, mlm_loss, nsp_loss,
     real_next) = totals.tolist()
    if predicted == 0:
        raise ValueError("the evaluation split produced no batches (is it smaller than a batch?)")
    return EvalResult(
        mlm_accuracy=correct / predicted,
        mlm_baseline_accuracy=baseline / predicted,
        nsp_accuracy=nsp_correct / sequences,
        nsp_baseline_accuracy=max(real_next, sequences - real_next) / sequences,
        mlm_loss=mlm_loss / predicted,
        nsp_loss=nsp_loss / sequences,
        num_predictions=int(predicted),
        num_sequences=int(sequences),
    )


def evaluate_checkpoint(
    checkpoint_path: str, data_dir: str, options: EvalOptions | None = None, *,
    progress_seconds: float = 10.0,
) -> EvalResult:
    """Score a checkpoint (or a run directory's newest) on a split with fixed masks (seed,
    epoch 0), in this process, on `options.device`; a progress line every `progress_seconds`
    (`EvalProgress`).

    The masks are the checkpoint's run's: `options.seed` None takes its training seed, and
    its masking (share, predictions per row, whole words) is the run's, whose own validation
    and the demo's eval drew them, so `bertforge eval` of a run scores its rows as they did
    (on a GPU under its precision, as the run scored itself; on a CPU in fp32). It scores every
    row of the split, as the run's validation does with --eval-batches 0 or enough to cover
    it (`loop._Validation`; its last partial batch was left out before 2026-11-29, so the two
    differed where it had rows); --max-batches N scores the run's first N validation batches
    where --batch-size is the run's global one (workers x micro-batch). The baseline's guess
    is the validation split's most frequent token, as the run's validation takes it; of
    another split, the rows scored's (`baseline_rows`: the train split may be terabytes). A
    checkpoint saved before these were recorded takes TrainConfig's defaults."""
    from bertforge.training.checkpoint import load_model, positions_trained, read_newest
    from bertforge.training.data import (
        MaskingOptions,
        PretrainingLoader,
        ReadOptions,
        token_frequencies,
    )
    from bertforge.training.dataset_facts import DatasetFacts
    from bertforge.training.inputs import is_hf_model_dir

    options = options or EvalOptions()  # the defaults `bertforge eval` shows
    if is_hf_model_dir(checkpoint_path):
        model, metadata = load_hf_model(checkpoint_path)
    else:
        # A run directory's newest, read before a train still running there may remove it.
        checkpoint_path, (model, metadata) = read_newest(checkpoint_path, load_model)
    if DatasetFacts.read(data_dir).vocab_sha256 != metadata["vocab_sha256"]:
        raise ValueError(f"{data_dir} uses another vocabulary than checkpoint {checkpoint_path}")
    seed = options.seed
    if seed is None:
        seed = metadata.get("seed", TrainConfig.seed)  # saved before runs recorded it
    # max_predictions None: the loader takes the data's default (20 at 128 tokens, 80 at 512).
    loader = PretrainingLoader(
        data_dir, options.split, batch_size=options.batch_size, seed=seed, drop_last=False,
        # The run's MaskingOptions (saved before runs recorded them: the defaults, Google's).
        masking=MaskingOptions(**metadata.get("masking", {})),
        read=ReadOptions(verify_checksums=options.verify_checksums),
    )
    # The loader's bound on labels per row: the fixed-width sparse head (no host sync).
    model.max_predictions = loader.max_predictions_per_row
    max_batches = options.max_batches
    total = len(loader) if max_batches is None else min(max_batches, len(loader))
    progress = EvalProgress(total, every_seconds=progress_seconds)
    # The sequences scored, and their batches' size only where there are several (a batch of 200
    # said of 16 sequences read as 200 scored).
    scored = min(loader.num_samples, total * options.batch_size)
    baseline_token_id = most_frequent_token(
        token_frequencies(data_dir, options.split, baseline_rows(loader, options.split, scored)),
        data_dir)
    batches = counted(total, "batch", "batches") + (f" of {options.batch_size}" if total > 1
                                                     else "")
    progress.say(f"[eval] {checkpoint_path}: {counted(scored, 'sequence', 'sequences')} of "
                 f"the {options.split} split in {batches}")
    trained = positions_trained(metadata)
    if loader.max_seq_length > trained:  # as `finetune` warns of a longer fine-tune
        progress.say(f"[eval] warning: {data_dir} holds sequences of up to "
                     f"{loader.max_seq_length} tokens, longer than the {trained} this model was "
                     f"trained at: positions {trained + 1}-{loader.max_seq_length} keep their "
                     "random initial embeddings, so these numbers say little of the model")
    if metadata.get(NO_NSP_HEAD):
        progress.say(f"[eval] {checkpoint_path} has no next-sentence head (a masked-LM model): "
                     "its masked-LM head is scored alone")
    device = eval_device(options.device)
    with torch.autocast("cuda", dtype=torch.bfloat16,
                        enabled=device == "cuda" and metadata.get("precision") == "bf16"):
        result = evaluate(model.to(device), loader, baseline_token_id=baseline_token_id,
                          device=device, max_batches=max_batches, progress=progress)
    loader.wait_for_checksums()  # no numbers from shards whose bytes are not the manifest's
    if metadata.get(NO_NSP_HEAD):
        # The baseline stays: the split's, as the masked-LM one.
        result = dataclasses.replace(result, nsp_accuracy=None, nsp_loss=None)
    return result


# load_hf_model's word that the model has no next-sentence head (a BertForMaskedLM): its
# masked-LM head is scored alone, as NSP from fresh weights would be a coin's numbers.
NO_NSP_HEAD = "no_next_sentence_head"


def baseline_rows(loader, split: str, scored: int):
    """The rows whose most frequent token the baseline guesses: None (the whole split) for the
    validation split, as the run's own validation guesses (it is small), or where every row is
    scored; else the `scored` rows alone. `--split train --max-batches 10` streamed every row
    of the train split for its guess before scoring 10 batches."""
    if split == "validation" or scored >= loader.num_samples:
        return None
    return loader.epoch_order(loader.epoch)[:scored]


def load_hf_model(hf_dir: str):
    """A Hugging Face BERT directory (a `bertforge export`, Google's converted release) as an
    fp32 `BertForPreTraining` and what eval reads of a checkpoint's metadata: its vocabulary,
    its trained positions, and no run (masks of the default seed and masking). A model without
    the pretraining heads (a BertModel, a fine-tuned classifier) has nothing to score."""
    from bertforge.training.model import BertForPreTraining
    from bertforge.training.warm_start import load_weights_into, read_initial_weights

    initial = read_initial_weights(hf_dir)
    if "masked-LM head" in initial.lacking:
        raise ValueError(f"model {hf_dir} lacks BERT's pretraining heads "
                         f"({', '.join(initial.lacking)}): eval scores the masked-LM head (and "
                         "the next-sentence head), which a BertModel or a fine-tuned model has "
                         "not")
    model = BertForPreTraining(initial.config)
    load_weights_into(model, initial, f"model {hf_dir}")  # what it lacks: fresh weights
    return model, {"vocab_sha256": initial.vocab_sha256,
                   "positions_trained": initial.positions_trained,
                   "model_config": initial.config.to_dict(),
                   NO_NSP_HEAD: "next-sentence head" in initial.lacking}


def eval_device(asked: str) -> str:
    """"auto": "cuda" when torch sees a GPU, else "cpu"; "cpu" and "cuda" as asked."""
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return asked


def most_frequent_token(frequencies, data_dir: str) -> int:
    """The most frequent non-special token of `frequencies`: the MLM baseline's constant
    guess."""
    from bertforge.pipelines.contract.tokenization import SPECIAL_TOKENS, read_vocab

    counts = frequencies.copy()
    vocab = read_vocab(f"{data_dir}/vocab.txt")
    for token in SPECIAL_TOKENS:
        counts[vocab[token]] = 0  # [CLS]/[SEP] occur in every row but are never predicted
    return int(counts.argmax())
