"""Stage 2 of the job: raw documents -> sentence-pair instances, keyed for the global order.

- `create_instances`: the Beam step (`CreatePretrainingInstances`): dedup, split assignment,
  random-B pools, instances per pool;
- `tokenize_documents`: documents -> sentences -> token ids, long documents in parallel parts;
- `sentences`: paragraph and sentence splitting (blingfire);
- `instances`: pure functions building NSP pairs as Google's `create_pretraining_data.py`;
- `instance_batch`: instances as numpy columns, what flows from the pools to the writer.
"""
