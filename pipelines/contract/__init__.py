"""The contract between the layers: what the preparation job writes and training reads back,
and how every layer declares its options.

Free of Beam (and of torch), so that `training/` can import it without pulling in the job; a test
holds that (tests/pipelines/test_contract.py).

- `manifest`: the shard directory (`manifest.json`, `vocab.txt`, splits, shard entries) and the
  shard schema (column names and types);
- `tokenization`: the vocabulary and WordPiece tokenization, equal to `BertTokenizerFast`.
- `rows`: the rules every stored row obeys (ids in the vocabulary, length, `[CLS]`/`[SEP]` where
  `num_a_tokens` says, NSP label), checked by the loader and by `bertforge inspect`.
- `config_fields`: `option(...)`, the one declaration of a config field, and the flags and
  pipeline-file keys generated from it, for the configs of every layer.
"""
