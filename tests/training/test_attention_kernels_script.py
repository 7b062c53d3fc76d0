"""benchmarks/attention_kernels.py: SDPA's kernels alone, on the inputs the model hands them.

The figures are the GPU's to give; here the script must build what BERT's attention sees (the
QKV views, the padding bias), count the work right, time what a backend serves and name what
it does not, and write its table as it goes.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.support.benchmark_scripts import benchmark_module


@pytest.fixture(scope="module")
def ak():
    with benchmark_module("attention_kernels") as module:
        yield module


def test_inputs_are_the_models_views_and_its_padding_bias(ak):
    generator = torch.Generator().manual_seed(3)
    qkv, query, key, value, bias, lengths = ak.model_inputs(32, 40, 2, 8, "cpu", generator)
    assert qkv.shape == (40, 32, 3 * 16) and qkv.requires_grad
    for x in (query, key, value):
        assert x.shape == (40, 2, 32, 8) and not x.is_contiguous()
        assert x.dtype == torch.bfloat16 and x.untyped_storage().data_ptr() == \
            qkv.untyped_storage().data_ptr()
    assert torch.equal(key[1, 0, 5], qkv[1, 5, 16:24])
    # The bias: 0 on real keys, bf16's lowest on padding, which is a suffix of each row; the
    # rows' share that is padded is Google's short_seq_prob, give or take (40 rows).
    assert bias.shape == (40, 1, 1, 32) and bias.dtype == torch.bfloat16
    padded = bias[:, 0, 0] == torch.finfo(torch.bfloat16).min
    assert torch.all((bias[:, 0, 0] == 0) | padded)
    assert torch.equal(lengths, (~padded).sum(dim=1))
    assert torch.equal(padded, torch.arange(32)[None, :] >= lengths[:, None])
    assert 1 <= int((lengths < 32).sum()) <= 12 and int(lengths.min()) >= 2


def test_flops_are_the_two_attention_gemms(ak):
    # BERT-large at 512 x 64: 34.4 GFLOP a GEMM, 68.7 a layer's forward.
    assert ak.attention_flops(512, 64, 16, 64) == pytest.approx(68.72e9, rel=1e-3)


def test_served_backends_are_timed_and_the_others_named(ak, tmp_path):
    report = ak.main(["--device", "cpu", "--shapes", "16x3", "--heads", "2", "--head-size",
                      "8", "--backends", "math,cudnn", "--warmup", "1", "--repeats", "2",
                      "--output-dir", str(tmp_path), "--commit", "abc1234"])
    rows = report["results"]
    assert [(r["backend"], r["mask"], r["dropout"]) for r in rows] == [
        (b, m, d) for b in ("math", "cudnn")
        for m, d in ((False, 0.0), (True, 0.0), (False, 0.1), (True, 0.1))]
    for row in rows[:4]:  # math serves every combination on any device
        assert "not_served" not in row
        assert row["forward_ms"] > 0 and row["backward_ms"] == pytest.approx(
            row["forward_backward_ms"] - row["forward_ms"])
        assert row["forward_tflops"] == pytest.approx(
            ak.attention_flops(16, 3, 2, 8) / row["forward_ms"] / 1e9)
    for row in rows[4:]:  # no cuDNN on a CPU: said, not timed, not a crash
        assert row["not_served"] and "forward_ms" not in row
    (md,) = tmp_path.glob("attention_kernels_*.md")
    (js,) = tmp_path.glob("attention_kernels_*.json")
    assert json.loads(js.read_text())["environment"]["commit"] == "abc1234"
    text = md.read_text()
    assert text.count("| 16 x 3 | cudnn |") == 4 and "not served" in text
    assert text.count("| 16 x 3 | math |") == 4


def test_the_masked_call_is_the_models_attention(ak):
    """What the script times with the mask is what the model computes: SDPA over the views
    with the bias equals attention with padded keys left out, row by row."""
    generator = torch.Generator().manual_seed(0)
    _, query, key, value, bias, _ = ak.model_inputs(12, 20, 2, 4, "cpu", generator)
    out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                         attn_mask=bias.float())
    for row in range(20):
        length = int((bias[row, 0, 0] == 0).sum())
        expected = F.scaled_dot_product_attention(
            query[row:row + 1].float(), key[row:row + 1, :, :length].float(),
            value[row:row + 1, :, :length].float())
        torch.testing.assert_close(out[row:row + 1], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_the_jagged_rows_compute_the_masked_attention_on_each_rows_own_tokens(ak):
    """With "mask", the nested tensors hold each row's tokens only: their attention is the
    masked padded attention at those tokens, with nothing computed for the padding."""
    generator = torch.Generator().manual_seed(1)
    _, query, key, value, bias, lengths = ak.model_inputs(12, 20, 2, 4, "cpu", generator)
    assert int((lengths < 12).sum()) >= 1
    padded = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
    keep = torch.arange(12)[None, :] < lengths[:, None]
    forward, forward_backward = ak._jagged_calls("jagged-math", query, key, value, lengths,
                                                 0.0)
    jagged = forward().values()  # [tokens, heads, head size]
    assert jagged.shape == (int(lengths.sum()), 2, 4)
    torch.testing.assert_close(jagged.float(), padded.transpose(1, 2)[keep].float(),
                               rtol=2e-2, atol=2e-2)
    forward_backward()  # the backward runs on the nested tensors


def test_a_jagged_backend_the_device_lacks_is_named_not_timed(ak, tmp_path):
    report = ak.main(["--device", "cpu", "--shapes", "16x3", "--heads", "2", "--head-size",
                      "8", "--backends", "jagged-math,jagged-flash", "--warmup", "1",
                      "--repeats", "1", "--output-dir", str(tmp_path)])
    rows = {(r["backend"], r["mask"], r["dropout"]): r for r in report["results"]}
    assert len(rows) == 8
    for (backend, _, _), row in rows.items():
        if backend == "jagged-math":  # math serves nested tensors, dropout included
            assert row["forward_ms"] > 0 and "not_served" not in row
        else:  # flash's varlen kernel is CUDA's only
            assert "No viable backend" in row["not_served"] and "forward_ms" not in row
