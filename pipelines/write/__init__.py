"""Stage 3 of the job: instances -> Arrow shards in exact global order, then the manifest.

- `write_shards`: the Beam step (`WriteShards`): bucket counts, boundaries, pieces, shard files;
- `shards`: pure functions of the global order (sort keys, exact ranks) and Arrow shard writing;
- `write_manifest`: the last steps (`WriteManifest`): rejects.jsonl, vocab.txt, manifest.json.
"""
