"""SQuAD v1.1: read the official JSON, split it by article, windows of features, answers back.

Features follow Hugging Face's `run_qa.py` (itself Google's `run_squad.py` on fast tokenizers):
`[CLS] question [SEP] context window [SEP]`, the question cut to `max_query_length` tokens, long
contexts cut into overlapping windows. `doc_stride` is the OVERLAP between windows, as in
run_qa's `--doc_stride` and the `stride` of a fast tokenizer (Google's run_squad instead steps by
`doc_stride`); a window's tokens equal `BertTokenizerFast(question, context, truncation=
"only_second", stride=doc_stride, return_overflowing_tokens=True)` for a question within the
limit. Training labels are the first gold answer's token span, or [CLS] (0, 0) in a window that
does not hold the whole answer. `offset_mapping` maps each context token back to its characters
in the context (-1 elsewhere), which is how predicted spans become answer text.

Predicted spans are chosen as Google's `run_squad.py` `write_predictions` chooses them, so that
the scores are the ones the BERT paper's numbers are: the `n_best` highest start and end logits of
a window over ALL its positions (a question token or [CLS] among them takes a candidate's place,
as there), then only spans inside the context, end >= start, at most `max_answer_length` tokens,
starting at a token this window holds with the most context (`max_context`: of the windows that
hold a token, the one where min(tokens left, tokens right) + 0.01 x window length is highest; a
token near a window's edge is predicted from the next window, which sees both sides of it).

Only `dev-v1.1.json` is available on this machine, so fine-tuning here trains on some of its
articles and evaluates on the others (`split_squad`): scores are not comparable with published
SQuAD dev numbers, which train on the 87k questions of train-v1.1.json.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from bertforge.training.finetune.config import squad_window
from bertforge.training.finetune.features import (
    MODEL_INPUTS,
    bert_special_tokens,
    pad_rows,
    special_id,
)

SQUAD_LABELS = ("start_positions", "end_positions")
NOT_CONTEXT = -1  # offset_mapping of the question, special and padding tokens


@dataclass
class SquadExample:
    id: str
    question: str
    context: str
    answers: list[str]  # every gold answer (dev has 1-6); training uses the first
    answer_starts: list[int]  # character offsets in context
    title: str = ""  # the article, the unit of split_squad


def _field(record: dict, key: str, kind: type | tuple[type, ...], path: str, where: str):
    if not isinstance(record, dict) or key not in record:
        raise ValueError(f"{path}: {where} has no {key!r} (not SQuAD v1.1's format)")
    value = record[key]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{path}: {where}: {key!r} is a {type(value).__name__}, not {names}")
    return value


def _read_question(qa: dict, context: str, title: str, path: str, where: str) -> SquadExample:
    qid = str(_field(qa, "id", (str, int), path, where))
    where = f"question {qid!r}"
    answers = _field(qa, "answers", list, path, where)
    if not answers and qa.get("is_impossible") is True:  # SQuAD v2.0's unanswerable questions
        raise ValueError(f"{path}: {where} is unanswerable (is_impossible: SQuAD v2.0's format); "
                         "--task squad reads SQuAD v1.1, whose every question has an answer")
    if not answers:
        raise ValueError(f"{path}: {where} has no answers (SQuAD v1.1 has one or more)")
    texts = [_field(a, "text", str, path, where) for a in answers]
    starts = [_field(a, "answer_start", int, path, where) for a in answers]
    for text, start in zip(texts, starts, strict=True):
        if context[start : start + len(text)] != text:
            raise ValueError(
                f"{path}: {where}: answer {text!r} is not at character {start} of its context"
            )
    question = _field(qa, "question", str, path, where)
    return SquadExample(qid, question, context, texts, starts, title)


def read_squad(path: str) -> list[SquadExample]:
    """Every question of a SQuAD v1.1 JSON file (`{"data": [{"title", "paragraphs": [{"context",
    "qas": [{"id", "question", "answers": [{"text", "answer_start"}]}]}]}]}`), in file order."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        dataset = json.loads(data.decode("utf-8-sig"))  # a BOM taken, as the GLUE reader's
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: not UTF-8 text ({error.reason})") from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}, line {error.lineno} column {error.colno}: not JSON ({error.msg})"
        ) from None
    examples, seen = [], set()
    for number, article in enumerate(_field(dataset, "data", list, path, "the file")):
        where = f"article {number}"
        title = str(_field(article, "title", str, path, where))
        for paragraph in _field(article, "paragraphs", list, path, f"article {title!r}"):
            context = _field(paragraph, "context", str, path, f"a paragraph of {title!r}")
            for qa in _field(paragraph, "qas", list, path, f"a paragraph of {title!r}"):
                example = _read_question(qa, context, title, path, f"a question of {title!r}")
                if example.id in seen:
                    raise ValueError(f"{path}: question id {example.id!r} appears twice")
                seen.add(example.id)
                examples.append(example)
    if not examples:
        raise ValueError(f"{path}: no questions (an empty SQuAD file)")
    return examples


def split_squad(
    examples: Sequence[SquadExample], dev_fraction: float = 0.2, seed: int = 0
) -> tuple[list[SquadExample], list[SquadExample]]:
    """(train, dev) with whole articles on one side, so no paragraph is in both: the articles
    ordered by sha256(seed, title) (the same split on any machine and Python), the first
    round(dev_fraction x articles) (at least one) to dev. Both keep the file's order."""
    if not 0 < dev_fraction < 1:
        raise ValueError(f"dev_fraction must be between 0 and 1, not {dev_fraction}")
    titles = list(dict.fromkeys(e.title for e in examples))
    if len(titles) < 2:
        raise ValueError(f"splitting by article needs at least two articles, not {len(titles)}")
    order = sorted(titles, key=lambda t: hashlib.sha256(f"{seed}\0{t}".encode()).hexdigest())
    num_dev = min(len(titles) - 1, max(1, round(dev_fraction * len(titles))))
    dev_titles = set(order[:num_dev])
    train = [e for e in examples if e.title not in dev_titles]
    dev = [e for e in examples if e.title in dev_titles]
    return train, dev


def window_starts(num_tokens: int, window: int, stride: int) -> list[int]:
    """First context token of each window: windows of `window` tokens overlapping by `stride`,
    the last one reaching the end (the `tokenizers` library's overflow rule)."""
    starts = [0]
    while starts[-1] + window < num_tokens:
        starts.append(starts[-1] + window - stride)
    return starts


def _answer_span(example: SquadExample, offsets: np.ndarray) -> tuple[int, int] | None:
    """(first, last) index into `offsets` (one window's context tokens) of the first answer, or
    None when the window does not hold all of it (run_qa's rule)."""
    start_char = example.answer_starts[0]
    end_char = start_char + len(example.answers[0])
    if len(offsets) == 0 or not (offsets[0, 0] <= start_char and offsets[-1, 1] >= end_char):
        return None
    first = int(np.searchsorted(offsets[:, 0], start_char, side="right")) - 1
    last = int(np.searchsorted(offsets[:, 1], end_char, side="left"))
    return first, last


def max_context(starts: Sequence[int], stops: Sequence[int]) -> list[np.ndarray]:
    """For each window [start, stop) of one context's tokens: whether it is, for each of its
    tokens, the window with the most context (Google's `_check_is_max_context`: the highest
    min(left, right) + 0.01 x length, the first window on a tie)."""
    num_tokens = max(stops, default=0)
    best_score = np.full(num_tokens, -np.inf)
    best_window = np.zeros(num_tokens, dtype=np.int64)
    for window, (start, stop) in enumerate(zip(starts, stops, strict=True)):
        position = np.arange(stop - start)
        score = np.minimum(position, stop - start - 1 - position) + 0.01 * (stop - start)
        better = score > best_score[start:stop]
        best_score[start:stop][better] = score[better]
        best_window[start:stop][better] = window
    return [best_window[start:stop] == window
            for window, (start, stop) in enumerate(zip(starts, stops, strict=True))]


def squad_features(
    tokenizer: Tokenizer,
    examples: Sequence[SquadExample],
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    training: bool = False,
) -> dict[str, torch.Tensor]:
    """One row per window: MODEL_INPUTS (int64 [F, max_seq_length]); `example_index` [F] (the
    example's position in `examples`); `offset_mapping` [F, max_seq_length, 2] (context
    characters [start, end) of each context token, -1 elsewhere); `max_context` [F,
    max_seq_length] (bool: a context token whose most-context window this is); when training,
    SQUAD_LABELS."""
    window = squad_window(max_seq_length, max_query_length)  # the shortest a window can be
    if max_query_length < 1 or window <= doc_stride:
        raise ValueError(
            f"max_seq_length {max_seq_length} leaves {window} context tokens after a"
            f" {max_query_length}-token question: more than doc_stride {doc_stride} are needed"
        )
    tokenizer = bert_special_tokens(tokenizer)
    cls_id, sep_id = special_id(tokenizer, "[CLS]"), special_id(tokenizer, "[SEP]")
    questions = [e.ids[:max_query_length] for e in
                 tokenizer.encode_batch_fast([e.question.lstrip() for e in examples])]  # fmt: skip
    contexts = list(dict.fromkeys(e.context for e in examples))  # each paragraph encoded once
    encoded = {
        text: (encoding.ids, np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2))
        for text, encoding in zip(contexts, tokenizer.encode_batch(contexts), strict=True)
    }
    rows = {name: [] for name in (*MODEL_INPUTS, "example_index", *SQUAD_LABELS)}
    windows = []  # (context offsets, first context token, first feature position, stop)
    most_context = []  # per window: its max_context over its context tokens
    for index, (example, question) in enumerate(zip(examples, questions, strict=True)):
        context_ids, context_offsets = encoded[example.context]
        budget = max_seq_length - len(question) - 3
        head = [cls_id, *question, sep_id]
        starts = window_starts(len(context_ids), budget, doc_stride)
        stops = [min(start + budget, len(context_ids)) for start in starts]
        most_context.extend(max_context(starts, stops))
        for start, stop in zip(starts, stops, strict=True):
            rows["input_ids"].append(head + context_ids[start:stop] + [sep_id])
            rows["token_type_ids"].append([0] * len(head) + [1] * (stop - start + 1))
            rows["example_index"].append(index)
            windows.append((context_offsets, start, len(head), stop))
            if training:
                span = _answer_span(example, context_offsets[start:stop])
                first, last = (0, 0) if span is None else (s + len(head) for s in span)
                rows["start_positions"].append(first)
                rows["end_positions"].append(last)
    features = pad_rows(
        rows["input_ids"], rows["token_type_ids"], max_seq_length, special_id(tokenizer, "[PAD]")
    )
    features["example_index"] = torch.tensor(rows["example_index"], dtype=torch.int64)
    offsets = np.full((len(windows), max_seq_length, 2), NOT_CONTEXT, dtype=np.int64)
    is_max_context = np.zeros((len(windows), max_seq_length), dtype=bool)
    for feature, (context_offsets, start, position, stop) in enumerate(windows):
        offsets[feature, position : position + stop - start] = context_offsets[start:stop]
        is_max_context[feature, position : position + stop - start] = most_context[feature]
    features["offset_mapping"] = torch.from_numpy(offsets)
    features["max_context"] = torch.from_numpy(is_max_context)
    if training:
        for name in SQUAD_LABELS:
            features[name] = torch.tensor(rows[name], dtype=torch.int64)
    return features


def best_spans(
    features: dict[str, torch.Tensor],
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per window (score, start token, end token) of its best span, as run_squad.py picks it:
    among the `n_best` highest start and end logits of ALL its positions, the pairs inside the
    context, starting at a `max_context` token, end >= start, at most `max_answer_length`
    tokens; score = start + end logit, -inf when the window has no such span. (Taking the top
    `n_best` of the context tokens alone found spans run_squad.py never considers.)

    Padding is never among the `n_best`: evaluation trims a batch to its longest row, so a
    row's padding logits exist or not by its batch-mates, and a score must not depend on the
    batch size or the number of workers (run_squad.py's padding logits are trained down: its
    loss is a softmax over every position)."""
    is_padding = features["attention_mask"] == 0
    start = start_logits.float().masked_fill(is_padding, float("-inf"))
    end = end_logits.float().masked_fill(is_padding, float("-inf"))
    k = min(n_best, start.shape[1])
    top_start, start_index = start.topk(k, dim=1)
    top_end, end_index = end.topk(k, dim=1)
    is_context = features["offset_mapping"][..., 0] >= 0
    may_start = (is_context & features["max_context"]).gather(1, start_index)
    may_end = is_context.gather(1, end_index)
    scores = top_start[:, :, None] + top_end[:, None, :]  # [F, k starts, k ends]
    length = end_index[:, None, :] - start_index[:, :, None] + 1
    valid = may_start[:, :, None] & may_end[:, None, :]
    valid &= (length >= 1) & (length <= max_answer_length)
    scores = scores.masked_fill(~valid, float("-inf"))
    best_score, best = scores.flatten(1).max(dim=1)
    rows = torch.arange(len(best))
    return best_score, start_index[rows, best // k], end_index[rows, best % k]


# The answer of a question with no valid span among the n best: Google's run_squad.py
# (`write_predictions` appends `_NbestPrediction(text="empty", ...)` to an empty n-best list)
# and Hugging Face's run_qa.py (`postprocess_qa_predictions`) both write "empty"; "" was ours.
NO_VALID_SPAN = "empty"


def postprocess_predictions(
    examples: Sequence[SquadExample],
    features: dict[str, torch.Tensor],
    start_logits: torch.Tensor | np.ndarray,
    end_logits: torch.Tensor | np.ndarray,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """{question id: answer text}: the best span over all windows of each example (run_squad's
    n-best search, vectorised: `best_spans`), cut from the context by the offsets;
    `NO_VALID_SPAN` when none is valid (every question has its entry, so the official script
    scores it).
    The logits are [F, max_seq_length] tensors or numpy arrays, in the features' row order."""
    start_logits, end_logits = torch.as_tensor(start_logits), torch.as_tensor(end_logits)
    if start_logits.shape != features["input_ids"].shape or end_logits.shape != start_logits.shape:
        raise ValueError(
            f"logits of shape {tuple(start_logits.shape)}/{tuple(end_logits.shape)} for features"
            f" of shape {tuple(features['input_ids'].shape)}"
        )
    scores, starts, ends = best_spans(features, start_logits, end_logits, n_best, max_answer_length)
    scores, starts, ends = scores.tolist(), starts.tolist(), ends.tolist()
    best: dict[int, int] = {}  # example -> its best window
    for feature, example in enumerate(features["example_index"].tolist()):
        if example not in best or scores[feature] > scores[best[example]]:
            best[example] = feature
    offsets = features["offset_mapping"]
    predictions = {example.id: NO_VALID_SPAN for example in examples}
    for example, feature in best.items():
        if scores[feature] > float("-inf"):
            first = int(offsets[feature, starts[feature], 0])
            last = int(offsets[feature, ends[feature], 1])
            predictions[examples[example].id] = examples[example].context[first:last]
    return predictions
