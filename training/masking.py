"""Dynamic masked-LM masking, Google-exact, as pure numpy functions.

The rules are those of Google's `create_pretraining_data.py` (DESIGN.md, "Field facts"):

- `num_to_predict = min(max_predictions, max(1, round(num_tokens * mask_prob)))`, counting the
  special tokens of the sequence, as Google does;
- the predicted positions are a uniform random subset (without replacement) of the non-special
  positions;
- each predicted position (each predicted *word* with whole-word masking) becomes `[MASK]` with
  p 0.8, a random non-special token with p 0.1, and stays unchanged with p 0.1.

Departures from Google's code, all deliberate (the same list is in DESIGN.md, "The loader
(Python API), masking and packing"):

1. Whole-word masking draws 80/10/10 once per word, not per piece. Google draws per piece, so
   a word can come out half `[MASK]`, half visible, and its visible pieces give the masked ones
   away: a bug there (DESIGN.md, "Field facts").
2. With whole-word masking, a `##` piece never joins a word across a special token. Google's
   candidate loop skips `[CLS]`/`[SEP]` but still appends a `##` piece to the last candidate
   word, so a `##` piece right after `[SEP]` is glued to the last word of segment A and masked
   with it: a bug there.
3. Never predicted: `[PAD]`, `[UNK]`, `[MASK]` and every bracketed token (`[unused17]`), besides
   `[CLS]`/`[SEP]`. Google excludes only `[CLS]` and `[SEP]`, so `[UNK]` is a masked-LM target
   there: predicting "unknown" teaches nothing and spends a prediction slot (1 of 20 at 128
   tokens) that a real token could use. `num_to_predict` still counts every token of the
   sequence, specials included, exactly as Google's `len(tokens) * masked_lm_prob` does.
4. The random replacement (the 10 % "random token") is drawn uniformly from the non-special
   tokens only. Google draws `vocab_words[rng.randint(0, len(vocab_words) - 1)]` from the whole
   vocabulary, so it can put `[CLS]`, `[SEP]`, `[PAD]`, `[MASK]` or an untrained `[unusedN]`
   into a sentence: a `[SEP]` inside a segment contradicts the segment ids, and `[unused]`
   embeddings are never trained.

Besides, the data itself differs from Google's in two ways that shape what is masked: masks are
drawn at load time, new every epoch (dynamic masking, as RoBERTa), instead of being fixed in the
files by `dupe_factor` copies, so the shards stay small and no two epochs see the same masks; and
prepare drops single-sentence documents (`too_few_sentences`), where Google makes pairs from them
whose B is always random, which skews next-sentence labels towards "random" for no real pair.
What is *not* a departure: the 80/10/10 treatment is one uniform per position (< 0.8 `[MASK]`,
< 0.9 unchanged, else random) where Google draws twice (< 0.8, then < 0.5): the same
probabilities; and the random streams are Philox per sample, not Python's `random`, so masks
equal Google's in distribution, not bit for bit.

Randomness. Every random number of a sample comes from its own Philox stream, keyed by
(seed, epoch) with the global sample index in the counter, so a sample's mask depends on
(seed, epoch, index) only: not on the batch it lands in, the rank, or the number of workers.
A sample of n tokens draws exactly `3 x n` uniforms (`draw_uniforms`): row 0 orders the
positions (selection keys), row 1 picks the 80/10/10 treatment, row 2 picks the random token.
`mask_sequence` masks one sample from a Generator; `mask_batch` masks a padded batch from the
stacked uniforms, vectorised over rows, and gives exactly what `mask_sequence` gives per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy (and Hugging Face) skips
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MASK_THRESHOLD = 0.8  # u < 0.8: [MASK]
KEEP_THRESHOLD = 0.9  # 0.8 <= u < 0.9: unchanged; u >= 0.9: random token
NUM_UNIFORM_ROWS = 3  # selection key, treatment, random token
# Google's max_predictions_per_seq for its two standard lengths (at mask_prob 0.15).
GOOGLE_MAX_PREDICTIONS = {128: 20, 512: 80}

_KEY_BITS = 53  # a float64 uniform from numpy is k / 2**53: 53 bits, exactly representable
_POSITION_BITS = 10  # composite integer keys hold positions < 1024 (BERT stops at 512)
_NO_KEY = np.iinfo(np.int64).max  # sorts after every candidate


def num_to_predict(num_tokens: int, max_predictions: int, mask_prob: float) -> int:
    """Google's rule; `round` is Python's (half to even), as Google's `int(round(...))` is."""
    return min(max_predictions, max(1, int(round(num_tokens * mask_prob))))


def num_to_predict_array(lengths: np.ndarray, max_predictions: int, mask_prob: float) -> np.ndarray:
    """`num_to_predict` per row; `np.rint` also rounds half to even, on the same float64 product."""
    counts = np.rint(lengths.astype(np.float64) * mask_prob).astype(np.int64)
    return np.minimum(max_predictions, np.maximum(1, counts))


def default_max_predictions(max_seq_length: int, mask_prob: float = 0.15) -> int:
    """Google's 20 at 128 and 80 at 512 (at mask_prob 0.15); otherwise round(length x prob)."""
    if mask_prob == 0.15 and max_seq_length in GOOGLE_MAX_PREDICTIONS:
        return GOOGLE_MAX_PREDICTIONS[max_seq_length]
    return max(1, int(round(max_seq_length * mask_prob)))


@dataclass(frozen=True, eq=False)
class MaskingVocab:
    """The per-vocabulary tables masking needs, built once (lookups by id, vectorised)."""

    mask_id: int
    is_special: np.ndarray  # bool[vocab_size]: never a candidate for prediction
    is_subword: np.ndarray  # bool[vocab_size]: a `##` continuation piece
    random_token_ids: np.ndarray  # int64: what a "random token" replacement draws from

    @property
    def vocab_size(self) -> int:
        return len(self.is_special)

    @classmethod
    def from_ids(
        cls,
        *,
        special_ids: Sequence[int] | np.ndarray,
        mask_id: int,
        vocab_size: int,
        random_token_ids: Sequence[int] | np.ndarray,
        is_subword: np.ndarray | None = None,
    ) -> MaskingVocab:
        is_special = np.zeros(vocab_size, dtype=bool)
        is_special[np.asarray(special_ids, dtype=np.int64)] = True
        random_ids = np.asarray(random_token_ids, dtype=np.int64)
        if len(random_ids) == 0 or is_special[random_ids].any():
            raise ValueError("random_token_ids must be non-empty and hold no special id")
        if is_subword is None:
            is_subword = np.zeros(vocab_size, dtype=bool)
        if len(is_subword) != vocab_size:
            raise ValueError(f"is_subword has {len(is_subword)} ids, vocab_size is {vocab_size}")
        return cls(mask_id, is_special, np.asarray(is_subword, dtype=bool), random_ids)

    @classmethod
    def from_tokens(cls, tokens: Sequence[str]) -> MaskingVocab:
        """From the vocabulary in id order (vocab.txt's lines).

        Specials are the five BERT tokens plus every other bracketed token (`[unused17]`, ...):
        none of them is ever predicted or drawn as a random replacement. Ids come from the
        vocabulary, never hard-coded: Google's files put [MASK] at 103, bertforge's at 4.
        """
        index = {token: i for i, token in enumerate(tokens)}
        missing = [t for t in SPECIAL_TOKENS if t not in index]
        if missing:
            raise ValueError(f"the vocabulary lacks the BERT special tokens {missing}")
        special = np.array([_is_bracketed(t) for t in tokens], dtype=bool)
        special[[index[t] for t in SPECIAL_TOKENS]] = True
        return cls(
            mask_id=index["[MASK]"],
            is_special=special,
            is_subword=np.array([t.startswith("##") for t in tokens], dtype=bool),
            random_token_ids=np.flatnonzero(~special).astype(np.int64),
        )


def _is_bracketed(token: str) -> bool:
    return len(token) > 2 and token.startswith("[") and token.endswith("]")


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The Generator of one sample: Philox keyed by (seed, epoch), counter at the sample index.

    Philox is counter-based: streams of different counters never overlap (a sample draws a
    few hundred numbers, the counter space between two indices is 2**128 blocks).
    """
    for name, value in (("seed", seed), ("epoch", epoch), ("index", index)):
        if not 0 <= value < 2**64:
            raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    key = np.array([seed, epoch], dtype=np.uint64)
    counter = np.array([0, 0, index, 0], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


def draw_uniforms(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    """All the randomness of one sample of `num_tokens` tokens: float64[3, num_tokens]."""
    return rng.random((NUM_UNIFORM_ROWS, num_tokens))


class SampleStreams:
    """`sample_rng(seed, epoch, i)` for many i, without building a generator per sample.

    Constructing a Philox costs ~8 us; resetting the state of one costs ~1 us. The state set
    here is exactly that of a fresh `sample_rng(seed, epoch, i)` (empty buffer), so the draws
    are identical (a test holds it).
    """

    def __init__(self, seed: int, epoch: int):
        self._generator = sample_rng(seed, epoch, 0)
        self._bit_generator = self._generator.bit_generator
        self._fresh_state = self._bit_generator.state

    def uniforms(self, index: int, num_tokens: int) -> np.ndarray:
        if not 0 <= index < 2**64:
            raise ValueError(f"index must be in [0, 2**64), got {index}")
        self._fresh_state["state"]["counter"][2] = index
        self._bit_generator.state = self._fresh_state
        return draw_uniforms(self._generator, num_tokens)

    def batch_uniforms(self, indices: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
        """float64[3, B, width]: row b holds sample indices[b]'s uniforms, then padding (unused)."""
        uniforms = np.ones((NUM_UNIFORM_ROWS, len(indices), width))
        for row, (index, length) in enumerate(zip(indices.tolist(), lengths.tolist(), strict=True)):
            uniforms[:, row, :length] = self.uniforms(index, length)
        return uniforms


def mask_sequence(
    input_ids: np.ndarray,
    rng: np.random.Generator,
    *,
    special_ids: Sequence[int] | np.ndarray,
    mask_id: int,
    vocab_size: int,
    random_token_ids: Sequence[int] | np.ndarray,
    max_predictions: int,
    mask_prob: float,
    whole_word: bool = False,
    is_subword: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Mask one unpadded sequence; returns (masked_ids, labels), labels -100 where not predicted.

    The reference, per-sample form of `mask_batch` (which the loader uses): same draws, same
    result.
    """
    if whole_word and is_subword is None:
        raise ValueError("whole_word masking needs is_subword (which ids start with ##)")
    vocab = MaskingVocab.from_ids(
        special_ids=special_ids,
        mask_id=mask_id,
        vocab_size=vocab_size,
        random_token_ids=random_token_ids,
        is_subword=is_subword,
    )
    ids = np.asarray(input_ids, dtype=np.int64)[None, :]
    uniforms = draw_uniforms(rng, ids.shape[1])[:, None, :]
    masked, labels = mask_batch(
        ids,
        np.array([ids.shape[1]]),
        uniforms,
        vocab,
        max_predictions=max_predictions,
        mask_prob=mask_prob,
        whole_word=whole_word,
    )
    return masked[0], labels[0]


def mask_batch(
    input_ids: np.ndarray,
    lengths: np.ndarray,
    uniforms: np.ndarray,
    vocab: MaskingVocab,
    *,
    max_predictions: int,
    mask_prob: float,
    whole_word: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Mask a padded batch: int64[B, L] ids, lengths[B], uniforms float64[3, B, L].

    Positions at or past a row's length are padding: never predicted, left as they are.
    Returns (masked_ids int64[B, L], labels int64[B, L]).
    """
    if input_ids.ndim != 2 or uniforms.shape != (NUM_UNIFORM_ROWS, *input_ids.shape):
        raise ValueError(f"shape mismatch: ids {input_ids.shape}, uniforms {uniforms.shape}")
    width = input_ids.shape[1]
    real = np.arange(width) < lengths[:, None]
    candidate = real & ~vocab.is_special[np.where(real, input_ids, 0)]
    counts = num_to_predict_array(lengths, max_predictions, mask_prob)
    keys = order_keys(uniforms[0], candidate)
    if whole_word:
        predicted, treatment = _choose_words(input_ids, candidate, keys, uniforms[1], counts, vocab)
    else:
        predicted, treatment = _choose_positions(keys, candidate, counts), uniforms[1]
    return _apply_treatment(input_ids, predicted, treatment, uniforms[2], vocab)


def order_keys(selection_uniforms: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Distinct int64 keys that order candidates by uniform, ties by position; non-candidates last.

    Distinct keys make the choice independent of the sort algorithm (numpy's fast unstable
    sorts differ across builds in how they break ties). Up to 1,024 positions the key is
    `uniform x 2**53` (exact) shifted left past the position bits; longer rows use the rank of a
    stable sort, which orders the same way.
    """
    width = selection_uniforms.shape[-1]
    if width <= 1 << _POSITION_BITS:
        scaled = (selection_uniforms * float(1 << _KEY_BITS)).astype(np.int64)
        keys = (scaled << _POSITION_BITS) | np.arange(width, dtype=np.int64)
    else:
        order = np.argsort(selection_uniforms, axis=-1, kind="stable")
        keys = np.empty_like(order)
        np.put_along_axis(keys, order, np.arange(width, dtype=np.int64)[None, :], axis=-1)
    return np.where(candidate, keys, _NO_KEY)


def _choose_positions(keys: np.ndarray, candidate: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The `counts[b]` candidates of smallest key per row (all of them when fewer)."""
    num_chosen = np.minimum(counts, candidate.sum(axis=1))
    ordered = np.sort(keys, axis=1)
    # Keys are distinct, so "key <= the num_chosen-th smallest" picks exactly num_chosen.
    threshold = ordered[np.arange(len(keys)), np.maximum(num_chosen - 1, 0)]
    return candidate & (keys <= threshold[:, None]) & (num_chosen > 0)[:, None]


def _choose_words(
    input_ids: np.ndarray,
    candidate: np.ndarray,
    keys: np.ndarray,
    treatment_uniforms: np.ndarray,
    counts: np.ndarray,
    vocab: MaskingVocab,
) -> tuple[np.ndarray, np.ndarray]:
    """Whole-word choice: words in key order, each added while the total stays <= the count.

    A word is a candidate position plus the `##` candidates right after it; its key and its
    treatment uniform are those of its first piece. Returns (predicted, per-position treatment
    uniform, equal over the pieces of a word).
    """
    batch, width = input_ids.shape
    follows_candidate = np.zeros_like(candidate)
    follows_candidate[:, 1:] = candidate[:, :-1]
    is_subword = vocab.is_subword[np.where(candidate, input_ids, 0)]
    starts = candidate & ~(is_subword & follows_candidate)
    word_of = np.maximum(np.cumsum(starts, axis=1) - 1, 0)  # the word each position belongs to
    rows = np.arange(batch)[:, None]
    flat_word = (rows * width + word_of)[candidate]
    sizes = np.bincount(flat_word, minlength=batch * width).reshape(batch, width)
    start_row, start_col = np.nonzero(starts)
    start_word = word_of[start_row, start_col]
    word_keys = np.full((batch, width), _NO_KEY, dtype=np.int64)
    word_keys[start_row, start_word] = keys[start_row, start_col]
    word_treatment = np.zeros((batch, width))
    word_treatment[start_row, start_word] = treatment_uniforms[start_row, start_col]
    taken = _greedy_take(word_keys, sizes, counts)
    predicted = candidate & taken[rows, word_of]
    return predicted, word_treatment[rows, word_of]


def _greedy_take(word_keys: np.ndarray, sizes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Google's rule, per row: in key order, take a word if the total stays <= count, else skip."""
    num_words = int((sizes > 0).sum(axis=1).max(initial=0))
    order = np.argsort(word_keys, axis=1)[:, :num_words]  # distinct keys: any sort will do
    ordered_sizes = np.take_along_axis(sizes, order, axis=1)
    taken_in_order = np.zeros(ordered_sizes.shape, dtype=bool)
    total = np.zeros(len(sizes), dtype=np.int64)
    for column in range(num_words):  # sequential by nature; vectorised over the rows
        size = ordered_sizes[:, column]
        take = (size > 0) & (total + size <= counts)
        total += np.where(take, size, 0)
        taken_in_order[:, column] = take
    taken = np.zeros(sizes.shape, dtype=bool)
    np.put_along_axis(taken, order, taken_in_order, axis=1)
    return taken


def _apply_treatment(
    input_ids: np.ndarray,
    predicted: np.ndarray,
    treatment: np.ndarray,
    token_uniforms: np.ndarray,
    vocab: MaskingVocab,
) -> tuple[np.ndarray, np.ndarray]:
    """80 % [MASK], 10 % random token (one per piece), 10 % unchanged; labels = original ids."""
    masked = input_ids.astype(np.int64, copy=True)
    masked[predicted & (treatment < MASK_THRESHOLD)] = vocab.mask_id
    to_random = predicted & (treatment >= KEEP_THRESHOLD)
    num_random = len(vocab.random_token_ids)
    picks = (token_uniforms[to_random] * num_random).astype(np.int64)
    masked[to_random] = vocab.random_token_ids[np.minimum(picks, num_random - 1)]
    labels = np.where(predicted, input_ids, IGNORE_INDEX).astype(np.int64)
    return masked, labels
