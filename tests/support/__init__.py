"""Helpers for tests and benchmarks only, kept out of the installed product.

- `synthetic`: pretraining batches shaped like real ones (Google's length rule, the loader's own
  masking and padding), for throughput benchmarks and smoke runs without prepared shards;
- `local_cluster`: a real multi-node Ray cluster on this machine (`ray start`, 127.0.0.1);
- `alone`: the environment for a benchmark script run in a process of its own.

Benchmarks import them as `tests.support...` with the checkout's root put on `sys.path`.
"""
