"""training.model: parity with transformers.BertForPreTraining, sparse MLM, ties, configs, bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from bertforge.training import cpu_kernels
from bertforge.training import model as model_module
from bertforge.training.hf_interop import from_hf_state_dict, hf_name_map, to_hf_state_dict
from bertforge.training.model import (
    IGNORE_INDEX,
    PRESETS,
    BertConfig,
    BertForPreTraining,
    bert_tiny,
    num_parameters,
)

# Different depth, width, head count, vocab, eps and attention kernel on the Hugging Face side.
PARITY_CONFIGS = {
    "2L-64H-4A-v99-sdpa": (BertConfig(99, 64, 2, 4, 128), "sdpa"),
    "3L-48H-3A-v257-eager": (
        BertConfig(257, 48, 3, 3, 96, max_position_embeddings=64, layer_norm_eps=1e-5),
        "eager",
    ),
    "1L-128H-8A-v1000-sdpa": (BertConfig(1000, 128, 1, 8, 512, type_vocab_size=3), "sdpa"),
}
TOLERANCE = 1e-5


def random_batch(
    config: BertConfig, batch_size: int = 4, seq_len: int = 20, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A padded pair batch with HF names: rows shortened to varied lengths, ~15 % labels."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (batch_size, seq_len), generator=generator)
    lengths = [seq_len - (row * 5) % (seq_len // 2) for row in range(batch_size)]
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    token_type_ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
        input_ids[row, length:] = config.pad_token_id
        token_type_ids[row, length // 2 : length] = 1
        num_predicted = max(1, round(0.15 * length))
        positions = 1 + torch.randperm(length - 1, generator=generator)[:num_predicted]
        labels[row, positions] = input_ids[row, positions]
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=generator),
    }


def hf_twin(config: BertConfig, attn_implementation: str = "sdpa", seed: int = 0):
    """A randomly initialised Hugging Face model and ours holding the same weights, in eval mode."""
    torch.manual_seed(seed)
    hf_config = transformers.BertConfig(**config.to_dict(), attn_implementation=attn_implementation)
    hf_model = transformers.BertForPreTraining(hf_config).eval()
    # Biases and LayerNorms start at 0/1 in both; perturb them so parity covers every tensor.
    with torch.no_grad():
        for parameter in hf_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    ours = BertForPreTraining(config).eval()
    ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), config))
    return hf_model, ours


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_parity_with_hugging_face(name: str) -> None:
    config, attn_implementation = PARITY_CONFIGS[name]
    hf_model, ours = hf_twin(config, attn_implementation)
    batch = random_batch(config, seq_len=min(20, config.max_position_embeddings))
    predicted = batch["labels"] != IGNORE_INDEX
    with torch.no_grad():
        theirs = hf_model(**batch)
        sparse = ours(**batch)
        full = ours(**{k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")})
    real = batch["attention_mask"].bool()
    diffs = {
        "sparse_mlm": (sparse.prediction_logits - theirs.prediction_logits[predicted]).abs().max(),
        "full_mlm": (full.prediction_logits[real] - theirs.prediction_logits[real]).abs().max(),
        "nsp": (sparse.seq_relationship_logits - theirs.seq_relationship_logits).abs().max(),
        "loss": (sparse.loss - theirs.loss).abs(),
    }
    print(name, {key: f"{value.item():.3g}" for key, value in diffs.items()})
    for key, value in diffs.items():
        assert value.item() <= TOLERANCE, (key, value.item())
    mlm_from_hf = F.cross_entropy(
        theirs.prediction_logits.reshape(-1, config.vocab_size), batch["labels"].reshape(-1)
    )
    assert torch.allclose(sparse.mlm_loss, mlm_from_hf, atol=TOLERANCE)
    assert torch.allclose(sparse.loss, sparse.mlm_loss + sparse.nsp_loss)


def test_state_dict_names_equal_hugging_face_but_the_fused_qkv() -> None:
    """Our names are HF's, in HF's order, but for the fused QKV, which stands for HF's query,
    key and value."""
    config = BertConfig(50, 32, 2, 2, 64)
    hf_model = transformers.BertForPreTraining(transformers.BertConfig(**config.to_dict()))
    names = hf_name_map(config.num_hidden_layers)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    ours = [name for name in BertForPreTraining(config).state_dict() if name not in tied]
    theirs = [name for name in hf_model.state_dict() if name not in tied]
    assert sorted(hf for name in ours for hf in names[name]) == sorted(theirs)
    assert [n for n in ours if ".qkv." not in n] == [n for n in theirs if ".self." not in n]
    assert [name for name in ours if len(names[name]) > 1] == [
        f"bert.encoder.layer.{i}.attention.self.qkv.{kind}" for i in (0, 1)
        for kind in ("weight", "bias")
    ]


def test_sparse_logits_are_full_logits_at_labelled_positions_in_row_major_order() -> None:
    config = BertConfig(40, 32, 1, 2, 64)
    model = BertForPreTraining(config).eval()
    input_ids = torch.randint(5, 40, (3, 7))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    positions = [(0, 5), (0, 1), (2, 0), (1, 6), (2, 3)]
    for row, column in positions:
        labels[row, column] = 7
    with torch.no_grad():
        sparse = model(input_ids, labels=labels).prediction_logits
        full = model(input_ids).prediction_logits
    assert full.shape == (3, 7, 40)
    assert sparse.shape == (len(positions), 40)
    expected = torch.stack([full[row, column] for row, column in sorted(positions)])
    torch.testing.assert_close(sparse, expected)


def test_padding_does_not_change_real_positions() -> None:
    config = BertConfig(60, 32, 2, 2, 64)
    model = BertForPreTraining(config).eval()
    input_ids = torch.randint(5, 60, (1, 6))
    padded = torch.cat([input_ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    attention_mask = torch.tensor([[1] * 6 + [0] * 4])
    with torch.no_grad():
        alone = model(input_ids)
        with_pads = model(padded, attention_mask=attention_mask)
    torch.testing.assert_close(with_pads.prediction_logits[:, :6], alone.prediction_logits)
    torch.testing.assert_close(with_pads.seq_relationship_logits, alone.seq_relationship_logits)


def test_decoder_is_tied_to_word_embeddings_and_stays_tied_through_training() -> None:
    config = BertConfig(50, 32, 1, 2, 64)
    model = BertForPreTraining(config)
    embeddings = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight is embeddings
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = random_batch(config, batch_size=2, seq_len=8)
    model(**batch).loss.backward()
    optimizer.step()
    decoder = model.cls.predictions.decoder.weight
    assert decoder.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    # The tied tensor counts once: 50 x 32 embeddings, not twice; nor do the 14 padding rows
    # (64 - 50) of the embeddings and the MLM bias count.
    stored = model.state_dict().items()
    untied = [t for n, t in stored if not n.startswith("cls.predictions.decoder")]
    assert num_parameters(model) == sum(t.numel() for t in untied) - 14 * (32 + 1)


@pytest.mark.parametrize("vocab_size, padded", [(50, 64), (128, 128), (30522, 30528)])
def test_vocabulary_is_padded_inside_only(vocab_size: int, padded: int) -> None:
    """Embedding and decoder rows padded to a multiple of 64; logits stay vocab_size wide and the
    padding rows stay zero through training (no gradient reaches them, decay keeps 0 at 0)."""
    config = BertConfig(vocab_size, 32, 1, 2, 64)
    assert config.padded_vocab_size == padded
    model = BertForPreTraining(config)
    embeddings = model.bert.embeddings.word_embeddings
    assert embeddings.weight.shape == (padded, 32) and embeddings.num_embeddings == padded
    assert model.cls.predictions.bias.shape == (padded,)
    assert model.cls.predictions.decoder.weight is embeddings.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batch = random_batch(config, batch_size=2, seq_len=8)
    for _ in range(2):
        optimizer.zero_grad()
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
    assert out.prediction_logits.shape[-1] == vocab_size
    assert model(batch["input_ids"]).prediction_logits.shape == (2, 8, vocab_size)
    assert torch.all(embeddings.weight[vocab_size:] == 0)
    assert torch.all(model.cls.predictions.bias[vocab_size:] == 0)


def test_fused_qkv_is_three_projections_also_for_a_subset_of_queries() -> None:
    config = BertConfig(50, 32, 1, 4, 64, attention_probs_dropout_prob=0.0)
    attention = model_module.BertSelfAttention(config)
    hidden = torch.randn(2, 6, 32)
    rows = torch.tensor([[0, 3], [0, 5]])
    weight, bias = attention.qkv.weight, attention.qkv.bias
    query, key, value = (
        F.linear(hidden, w, b) for w, b in zip(weight.chunk(3), bias.chunk(3), strict=True)
    )

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(2, -1, 4, 8).transpose(1, 2)

    expected = F.scaled_dot_product_attention(heads(query), heads(key), heads(value))
    expected = expected.transpose(1, 2).reshape(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(attention(hidden, None), expected)
        queries = model_module.gather_positions(hidden, rows)
        torch.testing.assert_close(
            attention(hidden, None, queries), model_module.gather_positions(expected, rows)
        )


def test_init_matches_hugging_face_scheme() -> None:
    config = BertConfig(2000, 128, 1, 2, 256, pad_token_id=3)
    model = BertForPreTraining(config)
    layer = model.bert.encoder.layer[0]
    assert abs(layer.intermediate.dense.weight.std().item() - 0.02) < 2e-3
    assert abs(model.bert.embeddings.word_embeddings.weight.std().item() - 0.02) < 2e-3
    assert torch.all(model.bert.embeddings.word_embeddings.weight[3] == 0)
    assert torch.all(layer.intermediate.dense.bias == 0)
    assert torch.all(model.cls.predictions.bias == 0)
    assert torch.all(layer.output.LayerNorm.weight == 1)


def test_losses_present_only_for_given_labels() -> None:
    config = BertConfig(50, 32, 1, 2, 64)
    model = BertForPreTraining(config)
    batch = random_batch(config, batch_size=2, seq_len=8)
    assert model(batch["input_ids"]).loss is None
    mlm_only = model(batch["input_ids"], labels=batch["labels"])
    assert mlm_only.nsp_loss is None and mlm_only.loss is mlm_only.mlm_loss
    nsp_only = model(batch["input_ids"], next_sentence_label=batch["next_sentence_label"])
    assert nsp_only.mlm_loss is None and nsp_only.loss is nsp_only.nsp_loss
    assert nsp_only.prediction_logits.shape == (2, 8, 50)


def test_no_predicted_positions_give_a_zero_loss_that_backpropagates() -> None:
    model = BertForPreTraining(BertConfig(50, 32, 1, 2, 64))
    input_ids = torch.randint(5, 50, (2, 8))
    output = model(input_ids, labels=torch.full_like(input_ids, IGNORE_INDEX))
    assert output.prediction_logits.shape == (0, 50)
    assert output.mlm_loss.item() == 0.0
    output.loss.backward()


def test_dropout_only_in_training_mode() -> None:
    config = BertConfig(50, 32, 2, 2, 64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.5)
    model = BertForPreTraining(config)
    input_ids = torch.randint(5, 50, (2, 8))
    with torch.no_grad():
        train_a, train_b = model(input_ids).prediction_logits, model(input_ids).prediction_logits
        model.eval()
        eval_a, eval_b = model(input_ids).prediction_logits, model(input_ids).prediction_logits
    assert not torch.equal(train_a, train_b)
    assert torch.equal(eval_a, eval_b)


def test_dropout_module_keeps_bernoulli_statistics_in_the_model() -> None:
    """Through the model's modules: ~p of the hidden units dropped, none in eval."""
    torch.manual_seed(0)
    layer = model_module.BertSelfOutput(BertConfig(50, 256, 1, 2, 64, hidden_dropout_prob=0.2))
    with torch.no_grad():
        layer.dense.weight.zero_()
        layer.dense.bias.fill_(1.0)  # dense output all ones: dropped units are exact zeros
        layer.LayerNorm = torch.nn.Identity()
        hidden = torch.randn(16, 64, 256)
        out = layer(hidden, torch.zeros_like(hidden))
        assert abs((out == 0).float().mean().item() - 0.2) < 0.01
        assert torch.equal(out.unique(), torch.tensor([0.0, 1 / 0.8]))
        assert torch.equal(layer.eval()(hidden, torch.zeros_like(hidden)), torch.ones(16, 64, 256))


def test_gradients_match_hugging_face() -> None:
    """Backward parity (the forward is held above): every parameter's gradient, eval mode."""
    config = BertConfig(99, 64, 2, 4, 128)
    hf_model, ours = hf_twin(config)
    batch = random_batch(config)
    hf_model(**batch).loss.backward()
    ours(**batch).loss.backward()
    hf_grads = {name: p.grad for name, p in hf_model.named_parameters()}
    # Our gradients in HF's names and shapes (QKV split, vocabulary padding rows dropped).
    our_grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, config)
    assert our_grads.keys() == hf_grads.keys()
    for name, grad in our_grads.items():
        torch.testing.assert_close(
            grad, hf_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # The vocabulary padding rows get no gradient, from either side of the tie.
    embeddings = ours.bert.embeddings.word_embeddings.weight
    assert embeddings.shape[0] == config.padded_vocab_size == 128
    assert torch.all(embeddings.grad[config.vocab_size :] == 0)
    assert torch.all(ours.cls.predictions.bias.grad[config.vocab_size :] == 0)


def test_all_ones_attention_mask_is_dropped_with_the_same_numbers(monkeypatch) -> None:
    """No padding: no mask is built (same numbers, dropout draws and gradients as with one)."""
    config = BertConfig(50, 32, 2, 2, 64)
    model = BertForPreTraining(config)
    batch = random_batch(config, batch_size=2, seq_len=8)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    assert model_module.key_padding_mask(batch["attention_mask"]) is None
    results = []
    for always_mask in (False, True):
        if always_mask:
            monkeypatch.setattr(
                model_module, "key_padding_mask", lambda mask: (mask == 0)[:, None, None, :]
            )
        model.zero_grad()
        torch.manual_seed(2)
        loss = model(**batch).loss
        loss.backward()
        results.append((loss, model.bert.embeddings.word_embeddings.weight.grad.clone()))
    torch.testing.assert_close(results[0], results[1])


def test_bad_inputs_raise_value_error() -> None:
    model = BertForPreTraining(BertConfig(50, 32, 1, 2, 64, max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="like input_ids"):
        model(torch.ones(2, 4, dtype=torch.long), labels=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, seq"):
        model(torch.ones(4, dtype=torch.long))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_attention_heads": 5}, "not divisible"),
        ({"num_hidden_layers": 0}, "positive integer"),
        ({"hidden_size": True}, "positive integer"),
        ({"vocab_size": 10.0}, "positive integer"),
        ({"hidden_dropout_prob": 1.0}, r"\[0, 1\)"),
        ({"attention_probs_dropout_prob": -0.1}, r"\[0, 1\)"),
        ({"layer_norm_eps": 0.0}, "positive"),
        ({"pad_token_id": 30522}, "outside the vocab"),
    ],
)
def test_config_validation(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BertConfig(), **changes)


def test_config_dict_round_trip_and_strictness() -> None:
    config = bert_tiny(vocab_size=1234)
    assert BertConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown BertConfig fields"):
        BertConfig.from_dict({**config.to_dict(), "hiden_size": 3})
    with pytest.raises(ValueError, match="unknown model preset"):
        BertConfig.preset("huge")


@pytest.mark.parametrize(
    "name, shape",
    [
        ("tiny", (2, 128, 2, 512)),
        ("mini", (4, 256, 4, 1024)),
        ("base", (12, 768, 12, 3072)),
        ("large", (24, 1024, 16, 4096)),
    ],
)
def test_preset_shapes(name: str, shape: tuple[int, int, int, int]) -> None:
    config = BertConfig.preset(name, vocab_size=100)
    assert config == PRESETS[name](100)
    layers, hidden, heads, ffn = shape
    assert (config.num_hidden_layers, config.hidden_size) == (layers, hidden)
    assert (config.num_attention_heads, config.intermediate_size) == (heads, ffn)


@pytest.mark.parametrize("name, low, high", [("base", 109e6, 111e6), ("large", 335e6, 340e6)])
def test_preset_parameter_counts(name: str, low: float, high: float) -> None:
    config = BertConfig.preset(name, vocab_size=30522)
    # The meta device builds the module without allocating (large would be 1.3 GB in fp32).
    with torch.device("meta"):
        ours = BertForPreTraining(config)
        theirs = transformers.BertForPreTraining(transformers.BertConfig(**config.to_dict()))
    count = num_parameters(ours)
    assert low <= count <= high
    assert count == theirs.num_parameters()


def test_bf16_autocast_forward_backward_on_cpu() -> None:
    config = BertConfig(64, 32, 2, 2, 64)
    model = BertForPreTraining(config)
    batch = random_batch(config, batch_size=3, seq_len=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(**batch)
    assert output.prediction_logits.dtype == torch.bfloat16
    assert output.loss.dtype == torch.float32 and torch.isfinite(output.loss)
    output.loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_a_bf16_residual_stream_under_autocast_keeps_the_numbers_and_the_names() -> None:
    """`residual_in_autocast_dtype` (issue 34's lead: half the bytes of every memory-bound
    kernel on the residual stream): under bf16 autocast each layer hands on bf16 where it
    handed on fp32; the state dict is the same; the loss and the gradients stay within bf16's
    rounding of the fp32 stream; outside autocast nothing changes, bit for bit."""
    config = BertConfig(64, 32, 2, 2, 64)
    torch.manual_seed(0)
    model = BertForPreTraining(config).eval()
    batch = random_batch(config, batch_size=3, seq_len=12)
    layer_outputs = []
    for layer in model.bert.encoder.layer:
        layer.register_forward_hook(lambda _m, _i, out: layer_outputs.append(out.dtype))

    def loss_and_grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    names = list(model.state_dict())
    fp32_loss, fp32_grads = loss_and_grads()
    assert layer_outputs == [torch.float32] * 2 and not model.residual_in_autocast_dtype
    plain = model(**batch).loss.detach()
    model.residual_in_autocast_dtype = True
    layer_outputs.clear()
    bf16_loss, bf16_grads = loss_and_grads()
    assert layer_outputs == [torch.bfloat16] * 2 and model.residual_in_autocast_dtype
    assert list(model.state_dict()) == names
    assert bf16_loss == pytest.approx(fp32_loss.item(), rel=1e-2)
    assert bf16_loss != fp32_loss  # it does round: the switch reaches the model
    # Each gradient within a few bf16 roundings (2^-8) of the fp32 stream's, as a whole (seen:
    # 1.2e-2 at most, on a Zen 4 with native bf16).
    errors = [((ours - reference).norm() / reference.norm()).item()
              for ours, reference in zip(bf16_grads, fp32_grads, strict=True)
              if reference.norm() > 0]
    assert max(errors) < 3e-2, max(errors)
    assert torch.equal(model(**batch).loss, plain)  # no autocast: exactly nn.LayerNorm


def test_math_attention_gives_sdpa_numbers_for_padded_rows(monkeypatch) -> None:
    """`set_math_attention` (gpu_throughput.py's `--attention math` experiment): every layer
    attends through batched GEMMs instead of SDPA, with the same loss and gradients."""
    config = BertConfig(64, 32, 2, 2, 64)
    torch.manual_seed(0)
    model = BertForPreTraining(config).double().eval()  # eval: no dropout to draw
    batch = random_batch(config, batch_size=3, seq_len=12)
    calls = []
    monkeypatch.setattr(model_module, "attention_by_matmuls",
                        lambda *args: calls.append(1) or cpu_kernels.attention_by_matmuls(*args))

    def loss_and_grads():
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    sdpa_loss, sdpa_grads = loss_and_grads()
    assert not calls
    model_module.set_math_attention(model, True)
    math_loss, math_grads = loss_and_grads()
    assert len(calls) == config.num_hidden_layers  # the switch reaches every layer
    torch.testing.assert_close(math_loss, sdpa_loss)
    for ours, reference in zip(math_grads, sdpa_grads, strict=True):
        torch.testing.assert_close(ours, reference)
