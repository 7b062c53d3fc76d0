"""Instance creation: Google's `create_pretraining_data.py` behaviour, on token-id documents.

Token ids carry their provenance: id = BASE + doc * 100_000 + position in the document, so any
output token tells which document and which position it came from.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from bertforge.pipelines.instances.pairing import (
    NEXT_IS_RANDOM,
    NEXT_IS_REAL,
    create_instances_from_document,
    document_rng,
    stable_hash,
    truncate_seq_pair,
)

CLS, SEP = 2, 3
BASE = 1000
PER_DOC = 100_000


def make_documents(
    num_docs: int,
    seed: int = 0,
    sentences: tuple[int, int] = (2, 30),
    tokens: tuple[int, int] = (3, 25),
) -> list[list[list[int]]]:
    rng = random.Random(seed)
    documents = []
    for doc in range(num_docs):
        position = 0
        document = []
        for _ in range(rng.randint(*sentences)):
            length = rng.randint(*tokens)
            document.append([BASE + doc * PER_DOC + position + k for k in range(length)])
            position += length
        documents.append(document)
    return documents


def doc_of(token: int) -> int:
    return (token - BASE) // PER_DOC


def position_of(token: int) -> int:
    return (token - BASE) % PER_DOC


def segments(instance) -> tuple[list[int], list[int]]:
    ids, num_a = instance.input_ids, instance.num_a_tokens
    return ids[1 : num_a - 1], ids[num_a:-1]


def all_instances(documents, max_seq_length=128, short_seq_prob=0.1, seed=7, dupes=1):
    out = []
    for dupe in range(dupes):
        for index in range(len(documents)):
            created = create_instances_from_document(
                index,
                documents,
                max_seq_length=max_seq_length,
                short_seq_prob=short_seq_prob,
                rng=document_rng(seed, f"doc{index}", dupe),
                cls_id=CLS,
                sep_id=SEP,
            )
            out += [(index, instance) for instance in created]
    return out


def google_create_instances(all_documents, document_index, max_seq_length, short_seq_prob, rng):
    """Google's `create_instances_from_document` and `truncate_seq_pair`, masking left out.

    Transcribed from google-research/bert create_pretraining_data.py (Apache-2.0) as the oracle.
    """
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances, current_chunk, current_length, i = [], [], 0, 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = rng.randint(1, len(current_chunk) - 1)
                tokens_a = []
                for j in range(a_end):
                    tokens_a.extend(current_chunk[j])
                tokens_b = []
                is_random_next = False
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    num_unused_segments = len(current_chunk) - a_end
                    i -= num_unused_segments
                else:
                    is_random_next = False
                    for j in range(a_end, len(current_chunk)):
                        tokens_b.extend(current_chunk[j])
                while True:  # truncate_seq_pair
                    total_length = len(tokens_a) + len(tokens_b)
                    if total_length <= max_num_tokens:
                        break
                    trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
                    if rng.random() < 0.5:
                        del trunc_tokens[0]
                    else:
                        trunc_tokens.pop()
                tokens = [CLS, *tokens_a, SEP, *tokens_b, SEP]
                instances.append((tokens, len(tokens_a) + 2, int(is_random_next)))
            current_chunk = []
            current_length = 0
        i += 1
    return instances


@pytest.mark.parametrize(
    "max_seq_length,short_seq_prob", [(128, 0.1), (64, 0.5), (512, 0.1), (16, 0.0)]
)
def test_identical_to_google_when_another_document_exists(max_seq_length, short_seq_prob):
    documents = make_documents(60, seed=max_seq_length)
    for index in range(len(documents)):
        ours = create_instances_from_document(
            index,
            documents,
            max_seq_length=max_seq_length,
            short_seq_prob=short_seq_prob,
            rng=random.Random(index),
            cls_id=CLS,
            sep_id=SEP,
        )
        google = google_create_instances(
            documents, index, max_seq_length, short_seq_prob, random.Random(index)
        )
        assert [tuple(i) for i in ours] == google


def test_layout_lengths_and_num_a_tokens():
    documents = make_documents(80)
    for max_seq_length in (16, 128):
        for _, instance in all_instances(documents, max_seq_length=max_seq_length):
            ids = instance.input_ids
            assert len(ids) <= max_seq_length
            assert ids[0] == CLS and ids[-1] == SEP
            assert ids[instance.num_a_tokens - 1] == SEP
            assert [i for i, t in enumerate(ids) if t in (CLS, SEP)] == [
                0,
                instance.num_a_tokens - 1,
                len(ids) - 1,
            ]
            tokens_a, tokens_b = segments(instance)
            assert instance.num_a_tokens == len(tokens_a) + 2
            assert tokens_a and tokens_b
            assert instance.next_sentence_label in (NEXT_IS_REAL, NEXT_IS_RANDOM)


def test_next_sentence_labels_are_balanced_and_truthful():
    documents = make_documents(200, seed=3, sentences=(10, 40), tokens=(5, 20))
    instances = all_instances(documents)
    labels = [instance.next_sentence_label for _, instance in instances]
    # p = 0.5, plus single-sentence chunks (always random): slightly above one half.
    assert 0.45 < sum(labels) / len(labels) < 0.58
    for index, instance in instances:
        tokens_a, tokens_b = segments(instance)
        assert {doc_of(t) for t in tokens_a} == {index}
        b_docs = {doc_of(t) for t in tokens_b}
        assert len(b_docs) == 1
        if instance.next_sentence_label == NEXT_IS_RANDOM:
            assert b_docs != {index}, "a random B must come from another document"
        else:
            assert b_docs == {index}
            assert max(map(position_of, tokens_a)) < min(map(position_of, tokens_b)), "B follows A"


def test_single_document_never_labels_its_own_text_random():
    """Google's bug: with no other document its "random" B came from the same document."""
    documents = make_documents(1, sentences=(40, 40))
    instances = all_instances(documents, dupes=20)
    assert instances
    assert all(instance.next_sentence_label == NEXT_IS_REAL for _, instance in instances)


def test_unused_sentences_are_put_back():
    """With one-token sentences nothing is truncated: every token is in exactly one A or real B."""
    documents = make_documents(30, sentences=(50, 300), tokens=(1, 1))
    by_doc: dict[int, list[int]] = {}
    for index, instance in all_instances(documents, max_seq_length=32, short_seq_prob=0.0):
        tokens_a, tokens_b = segments(instance)
        by_doc.setdefault(index, []).extend(tokens_a)
        if instance.next_sentence_label == NEXT_IS_REAL:
            by_doc[index].extend(tokens_b)
    for index, document in enumerate(documents):
        expected = [t for sentence in document for t in sentence]
        assert sorted(by_doc[index]) == expected


def test_short_seq_prob_shortens_sequences():
    documents = make_documents(150, seed=5, sentences=(20, 40), tokens=(5, 15))

    def mean_length(prob: float) -> float:
        lengths = [len(i.input_ids) for _, i in all_instances(documents, short_seq_prob=prob)]
        return sum(lengths) / len(lengths)

    full, google, short = mean_length(0.0), mean_length(0.1), mean_length(1.0)
    assert full > 105  # targets of 125 text tokens; document tails and random B tails are shorter
    assert short < 0.75 * full
    assert short < google < full


def test_truncate_seq_pair_trims_longer_side_from_both_ends():
    fronts = backs = 0
    for seed in range(200):
        tokens_a, tokens_b = list(range(100)), list(range(1000, 1030))
        truncate_seq_pair(tokens_a, tokens_b, 110, random.Random(seed))
        assert len(tokens_a) + len(tokens_b) == 110
        assert tokens_b == list(range(1000, 1030)), "the shorter side is left alone while longer"
        assert tokens_a == list(range(tokens_a[0], tokens_a[0] + 80)), "a contiguous run"
        fronts += tokens_a[0] > 0
        backs += tokens_a[-1] < 99
    assert fronts > 150 and backs > 150


def _google_truncate(tokens_a, tokens_b, max_num_tokens, rng):
    """Google's `truncate_seq_pair`, verbatim but for names."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        assert len(trunc_tokens) >= 1
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


def test_truncate_seq_pair_is_googles_token_for_token_and_draw_for_draw():
    shapes = random.Random(7)
    for seed in range(3000):
        length_a, length_b = shapes.randint(1, 300), shapes.randint(1, 300)
        max_num_tokens = shapes.randint(2, 400)
        ours_a, ours_b = list(range(length_a)), list(range(1000, 1000 + length_b))
        google_a, google_b = list(ours_a), list(ours_b)
        ours_rng, google_rng = random.Random(seed), random.Random(seed)
        truncate_seq_pair(ours_a, ours_b, max_num_tokens, ours_rng)
        _google_truncate(google_a, google_b, max_num_tokens, google_rng)
        assert (ours_a, ours_b) == (google_a, google_b), (length_a, length_b, max_num_tokens)
        assert ours_rng.random() == google_rng.random()  # the same number of draws


def test_truncate_seq_pair_balances_equal_sides_and_is_linear():
    tokens_a, tokens_b = list(range(200_000)), list(range(10))
    truncate_seq_pair(tokens_a, tokens_b, 20, random.Random(0))  # O(n): instantaneous
    assert len(tokens_a) == 10 and len(tokens_b) == 10


def test_same_rng_seed_same_instances():
    documents = make_documents(20)
    assert all_instances(documents, seed=1) == all_instances(documents, seed=1)
    assert all_instances(documents, seed=1) != all_instances(documents, seed=2)


def test_rejects_too_short_max_seq_length():
    with pytest.raises(ValueError, match="max_seq_length"):
        create_instances_from_document(
            0,
            make_documents(2),
            max_seq_length=4,
            short_seq_prob=0.1,
            rng=random.Random(0),
            cls_id=2,
            sep_id=3,
        )


def test_stable_hash_is_stable_across_processes():
    parts = (12345, "order", "stdlib:json.decoder", 0, 3)
    code = (
        "from bertforge.pipelines.instances.pairing import stable_hash; "
        f"print(stable_hash(*{parts!r}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert int(other.stdout) == stable_hash(*parts)
    assert 0 <= stable_hash(*parts) < 2**64
    assert stable_hash("a", "bc") != stable_hash("ab", "c")
    assert stable_hash(1) != stable_hash("1")
