"""Activation checkpointing recomputes layers in backward without changing any number."""

import torch

from bertforge.training.model import BertConfig, BertForPreTraining


def batch(config: BertConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (3, 16), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 12:] = 0
    labels = torch.full_like(input_ids, -100)
    labels[:, 3] = input_ids[:, 3]
    labels[1, 7] = input_ids[1, 7]
    return dict(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids),
                attention_mask=attention_mask, labels=labels,
                next_sentence_label=torch.tensor([0, 1, 0]))


def loss_and_grads(model: BertForPreTraining, inputs, *, checkpointing: bool, seed: int = 7):
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing = checkpointing
    torch.manual_seed(seed)  # the same dropout stream for both runs
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compare(model, inputs):
    loss_a, grads_a = loss_and_grads(model, inputs, checkpointing=False)
    loss_b, grads_b = loss_and_grads(model, inputs, checkpointing=True)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_checkpointed_loss_and_grads_equal_plain_ones_bitwise_in_eval_mode():
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                        num_attention_heads=2, intermediate_size=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForPreTraining(config).eval()
    compare(model, batch(config))


def test_recomputation_replays_the_dropout_masks():
    # Non-reentrant checkpointing restores the RNG state before recomputing a layer.
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = BertForPreTraining(config).train()
    compare(model, batch(config))


def test_flag_is_off_by_default_and_inert_without_grad():
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64)
    model = BertForPreTraining(config).eval()
    assert model.gradient_checkpointing is False
    model.gradient_checkpointing = True
    with torch.no_grad():
        assert model(**batch(config)).loss.isfinite()


def test_fp8_layers_recompute_to_the_same_numbers():
    """`--fp8 --activation-checkpointing`: the recomputed forward takes each row's scale from
    the same maxima, so the loss and every gradient stay bit for bit those without
    checkpointing, under the bf16 autocast FP8 runs in (and the GEMMs are FP8 ones)."""
    from bertforge.training.model import set_fp8
    from tests.support.op_counts import OpCounter

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = BertForPreTraining(config).train()
    set_fp8(model, True)
    with torch.autocast("cpu", dtype=torch.bfloat16), OpCounter() as counted:
        compare(model, batch(config))
    assert counted.ops["_scaled_mm"] > 0
