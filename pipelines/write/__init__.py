"""Stage 3 of the job: instances -> Arrow shards in exact global order, then the manifest.

A `*_transform` module holds the stage's Beam steps; the others are pure functions.

- `shards_transform`: the Beam step (`WriteShards`): bucket counts, boundaries, pieces, shard
  files;
- `global_order`: pure functions of the global order (sort keys, exact ranks) and Arrow shard
  writing;
- `manifest_transform`: the last steps (`WriteManifest`): rejects.jsonl, vocab.txt,
  manifest.json.
"""
