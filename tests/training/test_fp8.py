"""FP8 GEMMs for the encoder layers (`training.fp8`, the opt-in `--fp8`; issue 34).

What a user relies on: with `--fp8` the encoder's GEMMs really run in FP8 (the forward and the
input's gradient, e4m3 with a scale per row; the weight's gradient as bf16 autocast's), close
to the exact product at FP8's precision whatever each token's magnitude, with nothing read
back to the host; the model's weights, names and checkpoints do not change; settings where it
would do nothing are refused up front; and a run trains as the bf16 path does
(tests/training/test_fast_path.py, beside the same bf16 and fp32 runs). torch's
`_scaled_mm` runs on the CPU too, which is what makes this testable here; on a GPU the same
calls go to cuBLASLt, or to inductor's own Triton FP8 GEMMs where it finds them faster (the
GPU's figures: benchmarks/gpu_parity.py --fp8, gpu_throughput.py --fp8).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bertforge.training.engine_config import EngineConfig
from bertforge.training.fp8 import fp8_linear, fp8_unsupported_reason, rows_to_fp8
from bertforge.training.model import BertConfig, BertForPreTraining, EncoderLinear, set_fp8
from bertforge.training.resolved_engine import resolve_engine
from tests.support.compiled import compiled
from tests.support.op_counts import OpCounter


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear_and_grads(function, x, weight, bias, grad):
    """`function`'s output under bf16 autocast and the input, weight and bias gradients."""
    for t in (x, weight, bias):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = function(x, weight, bias)
    out.backward(grad.to(out.dtype))
    return out, x.grad, weight.grad, bias.grad


def _operands(scale: float = 1.0, m: int = 128, k: int = 256, n: int = 512):
    generator = torch.Generator().manual_seed(0)
    x = (scale * torch.randn(m, k, generator=generator)).requires_grad_()
    weight = (0.02 * torch.randn(n, k, generator=generator)).requires_grad_()
    bias = (scale * torch.randn(n, generator=generator)).requires_grad_()
    grad = scale * torch.randn(m, n, generator=generator)
    return x, weight, bias, grad


def _exact(x, weight, bias, grad):
    """fp32 output and gradients, as the rounded paths approximate them."""
    x, weight, bias = x.detach(), weight.detach(), bias.detach()
    return x @ weight.t() + bias, grad @ weight, grad.t() @ x, grad.sum(0)


def _errors(function, operands) -> list[float]:
    """Relative errors of `function`'s output and input, weight and bias gradients."""
    return [_relative(a, b) for a, b in zip(_linear_and_grads(function, *operands),
                                            _exact(*operands), strict=True)]


def test_fp8_linear_multiplies_in_fp8_close_to_the_exact_product():
    """Forward and input gradient within e4m3's rounding of the fp32 product (3 mantissa bits:
    ~4 % where bf16 is ~0.3 %), the weight gradient autocast's own bf16 GEMM bit for bit, the
    bias gradient an fp32 sum; the dtypes autocast's Linear gives. And it is FP8, not bf16:
    one FP8 GEMM forward, one backward, and their errors well above bf16's."""
    operands = _operands()
    with OpCounter() as counted:
        out, _, grad_weight, grad_bias = _linear_and_grads(fp8_linear, *operands)
    assert counted.ops["_scaled_mm"] == 2
    assert out.dtype == torch.bfloat16 and grad_weight.dtype == grad_bias.dtype == torch.float32
    assert torch.equal(grad_weight, _linear_and_grads(F.linear, *operands)[2])
    errors, bf16_errors = _errors(fp8_linear, operands), _errors(F.linear, operands)
    assert errors[0] < 0.04 and errors[1] < 0.05 and errors[3] < 5e-3
    assert errors[0] > 4 * bf16_errors[0] and errors[1] > 4 * bf16_errors[1]


@pytest.mark.parametrize("scale", [1e-6, 1e4])
def test_each_tensor_is_scaled_to_fp8s_range(scale):
    """Activations and gradients a million times smaller (below e4m3's smallest subnormal,
    2e-3, all of them) or ten thousand times larger (past e4m3's 448) keep the precision of
    unit-sized ones."""
    unit, scaled = _errors(fp8_linear, _operands()), _errors(fp8_linear, _operands(scale))
    assert scaled[:2] == pytest.approx(unit[:2], rel=0.1)


def test_each_token_keeps_fp8s_precision_beside_larger_ones():
    """A scale per row: tokens (and their gradients) a hundred thousand times smaller than
    the others in the same batch keep e4m3's precision, where one scale for the tensor put
    them below e4m3's subnormals (55 % error with the recipe before, 100 % at 1e-7). Each
    scale is a power of two (exact to apply and undo) bringing its row's largest magnitude
    into [224, 448] once rounded."""
    x, weight, _, grad = _operands()
    with torch.no_grad():
        x[::2] *= 1e-5
    grad = grad.clone()
    grad[::2] *= 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8_linear(x, weight, None)
    out.backward(grad.to(out.dtype))
    exact_out, exact_grad = x.detach() @ weight.detach().t(), grad @ weight.detach()
    small = slice(0, None, 2)
    assert _relative(out[small], exact_out[small]) < 0.04
    assert _relative(x.grad[small], exact_grad[small]) < 0.05

    data, inverse = rows_to_fp8(x.detach())
    assert data.dtype == torch.float8_e4m3fn and inverse.shape == (x.shape[0], 1)
    assert torch.equal(torch.exp2(torch.log2(inverse).round()), inverse)
    row_max = data.float().abs().amax(dim=1)
    assert bool(((row_max >= 224) & (row_max <= 448)).all())


def test_compiled_code_rounds_each_row_as_eager_code_does():
    """What the GPU runs (inductor's code) casts every row with eager's scale, bit for bit,
    also the rows whose maximum is 1.75 * 2**m (448 / 2**k exactly, one bf16 mantissa in
    128), where a scale taken from a rounded log2 of 448 / max lands on either side; an
    all-zero row gets a finite scale."""
    torch.manual_seed(0)
    x = torch.randn(64, 48).to(torch.bfloat16)
    for i in range(0, 64, 3):
        x[i] = x[i] / x[i].abs().max() * 1.75 * 2.0 ** (i % 30 - 15)
    x[1] = 0
    eager = rows_to_fp8(x)
    from_inductor = compiled(rows_to_fp8)(x)
    assert torch.equal(eager[0].view(torch.uint8), from_inductor[0].view(torch.uint8))
    assert torch.equal(eager[1], from_inductor[1])
    assert bool(torch.isfinite(eager[1]).all())
    assert eager[0][::3].float().abs().amax(dim=1).eq(448).all()


def test_a_row_that_overflowed_stays_nan_in_fp8():
    """e4m3 has no inf, and casts that saturate (the CPU's, Triton's) would turn an overflowed
    activation into 448, a finite GEMM output where the bf16 path gives inf or NaN: a row with
    an inf or NaN is NaN in FP8, eager and compiled; the other rows are untouched."""
    x = torch.ones(32, 16, dtype=torch.bfloat16)
    x[3, 5], x[7, 0] = float("inf"), float("nan")
    for data, _ in (rows_to_fp8(x), compiled(rows_to_fp8)(x)):
        nan_rows = data.float().isnan().any(dim=1)
        assert nan_rows.nonzero().flatten().tolist() == [3, 7]
        assert bool(data.float()[3].isnan().all())
        assert data.float()[~nan_rows].eq(256).all()


def test_sizes_fp8_gemms_cannot_take_run_in_bf16_and_nothing_is_read_back():
    """A K or N that is no multiple of 16 (what torch's CUDA FP8 GEMMs require) runs autocast's
    bf16 Linear, bit for bit; any number of rows runs in FP8 (checked against those rules);
    the FP8 GEMMs read nothing back to the host (a sync on a GPU)."""
    from tests.support.cublaslt_rules import cublaslt_checked

    for k, n in ((200, 512), (256, 200)):
        operands = _operands(k=k, n=n)
        with OpCounter() as counted:
            fallback = _linear_and_grads(fp8_linear, *operands)
        assert counted.ops["_scaled_mm"] == 0
        for a, b in zip(fallback, _linear_and_grads(F.linear, *operands), strict=True):
            assert torch.equal(a, b)
    with cublaslt_checked() as calls:
        _linear_and_grads(fp8_linear, *_operands(m=100))
    assert calls == [[], []]
    with OpCounter() as counted:
        _linear_and_grads(fp8_linear, *_operands())
    assert counted.ops["_local_scalar_dense"] == 0 and counted.ops["_scaled_mm"] == 2


def test_fp8_linear_needs_autocast():
    with pytest.raises(RuntimeError, match="autocast"):
        fp8_linear(torch.randn(16, 16), torch.randn(16, 16), None)


def test_the_model_multiplies_its_encoder_layers_in_fp8_under_autocast_only():
    """`set_fp8` turns on the encoder layers' four Linears each (not the embeddings, pooler or
    heads); the weights and their state-dict names stay; outside autocast (an fp32 export
    check, say) the model computes exactly as without it."""
    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    model = BertForPreTraining(config).eval()
    names = list(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(5, 512, (4, 32), generator=generator),
             "token_type_ids": torch.zeros(4, 32, dtype=torch.long),
             "attention_mask": torch.ones(4, 32, dtype=torch.long)}

    def logits(autocast: bool) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(**batch)["prediction_logits"].float()

    plain, plain_autocast = logits(False), logits(True)
    set_fp8(model, True)
    on = [m for m in model.modules() if isinstance(m, EncoderLinear) and m.fp8]
    assert len(on) == 4 * config.num_hidden_layers
    assert list(model.state_dict()) == names
    assert torch.equal(logits(False), plain)
    with OpCounter() as counted:
        fp8_logits = logits(True)
    assert counted.ops["_scaled_mm"] == 4 * config.num_hidden_layers
    assert not torch.equal(fp8_logits, plain_autocast)
    assert _relative(fp8_logits, plain) < 0.1


def test_settings_without_bf16_autocast_or_fp8_hardware_are_refused(monkeypatch):
    """Named where there is no bf16 autocast, decided so (precision "auto" that becomes fp32:
    the suite's CPU emulates bf16), or on a GPU without FP8 tensor cores: refused before any
    engine, saying why."""
    common = dict(max_steps=10, learning_rate=1e-4, warmup_steps=1, micro_batch_size=8)
    for named in ({"precision": "fp32"}, {"precision": "fp16"}, {"zero_stage": 2}):
        with pytest.raises(ValueError, match="fp8 needs the engine's bf16 autocast"):
            EngineConfig(fp8=True, **common, **named)
    with pytest.raises(ValueError, match="fp8 needs the engine's bf16 autocast.*fp32"):
        resolve_engine(EngineConfig(fp8=True, **common), world_size=1)
    assert resolve_engine(EngineConfig(fp8=True, precision="bf16", **common), 1).config.fp8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    reason = fp8_unsupported_reason(torch.device("cuda", 0))
    assert "A100" in reason and "8.9" in reason
    assert fp8_unsupported_reason(torch.device("cpu")) is None


def test_the_fp8_model_traces_as_one_graph():
    """What the GPU compiles (each encoder layer, under bf16 autocast): FP8's autograd function
    traces into the graph, with no graph break, as the bf16 model does
    (tests/training/test_compile.py); a break would run the casts and GEMMs eagerly between
    compiled pieces."""
    from tests.training.test_compile import _graph_breaks
    from tests.training.test_model import random_batch

    torch.manual_seed(0)
    config = BertConfig(99, 32, 2, 2, 64)
    model = BertForPreTraining(config)
    model.max_predictions = 20
    set_fp8(model, True)
    with torch.autocast("cpu", dtype=torch.bfloat16), OpCounter() as counted:
        model(**random_batch(config, batch_size=4, seq_len=32))
    assert counted.ops["_scaled_mm"] > 0  # the batch reaches FP8 GEMMs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        count, reasons = _graph_breaks(model, random_batch(config, batch_size=4, seq_len=32))
    assert count == 0, reasons


def test_every_fp8_gemm_is_one_cublaslt_takes_on_a_gpu():
    """torch's CPU `_scaled_mm` skips the checks its CUDA kernel makes (cuBLASLt's FP8 layouts,
    sizes, dtype pairs, scales and bias: tests/support/cublaslt_rules.py). Every FP8 GEMM the
    GPU would run is checked against them here: the Linear's forward and backward eagerly,
    and the model's compiled encoder layers under bf16 autocast, forward and backward, as
    `build_engine` compiles them, where inductor lays the operands out itself."""
    from bertforge.training.compile_cache import use_cache_per_cpu_level
    from tests.support.cublaslt_rules import cublaslt_checked, cublaslt_refusals
    from tests.training.test_model import random_batch

    with cublaslt_checked() as calls:
        _linear_and_grads(fp8_linear, *_operands())
    assert calls == [[], []]

    torch.manual_seed(0)
    config = BertConfig(99, 64, 2, 2, 128)
    model = BertForPreTraining(config)
    model.max_predictions = 15  # 4 x (15 + 1) query rows: the last layer's rows in FP8 too
    set_fp8(model, True)
    use_cache_per_cpu_level()  # as build_engine: the suite also runs capped to AVX2
    for layer in model.bert.encoder.layer:
        layer.compile()
    batch = random_batch(config, batch_size=4, seq_len=32)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch)["loss"]
        loss.backward()

    step()  # compiles, outside the check
    with torch._dynamo.config.patch(error_on_recompile=True), \
            cublaslt_checked(compiled=True) as calls:
        step()
    assert all(refusals == [] for refusals in calls), calls
    # Each layer's four GEMMs and their four input gradients, all from inductor's code; the
    # last layer multiplies its query rows apart (one more, and its input gradient).
    assert len(calls) == 8 * config.num_hidden_layers + 2

    # The rules refuse what cuBLASLt refuses (the CPU kernel takes all of these).
    x8 = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    w8 = torch.zeros(48, 64, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    assert cublaslt_refusals(x8, w8.t(), one, one) == []
    assert "mat2 is not column-major" in cublaslt_refusals(x8, w8.t().contiguous(), one, one)[0]
    assert "mat1 is not row-major" in cublaslt_refusals(x8.t().contiguous().t(), w8.t(), one,
                                                        one)[0]
    assert cublaslt_refusals(x8.to(torch.float8_e5m2), w8.t().to(torch.float8_e5m2), one,
                             one) == ["two float8_e5m2 operands"]
    assert cublaslt_refusals(x8, w8.t(), one, one, bias=torch.zeros(48),
                             out_dtype=torch.bfloat16) == ["a torch.float32 bias for a "
                                                           "torch.bfloat16 output"]
    assert "not multiples of 16" in cublaslt_refusals(x8[:, :40], w8[:, :40].t(), one, one)[0]
    rows, columns = torch.ones(32, 1), torch.ones(48, 1).t()
    assert cublaslt_refusals(x8, w8.t(), rows, columns) == []
    assert "neither one fp32 number" in cublaslt_refusals(x8, w8.t(), rows, one)[0]
    assert "neither one fp32 number" in cublaslt_refusals(x8, w8.t(), torch.ones(1, 32),
                                                           columns)[0]
    assert cublaslt_refusals(x8.to(torch.float8_e5m2), w8.t(), rows, columns) == []
    assert cublaslt_refusals(x8, w8.t().to(torch.float8_e5m2), rows, columns) == [
        "a torch.float8_e5m2 mat2 with row-wise scales"]
