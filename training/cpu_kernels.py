"""CPU fast paths for the model's layers: the same numbers (up to rounding), less time.

`training.model` builds BERT from these drop-in pieces; on a GPU, or wherever a fast path does
not apply (float64, bf16 weights, autocast), each falls back to the stock PyTorch call, so the
architecture never depends on them:

- `Linear`: `nn.Linear` whose fp32 CPU GEMMs (forward and input gradient) run through oneDNN
  rather than MKL: the same fp32 products, 5-15 % faster on this machine;
- `dropout` / `Dropout`: on a CPU the mask comes from 16-bit lanes of 64-bit random words,
  ~5x cheaper than `torch.bernoulli_`; same probabilities up to 2^-16 rounding of p;
- `scaled_dot_product_attention`: `F.scaled_dot_product_attention`, except on a CPU in fp32
  with dropout on, where SDPA can only take its math path: there a leaner copy of that path
  (`attention_by_matmuls`).

Measured on the development machine (AMD Zen 4, 1-2 threads); the docstrings give the numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bertforge.training.module_switches import switch_every

# `_linear_pointwise` is the op torch.compile's CPU backend emits for a linear layer; it takes
# plain dense (even strided) tensors and reads the weight afresh on every call (no cache that
# an optimizer step could make stale).
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


def plain_fp32_cpu(tensor: torch.Tensor) -> bool:
    """fp32 on a CPU, no autocast: where SDPA's math path computes in the inputs' own dtype
    (it upcasts bf16 on a CPU, which a lean replacement would have to mirror)."""
    return (
        tensor.device.type == "cpu"
        and tensor.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()  # see `eager_cpu`
    )


def eager_cpu(tensor: torch.Tensor) -> bool:
    """On a CPU and not being traced by torch.compile, which generates its own fused kernels
    (the oneDNN linear among them): there the fast paths here would only break its graph."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------
# Linear layers through oneDNN.


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) whose fp32 CPU GEMMs use oneDNN.

    On this machine (AMD Zen 4, 1-2 threads) oneDNN's fp32 inner product beats MKL's sgemm,
    which `F.linear` calls, in the forward by 6-15 % at BERT-base's shapes (1024 x 768 x 768:
    11.4 vs 12.2 ms; 1024 x 768 x 3072: 45 vs 50 ms) and by ~45 % on the MLM decoder
    (152 x 768 x 30,522: 71 vs 128 ms), and in the input gradient by 3-9 %; the weight
    gradient stays on MKL, where the two tie. Both compute in fp32: the numbers differ by
    rounding only. Anything else (GPU, float64, bf16 weights, autocast) takes `F.linear`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, through oneDNN for fp32 on a CPU (see `Linear`); also for row blocks of a
    layer's weight, such as the query rows of a fused QKV projection."""
    if _ONEDNN_LINEAR and plain_fp32_cpu(x) and weight.dtype == torch.float32:
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) over the last dim of x, by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # grad @ W: the inner product with W.T as its "weight" (a strided view, no copy).
            grad_x = _onednn_linear(grad_2d, weight.t()).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        return grad_x, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# Dropout from 16-bit lanes.


class Dropout(nn.Module):
    """`nn.Dropout` with `dropout`'s cheaper CPU mask; no state, so state dicts are unchanged."""

    # An experiment of benchmarks/gpu_throughput.py (`--dropout-mask lanes`,
    # `set_lane_masks`): the 16-bit-lane mask on a GPU and under torch.compile too. Off in the
    # product.
    lane_mask_everywhere = False

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, lane_mask_everywhere=self.lane_mask_everywhere)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def dropout(x: torch.Tensor, p: float, training: bool = True, *,
            lane_mask_everywhere: bool = False) -> torch.Tensor:
    """Inverted dropout: each element zeroed with probability p, the rest scaled by 1/(1-p).

    On a GPU this is `F.dropout` (one fused kernel). On a CPU, `F.dropout` fills a float tensor
    with `bernoulli_` (~6 ns per element on this machine's cores: ~240 ms of a BERT-base step
    at batch 8 x 128, whose 37 dropouts draw 38.5 M masks). Here one `random_` call fills
    64-bit words, each read as four 16-bit lanes, and a lane below round(p x 65536) - 32768
    drops its element: ~1.1 ns per element, and the same global generator, so
    `torch.manual_seed` and activation checkpointing's RNG replay reproduce the mask.
    `lane_mask_everywhere` (an experiment, `set_lane_masks`): that mask on a GPU and under
    torch.compile too.
    """
    if not training or p == 0.0:
        return x
    if not (lane_mask_everywhere or eager_cpu(x)):
        return F.dropout(x, p, training=True)
    return x * _lane_dropout_mask(x, p)


def set_lane_masks(model: nn.Module, enabled: bool) -> None:
    """Every `Dropout` of `model` draws the 16-bit-lane mask wherever it runs (GPU, compiled),
    or only where `dropout` does. Set it before compiling."""
    switch_every(model, Dropout, "lane_mask_everywhere", enabled)


@torch.library.custom_op(
    "bertforge::random_words", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def random_words(like: torch.Tensor) -> torch.Tensor:
    """(numel + 3) // 4 uniform 64-bit words on `like`'s device, from the global generator.

    An op of its own so that torch.compile keeps ATen's kernel (on a GPU one Philox call for
    two words, eight lanes) instead of drawing one Philox number per element inside its fused
    kernels; `like` is an input so that two dropouts are never merged into one mask, and the
    tag keeps the partitioner from drawing it again in the backward."""
    words = torch.empty((like.numel() + 3) // 4, dtype=torch.int64, device=like.device)
    # from=-2**63, to=None: the full 64-bit range, so every lane (sign bit included) is uniform;
    # the default range [0, 2**63) would leave one lane in four non-negative.
    return words.random_(-(2**63), None)


@random_words.register_fake
def _random_words_shape(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(((like.numel() + 3) // 4,), dtype=torch.int64)


def _lane_dropout_mask(like: torch.Tensor, p: float) -> torch.Tensor:
    """1/(1-p) where kept, 0 where dropped; `like`'s shape and dtype, contiguous; on any
    device and under torch.compile (where the comparison and scale fuse into the next kernel).

    P(drop) = round(p x 65536) / 65536, within 2^-17 (7.6e-6) of p; for p = 0.1 it is
    0.1000061. The scale stays 1/(1-p), as `nn.Dropout`'s.
    """
    numel = like.numel()
    lanes = random_words(like).view(torch.int16)[:numel].view(like.shape)
    return _mask_from_lanes(lanes, p, like.dtype)


def _mask_from_lanes(lanes: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """Uniform int16 lanes -> 0 for the round(p x 65536) lowest values, 1/(1-p) for the rest."""
    threshold = round(p * 65536) - 32768
    # A comparison written straight into a float tensor: 1.0 kept, 0.0 dropped, in one pass.
    out = torch.empty(lanes.shape, dtype=dtype, device=lanes.device)
    mask = torch.ge(lanes, threshold, out=out)
    return mask.mul_(1.0 / (1.0 - p))


# ---------------------------------------------------------------------------------------------
# Attention with dropout on a CPU.


def scaled_dot_product_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None, dropout_p: float,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, which picks the flash or memory-efficient kernel on a
    GPU; on a CPU in fp32 with dropout on, `attention_by_matmuls` instead."""
    if dropout_p > 0.0 and plain_fp32_cpu(query):
        return attention_by_matmuls(query, key, value, attn_mask, dropout_p)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p
    )


def attention_by_matmuls(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None, dropout_p: float,
) -> torch.Tensor:
    """SDPA's math path, leaner: what it runs on a CPU whenever dropout is on (its flash kernel
    takes no dropout), with the scale and the mask fused into one `baddbmm` and a plain softmax
    (a finite mask never empties a row): ~10 % less attention time at base/128, ~1 % of a step.
    One `dropout` on the probabilities, as SDPA's `F.dropout` (with our cheaper CPU mask).
    On a GPU, an experiment (`BertSelfAttention.math_attention`): under torch.compile the
    mask, softmax and dropout fuse into one kernel between two batched GEMMs, against cuDNN's
    fused attention, whose kernels run far below the GEMMs' rate at 128 tokens.

    [B, H, Lq, D] queries over [B, H, L, D] keys and values -> [B, H, Lq, D].
    """
    batch_size, num_heads, num_queries, head_size = query.shape
    seq_len = key.shape[2]
    flat_query = query.reshape(batch_size * num_heads, num_queries, head_size)
    flat_key = key.reshape(batch_size * num_heads, seq_len, head_size)
    flat_value = value.reshape(batch_size * num_heads, seq_len, head_size)
    if attn_mask is None:
        bias, beta = query.new_zeros(()), 0.0
    else:
        # [B, 1, 1, L] -> [B * H, 1, L], broadcast over query positions; a packed batch's
        # [B, 1, Lq, L] (a row per query) -> [B * H, Lq, L].
        mask_rows = attn_mask.shape[2]
        bias = attn_mask.expand(batch_size, num_heads, mask_rows, seq_len)
        bias = bias.reshape(-1, mask_rows, seq_len)
        beta = 1.0
    scores = torch.baddbmm(
        bias, flat_query, flat_key.transpose(1, 2), beta=beta, alpha=head_size**-0.5
    )
    probs = dropout(torch.softmax(scores, dim=-1), dropout_p)
    context = torch.bmm(probs, flat_value)
    return context.view(batch_size, num_heads, num_queries, head_size)
