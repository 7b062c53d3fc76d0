"""FLOP counts for throughput and MFU (model FLOPs utilisation) reporting."""

from __future__ import annotations


def forward_flops_per_sequence(
    *, num_layers: int, hidden_size: int, intermediate_size: int, vocab_size: int,
    seq_len: int, num_predictions: int,
) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward pass over one sequence.

    Per token and layer: Q, K, V and output projections 4 x 2h^2, the FFN 2 x 2hi, and the
    attention scores and weighted sum 2 x 2Lh. The MLM head (transform h^2 + decoder hV) runs
    only at the predicted positions (sparse prediction). Embedding lookups, LayerNorm, softmax
    and the NSP head are negligible.
    """
    h, i, L = hidden_size, intermediate_size, seq_len
    per_token_layer = 8 * h * h + 4 * h * i + 4 * L * h
    encoder = num_layers * L * per_token_layer
    mlm_head = num_predictions * (2 * h * h + 2 * h * vocab_size)
    return encoder + mlm_head


def training_flops_per_sequence(**shape: int) -> int:
    """Backward costs twice the forward: 3x in all.

    BERT-large at 128 tokens, 20 predictions: 3 x (24 x 128 x 25.3 MFLOP + 20 x 64.6 MFLOP)
    = ~237 GFLOP per sequence = ~1.85 GFLOP per token.
    """
    return 3 * forward_flops_per_sequence(**shape)


def model_flops_utilisation(achieved_flops_per_s: float, peak_flops_per_s: float) -> float:
    if peak_flops_per_s <= 0:
        raise ValueError("peak FLOP/s must be positive")
    return achieved_flops_per_s / peak_flops_per_s
