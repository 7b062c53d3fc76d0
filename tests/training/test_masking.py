"""Masking: Google's counting and 80/10/10 rules, whole words, determinism per sample."""

from __future__ import annotations

import numpy as np
import pytest

from bertforge.training.masking import (
    IGNORE_INDEX,
    MaskingVocab,
    SampleStreams,
    default_max_predictions,
    draw_uniforms,
    mask_batch,
    mask_sequence,
    num_to_predict,
    num_to_predict_array,
    sample_rng,
)
from tests.training.conftest import google_layout_vocab, random_rows

VOCAB = google_layout_vocab()
MASKING = MaskingVocab.from_tokens(VOCAB)
INDEX = {t: i for i, t in enumerate(VOCAB)}
MASK_ID = INDEX["[MASK]"]


def kwargs(**overrides):
    base = dict(
        special_ids=np.flatnonzero(MASKING.is_special),
        mask_id=MASK_ID,
        vocab_size=len(VOCAB),
        random_token_ids=MASKING.random_token_ids,
        max_predictions=20,
        mask_prob=0.15,
        is_subword=MASKING.is_subword,
    )
    return base | overrides


def sequences(num: int, max_len: int = 128, seed: int = 0) -> list[np.ndarray]:
    rows = random_rows(np.random.default_rng(seed), num, max_len, VOCAB)
    return [r[0].astype(np.int64) for r in rows]


def google_reference(ids, uniforms, *, max_predictions, mask_prob, whole_word):
    """Google's loop written plainly (per-word 80/10/10, words not crossing specials)."""
    keys, treatment, token = uniforms
    words: list[list[int]] = []
    for i, token_id in enumerate(ids):
        if MASKING.is_special[token_id]:
            continue
        joins = whole_word and words and MASKING.is_subword[token_id] and words[-1][-1] == i - 1
        words[-1].append(i) if joins else words.append([i])
    words.sort(key=lambda w: (keys[w[0]], w[0]))  # Google: rng.shuffle(cand_indexes)
    k = num_to_predict(len(ids), max_predictions, mask_prob)
    masked, labels, count = ids.copy(), np.full(len(ids), IGNORE_INDEX), 0
    for word in words:
        if count >= k:
            break
        if count + len(word) > k:
            continue
        count += len(word)
        for i in word:
            labels[i] = ids[i]
            if treatment[word[0]] < 0.8:
                masked[i] = MASK_ID
            elif treatment[word[0]] >= 0.9:
                r = MASKING.random_token_ids
                masked[i] = r[min(int(token[i] * len(r)), len(r) - 1)]
    return masked, labels


def test_num_to_predict_is_googles_rule():
    assert num_to_predict(128, 20, 0.15) == 19
    assert num_to_predict(512, 80, 0.15) == 77
    assert num_to_predict(1000, 80, 0.15) == 80  # capped
    assert num_to_predict(3, 20, 0.15) == 1  # at least one
    assert num_to_predict(5, 20, 0.5) == 2  # 2.5 rounds half to even, as Python's round
    assert num_to_predict(7, 20, 0.5) == 4  # 3.5 -> 4
    lengths = np.arange(0, 1100)
    for prob in (0.15, 0.2, 0.5):
        expected = [min(80, max(1, int(round(n * prob)))) for n in lengths]
        assert num_to_predict_array(lengths, 80, prob).tolist() == expected


def test_default_max_predictions():
    assert default_max_predictions(128) == 20
    assert default_max_predictions(512) == 80
    assert default_max_predictions(256) == 38  # round(38.4)
    assert default_max_predictions(128, mask_prob=0.2) == 26  # the table is for 0.15 only


def test_vocab_tables_come_from_the_vocab():
    assert MASK_ID == 103
    assert MASKING.is_special[[0, 5, 100, 101, 102, 103]].all()  # [unused4] included
    assert not MASKING.is_special[INDEX["word0"]]
    assert MASKING.is_subword[INDEX["##p3"]] and not MASKING.is_subword[INDEX["word3"]]
    assert not MASKING.is_special[MASKING.random_token_ids].any()
    with pytest.raises(ValueError, match="MASK"):
        MaskingVocab.from_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"])


@pytest.mark.parametrize("whole_word", [False, True])
def test_equals_googles_loop_on_the_same_draws(whole_word):
    for index, ids in enumerate(sequences(300, seed=1)):
        uniforms = draw_uniforms(sample_rng(7, 1, index), len(ids))
        got = mask_sequence(ids, sample_rng(7, 1, index), whole_word=whole_word, **kwargs())
        want = google_reference(
            ids, uniforms, max_predictions=20, mask_prob=0.15, whole_word=whole_word
        )
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_exact_count_labels_and_specials():
    for index, ids in enumerate(sequences(400, seed=2)):
        ids = ids.copy()
        ids[1] = INDEX["[UNK]"]  # specials inside the text are never predicted either
        ids[2] = INDEX["[unused7]"]
        masked, labels = mask_sequence(ids, sample_rng(0, 0, index), **kwargs())
        predicted = labels != IGNORE_INDEX
        candidates = ~MASKING.is_special[ids]
        assert predicted.sum() == min(num_to_predict(len(ids), 20, 0.15), candidates.sum())
        assert not (predicted & ~candidates).any()
        np.testing.assert_array_equal(labels[predicted], ids[predicted])
        np.testing.assert_array_equal(masked[~predicted], ids[~predicted])
        assert not MASKING.is_special[masked[predicted & (masked != MASK_ID)]].any()


def batch_of(seqs, width=None):
    lengths = np.array([len(s) for s in seqs])
    width = width or int(lengths.max())
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
    return ids, lengths


def test_shares_are_80_10_10_and_positions_uniform():
    seqs = sequences(3000, seed=3)
    ids, lengths = batch_of(seqs)
    uniforms = SampleStreams(11, 0).batch_uniforms(np.arange(len(seqs)), lengths, ids.shape[1])
    masked, labels = mask_batch(ids, lengths, uniforms, MASKING, max_predictions=20, mask_prob=0.15)
    predicted = labels != IGNORE_INDEX
    n = predicted.sum()
    share_random_same = 0.1 / len(MASKING.random_token_ids)  # a random draw may hit the original
    for share, p in (
        ((masked[predicted] == MASK_ID).mean(), 0.8),
        ((masked[predicted] == ids[predicted]).mean(), 0.1 + share_random_same),
    ):
        assert abs(share - p) < 5 * np.sqrt(p * (1 - p) / n), (share, p, n)
    # Uniform choice: in one fixed sequence, every candidate is chosen k / c of the time.
    one = seqs[0]
    trials = 4000
    chosen = np.zeros(len(one))
    for index in range(trials):
        chosen += mask_sequence(one, sample_rng(5, 0, index), **kwargs())[1] != IGNORE_INDEX
    candidates = ~MASKING.is_special[one]
    p = num_to_predict(len(one), 20, 0.15) / candidates.sum()
    bound = 5 * np.sqrt(p * (1 - p) / trials)
    assert np.abs(chosen[candidates] / trials - p).max() < bound
    assert chosen[~candidates].sum() == 0


def test_whole_words_all_or_nothing_with_one_treatment():
    seqs = sequences(1500, seed=4)
    ids, lengths = batch_of(seqs)
    uniforms = SampleStreams(3, 2).batch_uniforms(np.arange(len(seqs)), lengths, ids.shape[1])
    masked, labels = mask_batch(
        ids, lengths, uniforms, MASKING, max_predictions=20, mask_prob=0.15, whole_word=True
    )
    words_masked = words_total = 0
    for row, length in enumerate(lengths):
        row_ids, predicted = ids[row, :length], labels[row, :length] != IGNORE_INDEX
        assert predicted.sum() <= num_to_predict(length, 20, 0.15)
        for word in split_words(row_ids):
            assert predicted[word].all() or not predicted[word].any()
            is_mask = masked[row, word] == MASK_ID
            assert is_mask.all() or not is_mask.any()  # one treatment per word
            if predicted[word].any():
                words_total += 1
                words_masked += is_mask.all()
    share = words_masked / words_total
    assert abs(share - 0.8) < 5 * np.sqrt(0.16 / words_total)


def split_words(ids):
    words = []
    for i, token_id in enumerate(ids):
        if MASKING.is_special[token_id]:
            continue
        if words and MASKING.is_subword[token_id] and words[-1][-1] == i - 1:
            words[-1].append(i)
        else:
            words.append([i])
    return [np.array(w) for w in words]


def test_a_piece_after_sep_does_not_join_segment_a():
    ids = np.array([101, 110, 102, INDEX["##p1"], 111, 102])  # [CLS] w [SEP] ##p w [SEP]
    chosen = np.zeros(len(ids), dtype=int)
    for index in range(200):
        _, labels = mask_sequence(
            ids, sample_rng(0, 0, index), whole_word=True, **kwargs(mask_prob=0.2)
        )
        assert (labels != IGNORE_INDEX).sum() == 1  # round(6 x 0.2) = 1
        chosen += labels != IGNORE_INDEX
    # Joined to "w" (Google's glue across [SEP]) the piece could never be chosen alone.
    assert chosen[[1, 3, 4]].min() > 40


def test_same_key_same_mask_and_epochs_differ():
    ids = sequences(1, seed=5)[0]
    first = mask_sequence(ids, sample_rng(1, 0, 42), **kwargs())
    again = mask_sequence(ids, sample_rng(1, 0, 42), **kwargs())
    np.testing.assert_array_equal(first[1], again[1])
    np.testing.assert_array_equal(first[0], again[0])
    other_epoch = mask_sequence(ids, sample_rng(1, 1, 42), **kwargs())
    other_index = mask_sequence(ids, sample_rng(1, 0, 43), **kwargs())
    assert not np.array_equal(first[1], other_epoch[1])
    assert not np.array_equal(first[1], other_index[1])


def test_streams_equal_fresh_generators():
    streams = SampleStreams(9, 3)
    for index in (0, 1, 17, 2**40 + 5, 5):
        want = draw_uniforms(sample_rng(9, 3, index), 50)
        np.testing.assert_array_equal(streams.uniforms(index, 50), want)
    with pytest.raises(ValueError, match="seed"):
        sample_rng(-1, 0, 0)


@pytest.mark.parametrize("width", [None, 1100])  # 1100: past the composite-key fast path
@pytest.mark.parametrize("whole_word", [False, True])
def test_batch_rows_equal_single_sequences(width, whole_word):
    seqs = sequences(40, seed=6)
    ids, lengths = batch_of(seqs, width)
    indices = np.arange(100, 140)
    uniforms = SampleStreams(4, 1).batch_uniforms(indices, lengths, ids.shape[1])
    masked, labels = mask_batch(
        ids, lengths, uniforms, MASKING, max_predictions=20, mask_prob=0.15, whole_word=whole_word
    )
    for row, s in enumerate(seqs):
        want = mask_sequence(s, sample_rng(4, 1, indices[row]), whole_word=whole_word, **kwargs())
        np.testing.assert_array_equal(masked[row, : len(s)], want[0])
        np.testing.assert_array_equal(labels[row, : len(s)], want[1])
        assert (labels[row, len(s) :] == IGNORE_INDEX).all()
        assert (masked[row, len(s) :] == 0).all()
