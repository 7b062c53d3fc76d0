"""FLOP counts for throughput and MFU (model FLOPs utilisation) reporting."""

from __future__ import annotations


def encoder_flops_per_sequence(
    *, num_layers: int, hidden_size: int, intermediate_size: int, seq_len: int
) -> int:
    """Forward matmul FLOPs (2 per multiply-add) of the encoder over one sequence.

    Per token and layer: Q, K, V and output projections 4 x 2h^2, the FFN 2 x 2hi, and the
    attention scores and weighted sum 2 x 2Lh. Embedding lookups, LayerNorm, softmax and the
    pooler/NSP head are negligible.
    """
    h, i, L = hidden_size, intermediate_size, seq_len
    return num_layers * L * (8 * h * h + 4 * h * i + 4 * L * h)


def mlm_head_flops(*, hidden_size: int, vocab_size: int, num_predictions: int) -> int:
    """Forward FLOPs of the MLM head at the predicted positions only (sparse prediction):
    transform h^2 + decoder hV per prediction."""
    return num_predictions * (2 * hidden_size * hidden_size + 2 * hidden_size * vocab_size)


def forward_flops_per_sequence(
    *, num_layers: int, hidden_size: int, intermediate_size: int, vocab_size: int,
    seq_len: int, num_predictions: int,
) -> int:
    """Forward matmul FLOPs of one sequence of `seq_len` tokens with `num_predictions` labels."""
    encoder = encoder_flops_per_sequence(
        num_layers=num_layers, hidden_size=hidden_size, intermediate_size=intermediate_size,
        seq_len=seq_len,
    )
    head = mlm_head_flops(
        hidden_size=hidden_size, vocab_size=vocab_size, num_predictions=num_predictions
    )
    return encoder + head


def training_flops_per_sequence(**shape: int) -> int:
    """Backward costs twice the forward: 3x in all.

    BERT-large at 128 tokens, 20 predictions: 3 x (24 x 128 x 25.3 MFLOP + 20 x 64.6 MFLOP)
    = ~237 GFLOP per sequence = ~1.85 GFLOP per token.
    """
    return 3 * forward_flops_per_sequence(**shape)


def training_flops_per_batch(
    *, num_layers: int, hidden_size: int, intermediate_size: int, vocab_size: int,
    batch_size: int, seq_len: int, num_predictions: int, last_layer_rows: int | None = None,
) -> int:
    """Training FLOPs of one padded batch as the model really computes it.

    `seq_len` is the batch's padded width (the encoder computes every padded position, so
    they count: that is work done, and attention to pads is cheap next to the matmuls), and
    `num_predictions` the labelled positions of the whole batch (the head runs only there).
    E.g. 8 rows padded to 128 with 152 labels, BERT-base: 3 x (8 x 12 x 128 x 14.5 MFLOP
    + 152 x 48.1 MFLOP) = ~558 GFLOP.

    `last_layer_rows`: positions per row the last layer computes (see
    `training.model.output_rows`): keys and values on all `seq_len`, the rest on these only.
    """
    shape = dict(num_layers=num_layers, hidden_size=hidden_size,
                 intermediate_size=intermediate_size, seq_len=seq_len)
    encoder = encoder_flops_per_sequence(**shape)
    if last_layer_rows is not None:
        h, i, L, R = hidden_size, intermediate_size, seq_len, last_layer_rows
        dense_last = encoder_flops_per_sequence(**{**shape, "num_layers": 1})
        encoder += L * 4 * h * h + R * (4 * h * h + 4 * h * i + 4 * L * h) - dense_last
    head = mlm_head_flops(
        hidden_size=hidden_size, vocab_size=vocab_size, num_predictions=num_predictions
    )
    return 3 * (batch_size * encoder + head)


def model_flops_utilisation(achieved_flops_per_s: float, peak_flops_per_s: float) -> float:
    if peak_flops_per_s <= 0:
        raise ValueError("peak FLOP/s must be positive")
    return achieved_flops_per_s / peak_flops_per_s


def mfu(total_tflops: float, *, peak_tflops_per_device: float, world_size: int) -> float:
    """MFU of a data-parallel job: TFLOP/s achieved by all ranks over the peak of all devices.

    E.g. 8 H100s (989 TFLOP/s dense bf16 each) achieving 3,560 TFLOP/s in all: 0.45.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return model_flops_utilisation(total_tflops, peak_tflops_per_device * world_size)
