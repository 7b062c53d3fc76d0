"""LAMB against a hand computation, and where the recipe allows it."""

import math

import pytest
import torch

from bertforge.training.config import TrainConfig
from bertforge.training.optim import Lamb


def adam_direction(g: float) -> float:
    """Step 1 with bias correction: m_hat = g, v_hat = g^2, so the direction is g / (|g| + eps)."""
    return g / (abs(g) + 1e-6)


def test_first_step_matches_a_hand_computation():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # ||w|| = 5
    b = torch.nn.Parameter(torch.tensor([0.5, -0.5]))  # no-decay group: plain Adam step
    w.grad, b.grad = torch.tensor([1.0, -2.0]), torch.tensor([0.2, 0.4])
    opt = Lamb([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0}],
               lr=0.1, betas=(0.9, 0.999), eps=1e-6)
    opt.step()

    u = [adam_direction(1.0) + 0.01 * 3.0, adam_direction(-2.0) + 0.01 * 4.0]
    ratio = 5.0 / math.sqrt(u[0] ** 2 + u[1] ** 2)  # phi(||w||) / ||u||, ~3.55
    expected_w = [3.0 - 0.1 * ratio * u[0], 4.0 - 0.1 * ratio * u[1]]
    expected_b = [0.5 - 0.1 * adam_direction(0.2), -0.5 - 0.1 * adam_direction(0.4)]
    assert w.tolist() == pytest.approx(expected_w, rel=1e-6)
    assert b.tolist() == pytest.approx(expected_b, rel=1e-6)


def test_second_step_uses_moments_and_bias_correction():
    w = torch.nn.Parameter(torch.tensor([1.0, 0.0]))
    opt = Lamb([w], lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0, nvlamb=True)
    grads = [torch.tensor([1.0, 1.0]), torch.tensor([-1.0, 3.0])]
    w.grad = grads[0]
    opt.step()
    w_before = w.detach().clone()
    w.grad = grads[1]
    opt.step()

    m = [0.1 * 0.9 * 1 + 0.1 * -1, 0.1 * 0.9 * 1 + 0.1 * 3]
    v = [0.01 * 0.99 * 1 + 0.01 * 1, 0.01 * 0.99 * 1 + 0.01 * 9]
    u = [(m[i] / (1 - 0.9**2)) / (math.sqrt(v[i] / (1 - 0.99**2)) + 1e-6) for i in range(2)]
    ratio = w_before.norm().item() / math.sqrt(u[0] ** 2 + u[1] ** 2)
    expected = [w_before[i].item() - 0.01 * ratio * u[i] for i in range(2)]
    assert w.tolist() == pytest.approx(expected, rel=1e-5)


def test_weight_norm_is_clipped_and_zero_norms_fall_back_to_one():
    w = torch.nn.Parameter(torch.tensor([30.0, 40.0]))  # ||w|| = 50, clipped to 10
    z = torch.nn.Parameter(torch.zeros(2))  # ||w|| = 0: ratio 1
    w.grad, z.grad = torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0])
    Lamb([w, z], lr=0.1, weight_decay=0.01, max_weight_norm=10.0).step()
    u = [adam_direction(1.0) + 0.01 * 30, adam_direction(1.0) + 0.01 * 40]
    ratio = 10.0 / math.sqrt(u[0] ** 2 + u[1] ** 2)
    assert w.tolist() == pytest.approx([30 - 0.1 * ratio * u[0], 40 - 0.1 * ratio * u[1]])
    assert z.tolist() == pytest.approx([-0.1 * adam_direction(1.0), 0.1 * adam_direction(1.0)])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lamb_is_refused_under_zero(stage):
    with pytest.raises(ValueError, match="lamb.*zero_stage 0.*trust ratio"):
        TrainConfig(data_dir="d", run_dir="r", optimizer="lamb", zero_stage=stage)
    TrainConfig(data_dir="d", run_dir="r", optimizer="lamb", zero_stage=0)


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(data_dir="d", run_dir="r", optimizer="sgd")
