"""Stage 2 of the job: raw documents -> sentence-pair instances, keyed for the global order.

A `*_transform` module holds the stage's Beam steps; the others are pure functions and formats.

- `pairs_transform`: the Beam step (`CreatePretrainingInstances`): dedup, split assignment,
  random-B pools, instances per pool, each keyed for the global order;
- `tokenize_transform`: documents -> sentences -> token ids, long documents in parallel parts;
- `pairing`: the pairing rules, pure functions building NSP pairs as Google's
  `create_pretraining_data.py`;
- `batch_columns`: the format between the pools and the writer: instances as numpy columns,
  with their rows' sort keys;
- `sentences`: paragraph and sentence splitting (blingfire);
- `sentence_ids`: sentences -> WordPiece ids, many sentences per tokenizer call.
"""
