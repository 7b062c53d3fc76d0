"""FP8 matrix multiplies for the encoder layers' Linears: the opt-in `EngineConfig.fp8`.

Hopper's (and Ada's) tensor cores multiply FP8 at twice their bf16 rate, and on an H200 the
GEMMs are 83 of the 151 ms of a BERT-large step at 256 x 128 (benchmarks/README.md, "Issue
34"). Under bf16 autocast an FP8 Linear casts its input and its fp32 master weight to
float8_e4m3fn, each with one scale per tensor taken from its own absolute maximum at this step
(dynamic "tensorwise" scaling, torchao's Float8Linear default), and multiplies them with
`torch._scaled_mm` into bf16. Its backward casts the output's gradient to float8_e5m2 (two
more bits of exponent, one less of mantissa: gradients span more decades than activations)
and multiplies it with the saved FP8 input and weight: the input's gradient in bf16 and the
weight's in fp32, the dtypes autocast's own backward gives. The bias gradient is an fp32 sum.

What it changes: each GEMM operand keeps 3 (e4m3) or 2 (e5m2) bits of mantissa where bf16
keeps 7, so the arithmetic is no longer the bf16 path's; the LayerNorms, softmax, GELU,
residual stream, embeddings, heads and optimizer stay as they were. That is why it is opt-in:
issue 34 asks to keep the model's numerics, and whether FP8 may become the default is its
owner's call, on the parity and throughput figures `benchmarks/gpu_parity.py --fp8` and
`gpu_throughput.py --fp8` give.

Nothing is read back to the host: amax, scales and casts stay on the device (under
torch.compile, the GPU default, inductor fuses them with the work around them where it can).
A GEMM whose sizes cuBLASLt cannot take in FP8 (not multiples of 16) runs in bf16. On a CPU
torch's `_scaled_mm` runs too, slower than bf16: the CPU tests use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORWARD_DTYPE = torch.float8_e4m3fn
GRADIENT_DTYPE = torch.float8_e5m2
# cuBLASLt's FP8 GEMMs take operands whose every dimension is a multiple of 16.
ALIGNMENT = 16
# An all-zero tensor's scale stays finite (torchao's floor too).
_MIN_AMAX = 1e-12


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


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` scaled so its largest magnitude meets `dtype`'s largest, cast to `dtype`; and the
    inverse scale (an fp32 scalar on x's device) that `_scaled_mm` multiplies back in."""
    largest = torch.finfo(dtype).max
    # The division in fp64, as torchao's: in fp32, inductor computes it as amax's reciprocal
    # times `largest`, an ulp off eager's quotient at times, and a scale an ulp off re-rounds
    # every element (eager and compiled FP8 runs would part).
    scale = (largest / x.abs().amax().double().clamp(min=_MIN_AMAX)).float()
    data = (x.float() * scale).clamp(-largest, largest).to(dtype)
    # Row by row, as the GEMMs take their first operand (a gradient may arrive strided).
    return data.contiguous(), scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column by column: cuBLASLt's FP8 GEMM wants its second
    operand so (its first row by row)."""
    return t.t().contiguous().t()


class _Fp8Matmul(torch.autograd.Function):
    """x [M, K] @ weight[N, K].T + bias, the GEMMs in FP8 (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        x8, x_inverse = to_fp8(x, FORWARD_DTYPE)
        w8, w_inverse = to_fp8(weight, FORWARD_DTYPE)
        # The FP8 copies, not the inputs, are what the backward multiplies: half the bytes of
        # a bf16 activation kept for the backward.
        ctx.save_for_backward(x8, x_inverse, w8, w_inverse)
        ctx.weight_dtype = weight.dtype
        ctx.has_bias = bias is not None
        # cuBLASLt adds the bias in its epilogue, in the output's dtype (the autocast dtype,
        # never fp32, into which it would refuse a bias).
        return torch._scaled_mm(
            x8, w8.t(), scale_a=x_inverse, scale_b=w_inverse,
            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype,
            # Hopper's faster FP8 accumulation for the forward's output only, as torchao
            # does; the gradients accumulate exactly.
            use_fast_accum=True)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x8, x_inverse, w8, w_inverse = ctx.saved_tensors
        g8, g_inverse = to_fp8(grad, GRADIENT_DTYPE)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inverse,
                                      scale_b=w_inverse, out_dtype=grad.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch._scaled_mm(
                g8.t().contiguous(), _column_major(x8), scale_a=g_inverse, scale_b=x_inverse,
                out_dtype=torch.float32).to(ctx.weight_dtype)
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
    if any(size % ALIGNMENT for size in (*x2d.shape, weight.shape[0])):
        return F.linear(x, weight, bias)
    out = _Fp8Matmul.apply(x2d, weight, bias, torch.get_autocast_dtype(device_type))
    return out.view(*x.shape[:-1], weight.shape[0])
