"""training.cpu_kernels: each CPU fast path gives the stock PyTorch numbers (up to rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bertforge.training import cpu_kernels
from tests.support.compiled import compiled


@pytest.mark.parametrize("padded", [False, True])
def test_cpu_training_attention_equals_the_math_path_with_the_same_dropout_mask(
    padded: bool,
) -> None:
    """On a CPU with dropout on, ours skips SDPA's math path for a leaner one of its own."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(3, 4, 10, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(3, 1, 1, 10, dtype=torch.float64)
    if padded:
        mask[1, ..., 6:] = torch.finfo(torch.float64).min
    torch.manual_seed(1)
    attn_mask = mask if padded else None
    actual = cpu_kernels.attention_by_matmuls(query, key, value, attn_mask, 0.3)
    torch.manual_seed(1)
    keep = cpu_kernels._lane_dropout_mask(torch.empty(3, 4, 10, 10, dtype=torch.float64), 0.3)
    probs = torch.softmax(query @ key.transpose(-1, -2) / 8**0.5 + mask, dim=-1)
    torch.testing.assert_close(actual, (probs * keep) @ value)
    # And with nothing dropped it is SDPA's attention.
    no_drop = torch.ones_like(keep)
    torch.testing.assert_close(
        (probs * no_drop) @ value,
        F.scaled_dot_product_attention(query, key, value, attn_mask=mask),
    )


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9, 1e-3, 0.123456])
def test_dropout_lane_threshold_drops_a_fraction_p_of_all_16_bit_values(p: float) -> None:
    """Every int16 value once: exactly round(p x 65536) of them drop, the rest scale by
    1/(1-p); so P(drop) for uniform lanes is within 2^-17 of p."""
    lanes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    mask = cpu_kernels._mask_from_lanes(lanes, p, torch.float32)
    dropped = int((mask == 0).sum())
    assert dropped == round(p * 65536)
    assert abs(dropped / 65536 - p) <= 2**-17 < 1e-5
    assert torch.equal(mask[dropped:], torch.full((65536 - dropped,), 1 / (1 - p)))
    assert (mask[:dropped] == 0).all()  # the lowest values drop


def test_dropout_drop_rate_scale_and_lanes_on_a_large_tensor() -> None:
    torch.manual_seed(0)
    p, numel = 0.1, 2**22
    x = torch.rand(numel) + 1.0  # never 0: a zero output means dropped
    out = cpu_kernels.dropout(x, p)
    dropped = out == 0
    # Binomial: std sqrt(p(1-p)/n) = 1.5e-4; 5 sigma.
    assert abs(dropped.float().mean().item() - p) < 7.5e-4
    # Each of a 64-bit word's four lanes alone (a lane that never drops would give 0).
    for lane in range(4):
        assert abs(dropped[lane::4].float().mean().item() - p) < 1.5e-3, lane
    torch.testing.assert_close(out[~dropped], x[~dropped] / (1 - p), rtol=1e-6, atol=0)
    # Odd sizes and shapes (not a multiple of four lanes) work.
    assert cpu_kernels.dropout(torch.ones(3, 5, 7), p).shape == (3, 5, 7)


def test_dropout_seed_reproducibility_eval_identity_and_gradient() -> None:
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(5)
    a = cpu_kernels.dropout(x, 0.3)
    torch.manual_seed(5)
    b = cpu_kernels.dropout(x, 0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, cpu_kernels.dropout(x, 0.3))  # the stream moved on
    a.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(a == 0, 0.0, 1 / 0.7))
    layer = cpu_kernels.Dropout(0.3).eval()
    assert layer(x) is x
    assert cpu_kernels.dropout(x, 0.0) is x
    assert cpu_kernels.Dropout(0.3).train()(x).eq(0).any()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_onednn_linear_matches_f_linear_forward_and_backward(bias: bool, strided: bool) -> None:
    torch.manual_seed(0)
    layer = cpu_kernels.Linear(48, 40, bias=bias)
    x = torch.randn(3, 7, 48)
    if strided:
        x = torch.randn(3, 7, 96)[..., ::2]  # non-contiguous input, as a gathered view may be
    x.requires_grad_(True)
    out = layer(x)
    assert type(out.grad_fn).__name__ == "_OneDnnLinearBackward"
    grad = torch.randn_like(out)
    out.backward(grad)
    ours = [x.grad, layer.weight.grad] + ([layer.bias.grad] if bias else [])
    x.grad = None
    layer.zero_grad(set_to_none=True)
    expected = F.linear(x, layer.weight, layer.bias)
    expected.backward(grad)
    reference = [x.grad, layer.weight.grad] + ([layer.bias.grad] if bias else [])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for actual, wanted in zip(ours, reference, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)


def test_onednn_linear_only_for_plain_fp32_cpu() -> None:
    layer = cpu_kernels.Linear(8, 4)
    assert cpu_kernels._ONEDNN_LINEAR  # torch's CPU wheels ship oneDNN
    assert type(layer(torch.randn(2, 8)).grad_fn).__name__ == "_OneDnnLinearBackward"
    # float64 takes F.linear (whatever it is: DeepSpeed's ZeRO-3 swaps in its own wrapper).
    double = cpu_kernels.Linear(8, 4).double()
    out = double(torch.randn(2, 8, dtype=torch.float64))
    assert type(out.grad_fn).__name__ != "_OneDnnLinearBackward"
    assert out.dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 8))
    assert out.dtype == torch.bfloat16


def test_lane_masks_under_torch_compile_draw_apart_and_hold_through_the_backward() -> None:
    """`set_lane_masks` (gpu_throughput.py's `--dropout-mask lanes` experiment): compiled in
    one graph, each Dropout draws its own mask at rate p (two of the same shape differ), and
    the backward applies the forward's mask (not a second draw)."""
    torch.manual_seed(0)
    first, second = cpu_kernels.Dropout(0.1), cpu_kernels.Dropout(0.1)
    model = torch.nn.ModuleList([first, second])
    cpu_kernels.set_lane_masks(model, True)
    assert first.lane_mask_everywhere and second.lane_mask_everywhere

    def two_dropouts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return first(x), second(x * 2.0)

    x = (torch.rand(512, 256) + 1.0).requires_grad_()  # never 0: a zero output means dropped
    a, b = compiled(two_dropouts)(x)  # in one graph: no graph break
    for out in (a, b):
        assert abs((out == 0).float().mean().item() - 0.1) < 5e-3
    assert not torch.equal(a == 0, b == 0)
    a.sum().backward()
    torch.testing.assert_close(x.grad, (a != 0).float() / 0.9)
    cpu_kernels.set_lane_masks(model, False)
    assert not first.lane_mask_everywhere
