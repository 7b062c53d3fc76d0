"""What torch's CUDA `_scaled_mm` refuses and its CPU kernel takes: the rules for an FP8 GEMM
with one scale per tensor or one per row (aten/src/ATen/native/cuda/ScaledBlas.cpp, read at
a version newer than the GPU's torch 2.11, whose row-wise path has the same shape in older
versions: `get_joint_scaling`, then cuBLASLt's layouts; row-wise scales go to cuBLASLt from
12.9 on Hopper, to torch's CUTLASS kernel before, which takes only an e4m3 second operand), checked
on every call a piece of code makes, eager or compiled, so that the CPU suite catches what
would otherwise fail first on a lent GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._inductor.select_algorithm import extern_kernels

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def cublaslt_refusals(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None,
                      out_dtype=None, use_fast_accum=False, *, out=None) -> list[str]:
    """Why CUDA's `_scaled_mm` would refuse these arguments (empty: it takes them)."""
    result_dtype = out.dtype if out is not None else (out_dtype or mat1.dtype)
    refusals = []
    if mat1.dim() != 2 or mat2.dim() != 2:
        return ["operands are not matrices"]
    if mat1.dtype not in FP8 or mat2.dtype not in FP8:
        refusals.append(f"operands {mat1.dtype} x {mat2.dtype} are not both FP8")
    if mat1.dtype == mat2.dtype == torch.float8_e5m2:
        refusals.append("two float8_e5m2 operands")
    if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
        refusals.append(f"sizes {tuple(mat1.shape)} x {tuple(mat2.shape)} not multiples of 16")
    # cuBLASLt multiplies FP8 only as "TN": mat1 row by row, mat2 column by column, into a
    # row-major result.
    if mat1.stride(1) != 1 or mat1.stride(0) < mat1.shape[1]:
        refusals.append(f"mat1 is not row-major (strides {mat1.stride()})")
    if mat2.stride(0) != 1 or mat2.stride(1) < mat2.shape[0]:
        refusals.append(f"mat2 is not column-major (strides {mat2.stride()})")
    if out is not None and not out.is_contiguous():
        refusals.append(f"the output is not row-major (strides {out.stride()})")
    refusals += _scale_refusals(mat1, mat2, scale_a, scale_b)
    if bias is not None:
        if result_dtype == torch.float32:
            refusals.append("a bias with an fp32 output")
        elif bias.dtype != result_dtype:
            refusals.append(f"a {bias.dtype} bias for a {result_dtype} output")
        if bias.numel() != mat2.shape[1]:
            refusals.append(f"a bias of {bias.numel()} for {mat2.shape[1]} columns")
    return refusals


def _is_one_number(scale: torch.Tensor) -> bool:
    return scale.dtype == torch.float32 and scale.numel() == 1


def _is_per_row(scale: torch.Tensor, rows: int) -> bool:
    """[rows, 1] fp32, contiguous: ScaledBlas.cpp's `is_rowwise_scaling`."""
    return (scale.dtype == torch.float32 and scale.dim() == 2
            and tuple(scale.shape) == (rows, 1) and scale.is_contiguous())


def _scale_refusals(mat1, mat2, scale_a, scale_b) -> list[str]:
    """Both scales one fp32 number, or one per row of mat1 ([M, 1]) and one per column of
    mat2 ([1, N], whose transpose is per row)."""
    if _is_one_number(scale_a) and _is_one_number(scale_b):
        return []
    if _is_per_row(scale_a, mat1.shape[0]) and _is_per_row(scale_b.t(), mat2.shape[1]):
        if mat2.dtype != torch.float8_e4m3fn:
            return [f"a {mat2.dtype} mat2 with row-wise scales"]
        return []
    return [f"scales {tuple(scale_a.shape)} {scale_a.dtype}, {tuple(scale_b.shape)} "
            f"{scale_b.dtype}: neither one fp32 number each nor one per row of mat1 and per "
            "column of mat2"]


@contextlib.contextmanager
def cublaslt_checked(compiled: bool = False) -> Iterator[list[list[str]]]:
    """Within it, every eager `torch._scaled_mm` call (or with `compiled`, every call from
    inductor's generated code, `extern_kernels._scaled_mm`) is checked against
    `cublaslt_refusals` and then runs; yields one list of refusals per call. Compile before:
    dynamo guards on `torch._scaled_mm` and would trace the checking wrapper."""
    owner = extern_kernels if compiled else torch
    calls: list[list[str]] = []
    original = owner._scaled_mm

    def checked(*args, **kwargs):
        calls.append(cublaslt_refusals(*args, **kwargs))
        return original(*args, **kwargs)

    owner._scaled_mm = checked
    try:
        yield calls
    finally:
        owner._scaled_mm = original
