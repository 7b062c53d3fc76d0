"""FP8 matrix multiplies for the encoder layers' Linears: the opt-in `EngineConfig.fp8`.

Hopper's (and Ada's) tensor cores multiply FP8 at twice their bf16 rate, and on an H200 the
GEMMs are 83 of the 146 ms of a BERT-large step at 256 x 128 (benchmarks/README.md, "Issue
34"). Under bf16 autocast an FP8 Linear multiplies two of its three GEMMs in FP8, the recipe
torchao calls "rowwise with the weight gradient in high precision":

- forward: the input row by row (a scale per token) and the fp32 master weight row by row (a
  scale per output feature), both float8_e4m3fn, multiplied by `torch._scaled_mm` into bf16
  with the bias added in its epilogue;
- the input's gradient: the output's gradient row by row (a scale per token) and the weight
  column by column (a scale per input feature), both e4m3, into bf16;
- the weight's gradient: a bf16 GEMM of the output's gradient and the bf16 input, as
  autocast's Linear computes it, into the fp32 weight's dtype. The bias gradient is an fp32
  sum.

Each scale is the power of two that brings its row's largest magnitude closest to e4m3's
largest (448) without passing it, taken at this step: multiplying by a power of two is exact,
so an element's rounding is e4m3's own and the GEMM's epilogue undoes the scale exactly.

Why rows, not one scale per tensor (the recipe until 2026-11-28; 0.98x the bf16 defaults on
an H200): a tensor's scale needs the whole tensor's maximum before its first element can be
cast, so every cast read its tensor twice more after the kernel that made it, and the weight
gradient's GEMM needed both its operands cast again, transposed. A row's maximum is a
reduction over the same row a LayerNorm or a GELU has just computed, so under torch.compile
(the GPU default) inductor can fold the cast into that kernel: one more output of a kernel
that runs anyway (whether it does on a GPU is for its profile to show). Compiled, inductor
may also run an FP8 GEMM as a Triton template of its own where its compile-time benchmark
finds one faster than cuBLASLt. And a row's scale follows its own token: a token whose values
are a hundred thousand times smaller than its neighbours' keeps e4m3's precision instead of
sinking below its subnormals. The weight gradient stays in bf16 because its GEMM sums over
tokens, so it would want scales per column of both operands: another pass over each, the cost
that sank the tensorwise recipe.

What it changes: each FP8 operand keeps 3 bits of mantissa where bf16 keeps 7, so the forward
and the input's gradient are no longer the bf16 path's arithmetic; the weight gradient, the
LayerNorms, softmax, GELU, residual stream, embeddings, heads and optimizer stay as they
were. That is why it is opt-in: issue 34 asks to keep the model's numerics, and whether FP8
may become the default is its owner's call, on the parity and throughput figures
`benchmarks/gpu_parity.py --fp8` and `gpu_throughput.py --fp8` give.

Nothing is read back to the host: maxima, scales and casts stay on the device. A row with an
inf or NaN casts to NaN (e4m3 has no inf; a saturating cast would hide the overflow), eager and
compiled alike. A GEMM whose sizes FP8 GEMMs cannot take (a K or N no multiple of 16) runs in
bf16. On a CPU torch's `_scaled_mm` runs too, slower than bf16: the CPU tests use it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
# e4m3's largest, 448, as mantissa * 2**exponent: 0.875 * 2**9.
_LARGEST_MANTISSA, _LARGEST_EXPONENT = math.frexp(torch.finfo(FP8_DTYPE).max)
# torch's CUDA FP8 GEMMs take a K and an N (the summed and the output dimension) that are
# multiples of 16; the rows, M, may be any number.
ALIGNMENT = 16
# An all-zero row's scale stays finite (torchao's floor too).
_MIN_AMAX = 1e-12
_FP32_EXPONENT_BIAS, _FP32_MANTISSA_BITS = 127, 23


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """None where `device` multiplies in FP8, else why not (for an error message)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return None
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) "
                "has no FP8 tensor cores: FP8 needs 8.9 or later (L4, L40, H100, H200)")
    return f"torch has no FP8 matmul on {device.type}"


def rows_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix `x` in e4m3, row-major, each row scaled by the power of two that brings its
    largest magnitude closest to 448 without passing it; and the inverse scales, fp32 [rows, 1],
    which `_scaled_mm` multiplies back in."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX)
    exponent = _scale_exponents(amax)
    # No clamp: the scale cannot carry a row past 448. A non-finite row's scale is NaN, so
    # that the row is NaN in FP8 whether the cast saturates (Triton's, the CPU's) or not.
    scale = torch.where(torch.isfinite(amax), _power_of_two(exponent), torch.nan)
    data = (x.float() * scale).to(FP8_DTYPE)
    return data.contiguous(), _power_of_two(-exponent)


def _scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The largest k with amax * 2**k <= 448, from amax's own mantissa and exponent. Exact,
    where log2 of a quotient rounds, and rounds differently in eager and inductor's code (a
    row whose maximum is 1.75 * 2**m, one bf16 mantissa in 128, would get half its scale in
    one of them)."""
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa <= _LARGEST_MANTISSA, _LARGEST_EXPONENT - exponent,
                       _LARGEST_EXPONENT - 1 - exponent)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as fp32, built from its bits: exact (a GPU's exp2 is an approximation).
    The exponents here stay within fp32's normal range (|k| < 127: amax is at least 1e-12
    and at most bf16's largest)."""
    return ((exponent + _FP32_EXPONENT_BIAS) << _FP32_MANTISSA_BITS).view(torch.float32)


class _Fp8Matmul(torch.autograd.Function):
    """x [M, K] @ weight[N, K].T + bias, the forward and input-gradient GEMMs in FP8 (module
    docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        x8, x_inverse = rows_to_fp8(x)
        w8, w_inverse = rows_to_fp8(weight)
        # The bf16 input (what autocast's Linear keeps) for the weight gradient's bf16 GEMM;
        # the weight is a parameter, kept anyway.
        ctx.save_for_backward(x.to(out_dtype), weight)
        ctx.has_bias = bias is not None
        # _scaled_mm's second operand column by column: w8 [N, K] row-major, transposed.
        # cuBLASLt adds the bias in its epilogue, in the output's dtype.
        return torch._scaled_mm(
            x8, w8.t(), scale_a=x_inverse, scale_b=w_inverse.t(),
            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype,
            # Hopper's faster FP8 accumulation for the forward's output only, as torchao
            # does; the input's gradient accumulates at full fp32 precision.
            use_fast_accum=True)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            g8, g_inverse = rows_to_fp8(grad)
            # The weight's columns as rows ([K, N], a scale per input feature), transposed
            # back into the column-major operand the GEMM takes.
            wt8, wt_inverse = rows_to_fp8(weight.t())
            grad_x = torch._scaled_mm(g8, wt8.t(), scale_a=g_inverse, scale_b=wt_inverse.t(),
                                      out_dtype=grad.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(x).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0, dtype=torch.float32)
        return grad_x, grad_weight, grad_bias, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` under autocast, its GEMMs in FP8 where the sizes allow;
    the output in the autocast dtype, as autocast's own Linear gives it."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        raise RuntimeError("fp8_linear runs under torch.autocast (the engine's bf16 path)")
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[1] % ALIGNMENT or weight.shape[0] % ALIGNMENT:
        return F.linear(x, weight, bias)
    out = _Fp8Matmul.apply(x2d, weight, bias, torch.get_autocast_dtype(device_type))
    return out.view(*x.shape[:-1], weight.shape[0])
