"""BERT for pretraining (masked LM + next-sentence prediction) as a pure `nn.Module`.

The architecture is Google's BERT exactly as Hugging Face's `BertForPreTraining` implements it
(post-LN encoder, exact-erf GELU, learned absolute positions, segment embeddings, tanh pooler,
MLM decoder tied to the word embeddings), and every parameter carries Hugging Face's state-dict
name, so `training.hf_interop` maps names one to one. Five things differ on purpose (the CPU
fast paths among them live in `training.cpu_kernels`):

- attention runs through `F.scaled_dot_product_attention`, which picks the flash or
  memory-efficient kernel on a GPU (on a CPU with dropout on, where SDPA can only take its
  math path, a leaner copy of that path), and with no padding in a CPU batch no mask at all;
- with `labels` the MLM head runs only at the predicted positions (~15 % of tokens). At
  seq 128, vocab 30,522, batch 8 the full head costs 8 x 128 x 768 x 30,522 x 2 = 48 GFLOP
  forward; the sparse head ~15 % of that, and its logits tensor shrinks the same way;
- with `labels` the last encoder layer, too, computes only the positions the heads read
  ([CLS] and the labelled ones; keys and values over all): ~6 % of a BERT-base step. The
  numbers are the dense model's up to float rounding (the parity tests hold it);
- on a CPU, dropout draws its mask from 16-bit lanes of 64-bit random words,
  ~5x cheaper than `torch.bernoulli_`; same probabilities up to 2^-16 rounding of p;
- on a CPU in fp32, every `Linear` runs its forward and input-gradient GEMMs through oneDNN
  rather than MKL: the same fp32 products, 5-15 % faster on this machine.

Nothing of training lives here: no optimizer, no masking, no data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bertforge.training.cpu_kernels import (
    Dropout,
    Linear,
    attention_by_matmuls,
    eager_cpu,
    linear,
    scaled_dot_product_attention,
)
from bertforge.training.fp8 import fp8_linear
from bertforge.training.module_switches import switch_every

# Hugging Face's (and PyTorch's cross_entropy default) marker for "not predicted".
IGNORE_INDEX = -100
# The model holds its vocabulary rows padded to a multiple of this (see padded_vocab_size).
VOCAB_MULTIPLE = 64


@dataclass
class BertConfig:
    """Model shape and regularisation; field names and defaults are Hugging Face's `BertConfig`."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            # bool is an int subclass; `hidden_size=True` is a mistake, not 1.
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if self.layer_norm_eps <= 0 or self.initializer_range <= 0:
            raise ValueError("layer_norm_eps and initializer_range must be positive")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocab")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of 64 (30,522 -> 30,528): the rows of the word
        embeddings, the tied decoder and its bias inside the model. The decoder GEMM's N is then
        a multiple of the 8 that tensor cores need and of cuBLAS's 64-wide tiles; the padding
        rows never leave the model (logits are cut back to vocab_size, exports strip them)."""
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BertConfig:
        """Strict: an unknown key is a typo or a different model, not something to drop."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown BertConfig fields {unknown}")
        return cls(**values)

    @classmethod
    def preset(cls, name: str, vocab_size: int = 30522) -> BertConfig:
        """A named size from `PRESETS` (`tiny`, `mini`, `base`, `large`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name](vocab_size)


# The sizes of Google's BERT release (Turc et al. 2019 for tiny/mini): head size 64 throughout.
def bert_tiny(vocab_size: int = 30522) -> BertConfig:
    return BertConfig(vocab_size, 128, 2, 2, 512)


def bert_mini(vocab_size: int = 30522) -> BertConfig:
    return BertConfig(vocab_size, 256, 4, 4, 1024)


def bert_base(vocab_size: int = 30522) -> BertConfig:
    return BertConfig(vocab_size, 768, 12, 12, 3072)


def bert_large(vocab_size: int = 30522) -> BertConfig:
    return BertConfig(vocab_size, 1024, 24, 16, 4096)


PRESETS: dict[str, Callable[[int], BertConfig]] = {
    "tiny": bert_tiny,
    "mini": bert_mini,
    "base": bert_base,
    "large": bert_large,
}


@dataclass
class PreTrainingOutput(dict):
    """`prediction_logits` without labels: [B, S, vocab]. With labels, at the labelled
    positions only, row-major (batch, position), and `prediction_labels` their targets:
    [num_predicted, vocab] and [num_predicted] when the model's `max_predictions` is unset;
    [B, W, vocab] and [B, W] with it set (W = min(max_predictions, S): each row's labelled
    positions in order, then padding slots whose label is IGNORE_INDEX)."""

    loss: torch.Tensor | None
    mlm_loss: torch.Tensor | None
    nsp_loss: torch.Tensor | None
    prediction_logits: torch.Tensor
    seq_relationship_logits: torch.Tensor
    prediction_labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Also a dict of its fields, as Hugging Face's ModelOutput: DeepSpeed 0.19 runs its
        # backward prologue from hooks on the output's tensors, found through tensors, tuples,
        # lists and dicts only. Without them its BF16_Optimizer (ZeRO-1 under bf16 with fp32
        # accumulation) never clears the bf16 gradients between micro-steps and adds earlier
        # micro-batches again: g0 + g1/2 instead of (g0 + g1)/2 over two (measured).
        self.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that can hand its output on in the autocast dtype (same parameters, same
    state-dict names).

    Under torch.autocast, layer_norm computes in fp32 and returns fp32, so with fp32 weights
    under autocast (the engine's fast path) the post-LN residual stream between layers is
    fp32, and each memory-bound kernel on it (dropout + residual add + LayerNorm, forward and
    backward) moves twice the bytes of a bf16 stream. With `residual_in_autocast_dtype` it
    still normalises in fp32, then rounds its output to the autocast dtype: the stream
    DeepSpeed's bf16-weights path keeps. Off, or outside autocast: exactly nn.LayerNorm.
    """

    residual_in_autocast_dtype = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.residual_in_autocast_dtype and torch.is_autocast_enabled(x.device.type):
            return out.to(torch.get_autocast_dtype(x.device.type))
        return out


def set_residual_in_autocast_dtype(model: nn.Module, enabled: bool) -> None:
    """Every `LayerNorm` of `model` (pretraining's or a fine-tuning task's) hands its output on
    in the autocast dtype, or not. Set it before compiling: a compiled layer keeps the choice
    it was traced with until it recompiles."""
    switch_every(model, LayerNorm, "residual_in_autocast_dtype", enabled)


class EncoderLinear(Linear):
    """An encoder layer's Linear (same parameters and state-dict names), whose GEMMs run in
    FP8 where `fp8` is set and the forward runs under autocast (`training.fp8`: the opt-in
    `EngineConfig.fp8`); otherwise `Linear`'s. The embeddings, pooler and heads keep theirs."""

    fp8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.multiply(x, self.weight, self.bias)

    def multiply(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias as this Linear multiplies (in FP8 or not), with its own
        weight or a block of its rows (the fused QKV's query rows)."""
        if self.fp8 and torch.is_autocast_enabled(x.device.type):
            return fp8_linear(x, weight, bias)
        return linear(x, weight, bias)


def set_fp8(model: nn.Module, enabled: bool) -> None:
    """Every encoder layer's Linear of `model` multiplies in FP8 under autocast, or not. Set
    it before compiling, as the residual stream's dtype."""
    switch_every(model, EncoderLinear, "fp8", enabled)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        # padding_idx as Hugging Face: the [PAD] row gets no gradient through the input side.
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`position_ids` [B, S] (packed rows: restarting at each instance); default 0..S-1."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        embeddings = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(position_ids)
        )
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    # An experiment of benchmarks/gpu_throughput.py (`--attention math`, `set_math_attention`):
    # attention as two batched GEMMs around a fused mask + softmax + dropout kernel, instead
    # of SDPA's fused kernels. Off in the product.
    math_attention = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.hidden_size = config.hidden_size
        self.dropout_prob = config.attention_probs_dropout_prob
        # Q, K and V as one [3H, H] GEMM (rows: query, key, value): one kernel that reads the
        # input once instead of three. hf_interop splits it into HF's query/key/value and back.
        self.qkv = EncoderLinear(config.hidden_size, 3 * config.hidden_size)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        return x.view(batch_size, seq_len, self.num_heads, self.head_size).transpose(1, 2)

    def forward(
        self, hidden: torch.Tensor, key_padding: torch.Tensor | None,
        queries: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of `queries` (default: every position of `hidden`) over all of `hidden`."""
        if queries is None:
            query, key, value = self.qkv(hidden).split(self.hidden_size, dim=-1)
        else:
            # Queries at a few rows only: the query block on those, key and value on all.
            weight, bias, h = self.qkv.weight, self.qkv.bias, self.hidden_size
            query = self.qkv.multiply(queries, weight[:h], bias[:h])
            key, value = self.qkv.multiply(hidden, weight[h:], bias[h:]).split(h, dim=-1)
        query, key, value = (self._split_heads(x) for x in (query, key, value))
        attn_mask = None
        if key_padding is not None:
            # Built in the query's dtype (bf16 under autocast): SDPA wants them equal, and
            # finfo(dtype).min stays finite where a cast of the fp32 minimum would become -inf.
            attn_mask = torch.zeros(key_padding.shape, dtype=query.dtype, device=query.device)
            attn_mask.masked_fill_(key_padding, torch.finfo(query.dtype).min)
        dropout_p = self.dropout_prob if self.training else 0.0
        attend = attention_by_matmuls if self.math_attention else scaled_dot_product_attention
        context = attend(query, key, value, attn_mask, dropout_p)
        batch_size, _, seq_len, _ = context.shape
        return context.transpose(1, 2).reshape(batch_size, seq_len, -1)


def set_math_attention(model: nn.Module, enabled: bool) -> None:
    """Every attention of `model` runs as batched GEMMs (`attention_by_matmuls`), or through
    SDPA. Set it before compiling, as `set_fp8`."""
    switch_every(model, BertSelfAttention, "math_attention", enabled)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = EncoderLinear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # Post-LN, as the original BERT: normalise after adding the residual.
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(
        self, hidden: torch.Tensor, key_padding: torch.Tensor | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        queries = None if rows is None else gather_positions(hidden, rows)
        residual = hidden if queries is None else queries
        if rows is not None and key_padding is not None and key_padding.shape[2] > 1:
            # A packed batch's mask has a row per query ([B, 1, S, S]): keep the queries' rows.
            index = rows[:, None, :, None].expand(-1, 1, -1, key_padding.shape[3])
            key_padding = key_padding.gather(2, index)
        return self.output(self.self(hidden, key_padding, queries), residual)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = EncoderLinear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Exact erf GELU, Hugging Face's "gelu" (not the tanh approximation).
        return F.gelu(self.dense(hidden))


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = EncoderLinear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(
        self, hidden: torch.Tensor, key_padding: torch.Tensor | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All positions, or only `rows` ([B, R] positions): keys and values still see all."""
        attention_output = self.attention(hidden, key_padding, rows)
        return self.output(self.intermediate(attention_output), attention_output)


def gather_positions(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """hidden[b, rows[b, r]] as [B, R, H]."""
    return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # Keep only each layer's input and recompute the layer in backward: activation memory
        # drops from ~L layers' intermediates to one, for ~1/3 more compute.
        self.gradient_checkpointing = False

    def forward(
        self, hidden: torch.Tensor, key_padding: torch.Tensor | None,
        last_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`last_rows` ([B, R] positions): the last layer computes only those outputs."""
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for index, layer in enumerate(self.layer):
            if last_rows is not None and index == len(self.layer) - 1:
                hidden = layer(hidden, key_padding, last_rows)
            elif recompute:
                # Non-reentrant: works with inputs that need no grad and restores the RNG
                # state, so dropout draws the same mask in the recomputation.
                hidden = checkpoint(layer, hidden, key_padding, use_reentrant=False)
            else:
                hidden = layer(hidden, key_padding)
        return hidden


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_output: torch.Tensor) -> torch.Tensor:
        """The [CLS] outputs, [B, H] (or [B, K, H], K instances a packed row), summarise each
        pair for NSP."""
        return torch.tanh(self.dense(cls_output))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        last_rows: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cls_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With `last_rows` ([B, R]) the sequence output holds only those positions, [B, R, H];
        its first column(s) must be the [CLS] position(s) the pooler reads: position 0, or a
        packed batch's `cls_positions` ([B, K]).

        Packed rows (several instances a row, see `training.data.packing`) come with
        `position_ids` restarting at each instance: attention stays within an instance, and
        the pooled output is [B, K, H], one per instance slot."""
        if position_ids is None:
            key_padding = key_padding_mask(attention_mask)
        else:  # [B, 1, S, S]: block-diagonal over the instances of each row
            key_padding = _instance_mask(attention_mask, position_ids)
        embeddings = self.embeddings(input_ids, token_type_ids, position_ids)
        sequence_output = self.encoder(embeddings, key_padding, last_rows)
        if cls_positions is None:
            cls_output = sequence_output[:, 0]
        elif last_rows is None:
            cls_output = gather_positions(sequence_output, cls_positions)
        else:
            cls_output = sequence_output[:, : cls_positions.shape[1]]
        return sequence_output, self.pooler(cls_output)


def key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, S] with 1 = real token -> [B, 1, 1, S] True where a key must be ignored (broadcast
    over heads and query positions), or None when nothing is padded: no mask to build and add
    in every layer, and SDPA may take its fused kernels. Checked on a CPU only, where it costs
    nothing; on a GPU it would be a host sync per step, so the mask stays. Packed rows take
    `_instance_mask` instead."""
    if attention_mask is None:
        return None
    # Not under torch.compile: reading the mask's value would break the graph there.
    if eager_cpu(attention_mask) and bool(attention_mask.all()):
        return None
    return (attention_mask == 0)[:, None, None, :]


def _instance_mask(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor
) -> torch.Tensor:
    """Block-diagonal attention for packed rows: [B, 1, S, S], True where query q must ignore
    key k, i.e. where they belong to different instances.

    An instance starts where its position is 0, so the instance of a real token is the count
    of real position-0 tokens up to it (1, 2, ...), and padding is instance 0: a real token
    never sees padding or another instance, and a padding query sees the padding only (never
    an empty row, which would make the softmax NaN). Built on the device from the batch, no
    host sync; one mask for every layer. On a GPU, SDPA takes its memory-efficient kernel (a
    fused kernel with dropout) with this mask; FlexAttention and `varlen_attn` would skip the
    masked blocks but take no attention dropout, which BERT trains with.
    """
    real = torch.ones_like(position_ids, dtype=torch.bool)
    if attention_mask is not None:
        real = attention_mask != 0
    instance = torch.cumsum((position_ids == 0) & real, dim=1) * real
    return (instance[:, :, None] != instance[:, None, :])[:, None]


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        # The decoder's weight is tied to the word embeddings by BertForPreTraining; its bias
        # *is* `self.bias` (one Parameter under two names), as in Hugging Face, so the state
        # dict carries `cls.predictions.bias` and `cls.predictions.decoder.bias` alike.
        self.decoder = Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder.bias = self.bias
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The decoder computes padded_vocab_size logits; the padding ones are cut here, so no
        # loss, argmax or caller ever sees them (and they get no gradient).
        return self.decoder(self.transform(hidden))[..., : self.vocab_size]


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = Linear(config.hidden_size, 2)


class BertForPreTraining(nn.Module):
    """BERT with the MLM and NSP heads; `forward` takes a batch by its Hugging Face names."""

    # The most labelled positions a row can have (the loader's max_predictions). Set, the
    # sparse MLM head and the last layer run on a fixed number of slots per row and forward
    # never waits for the device; unset (Hugging Face's contract: logits of exactly the
    # labelled positions), forward reads the most labels in a row back from the device.
    max_predictions: int | None = None

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.tie_weights()
        self.apply(self._init_weights)
        self._pad_vocab()

    @property
    def gradient_checkpointing(self) -> bool:
        """Recompute each encoder layer in backward (same numbers, less activation memory)."""
        return self.bert.encoder.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self.bert.encoder.gradient_checkpointing = bool(enabled)

    @property
    def residual_in_autocast_dtype(self) -> bool:
        """Every LayerNorm hands its output on in the autocast dtype (`LayerNorm`): a bf16
        residual stream under bf16 autocast. Off in a bare model; the engine turns it on under
        bf16 autocast (`EngineConfig.bf16_residual`). Set it before compiling."""
        return all(m.residual_in_autocast_dtype
                   for m in self.modules() if isinstance(m, LayerNorm))

    @residual_in_autocast_dtype.setter
    def residual_in_autocast_dtype(self, enabled: bool) -> None:
        set_residual_in_autocast_dtype(self, enabled)

    def tie_weights(self) -> None:
        """Share the word embeddings with the MLM decoder; call again after `assign=True` loads."""
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        self.cls.predictions.decoder.bias = self.cls.predictions.bias

    @torch.no_grad()
    def _pad_vocab(self) -> None:
        """Zero rows from vocab_size to padded_vocab_size in the word embeddings (the tied
        decoder's weight) and the decoder bias, added after the init so that not one random draw
        moves: a seed gives the weights of the unpadded model (Hugging Face's). They stay zero:
        no input id reaches them, the head cuts their logits (no gradient), and weight decay
        keeps zero at zero."""
        extra = self.config.padded_vocab_size - self.config.vocab_size
        if extra == 0:
            return
        embeddings = self.bert.embeddings.word_embeddings
        embeddings.weight = nn.Parameter(F.pad(embeddings.weight, (0, 0, 0, extra)))
        embeddings.num_embeddings += extra
        head = self.cls.predictions
        head.bias = nn.Parameter(F.pad(head.bias, (0, extra)))
        head.decoder.out_features += extra
        self.tie_weights()

    def _is_fused_qkv(self, module: nn.Module) -> bool:
        return any(module is layer.attention.self.qkv for layer in self.bert.encoder.layer)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Hugging Face's init: N(0, initializer_range) weights, zero biases, unit LayerNorm."""
        std = self.config.initializer_range
        if module is self.cls.predictions.decoder:
            return  # tied: its weight is the word embedding, initialised (pad row zeroed) there
        if isinstance(module, nn.Linear):
            # The fused QKV weight draws its query, key and value blocks one after another, as
            # three [H, H] Linears do: a seed gives the same weights as the unfused model.
            for block in module.weight.chunk(3 if self._is_fused_qkv(module) else 1):
                block.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, BertLMPredictionHead):
            module.bias.zero_()

    def _check_inputs(self, input_ids: torch.Tensor, *same_shape: torch.Tensor | None) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        for tensor in same_shape:
            if tensor is not None and tensor.shape != input_ids.shape:
                raise ValueError(
                    f"expected shape {tuple(input_ids.shape)} like input_ids, "
                    f"got {tuple(tensor.shape)}"
                )

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cls_positions: torch.Tensor | None = None,
    ) -> PreTrainingOutput:
        """A batch by its Hugging Face names; a packed batch (`training.data.packing`) adds
        `position_ids` and `cls_positions` ([B, K]), and its `next_sentence_label` is [B, K]
        (IGNORE_INDEX for empty slots): NSP logits are then [B, K, 2]. The losses are the
        same means over labelled tokens and instances as one instance a row."""
        self._check_inputs(input_ids, token_type_ids, attention_mask, labels, position_ids)
        _check_packed(position_ids, cls_positions, next_sentence_label)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        mlm_loss = nsp_loss = None
        packed = {"position_ids": position_ids, "cls_positions": cls_positions}
        if labels is None:
            sequence_output, pooled_output = self.bert(
                input_ids, token_type_ids, attention_mask, **packed
            )
            prediction_logits = self.cls.predictions(sequence_output)
        else:
            rows, prediction_labels = output_rows(labels, self.max_predictions)
            num_cls = 1
            if cls_positions is not None:  # a packed row's [CLS]s in place of position 0
                rows = torch.cat([cls_positions, rows[:, 1:]], dim=1)
                num_cls = cls_positions.shape[1]
            sequence_output, pooled_output = self.bert(
                input_ids, token_type_ids, attention_mask, last_rows=rows, **packed
            )
            # First the [CLS] column(s); then each row's labelled positions in order, padding.
            prediction_logits, mlm_loss = self._sparse_mlm(
                sequence_output[:, num_cls:], prediction_labels
            )
            if self.max_predictions is None:  # exactly the labelled positions, [N, vocab]
                real = prediction_labels != IGNORE_INDEX
                prediction_logits, prediction_labels = (
                    prediction_logits[real], prediction_labels[real]
                )
        seq_relationship_logits = self.cls.seq_relationship(pooled_output)
        if next_sentence_label is not None:
            # Packed: one per instance slot, empty slots IGNORE_INDEX: the mean over instances.
            nsp_loss = F.cross_entropy(
                seq_relationship_logits.float().reshape(-1, 2),
                next_sentence_label.reshape(-1).long(),
            )
        return PreTrainingOutput(
            loss=_total_loss(mlm_loss, nsp_loss),
            mlm_loss=mlm_loss,
            nsp_loss=nsp_loss,
            prediction_logits=prediction_logits,
            seq_relationship_logits=seq_relationship_logits,
            prediction_labels=None if labels is None else prediction_labels,
        )

    def _sparse_mlm(
        self, slot_output: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM logits [B, W, vocab] at the slots of `output_rows`, and the mean loss over the
        slots whose target is not IGNORE_INDEX (padding slots add 0 to the sum, no gradient).

        Sum / count rather than cross_entropy's mean: the same number, and with no labels at
        all a zero loss still connected to the graph, where the mean over no elements is NaN
        and would poison the optimizer state.
        """
        prediction_logits = self.cls.predictions(slot_output)
        targets = targets.long()
        # fp32 softmax: bf16's 8-bit mantissa makes a log-sum-exp over 30k logits noisy.
        loss_sum = F.cross_entropy(
            prediction_logits.float().flatten(0, 1), targets.flatten(),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        num_predicted = (targets != IGNORE_INDEX).sum()
        return prediction_logits, loss_sum / num_predicted.clamp(min=1)


def _check_packed(
    position_ids: torch.Tensor | None, cls_positions: torch.Tensor | None,
    next_sentence_label: torch.Tensor | None,
) -> None:
    """A packed batch comes whole: positions restarting per instance, and per instance slot
    its [CLS] position and NSP label."""
    if cls_positions is None:
        return
    if position_ids is None:
        raise ValueError("cls_positions (a packed batch) needs position_ids")
    if cls_positions.dim() != 2 or cls_positions.shape[0] != position_ids.shape[0]:
        raise ValueError(f"cls_positions must be [batch, instances a row], got shape "
                         f"{tuple(cls_positions.shape)}")
    if next_sentence_label is not None and next_sentence_label.shape != cls_positions.shape:
        raise ValueError(f"a packed batch's next_sentence_label must be shaped like "
                         f"cls_positions {tuple(cls_positions.shape)}, got "
                         f"{tuple(next_sentence_label.shape)}")


def output_rows(
    labels: torch.Tensor, max_predictions: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions the heads read, [B, 1 + W]: [CLS] (position 0), then each row's labelled
    positions in increasing order, then position 0 again in the slots a row does not fill;
    and the labels at the W slots, [B, W], IGNORE_INDEX at the unfilled ones.

    Only these need the last encoder layer's output: its queries, attention output and FFN
    run on 21 of 128 positions (keys and values still on all), which saves ~70 % of that
    layer, ~6 % of BERT-base's step.

    W = min(max_predictions, S) comes from shapes alone: no device value is read, nothing is
    indexed by a mask, so a GPU step never waits here (Google's BERT gathers a fixed
    max_predictions_per_seq the same way). The unfilled slots cost little: at 128 tokens
    rows are mostly full (round(0.15 x 126) = 19 of 20 slots used). Without max_predictions
    W is the most labels in a row, read from the device: one host sync.
    """
    labelled = labels != IGNORE_INDEX
    counts = labelled.sum(dim=1)
    if max_predictions is None:
        width = int(counts.max()) if labels.numel() else 0
    else:
        width = min(max_predictions, labels.shape[1])
        # More labels in a row than slots would drop some silently. Checked on the device
        # (on a GPU a device-side assert; no host sync): the loader never exceeds its bound.
        torch._assert_async(
            (counts <= width).all(), f"a row has more than max_predictions={width} labels"
        )
    # A stable sort of "not labelled" flags puts the labelled positions first, in order.
    order = torch.sort((~labelled).to(torch.uint8), dim=1, stable=True).indices[:, :width]
    real = torch.arange(width, device=labels.device) < counts[:, None]
    positions = torch.where(real, order, 0)
    targets = torch.where(real, labels.gather(1, positions), IGNORE_INDEX)
    cls = torch.zeros(labels.shape[0], 1, dtype=positions.dtype, device=labels.device)
    return torch.cat([cls, positions], dim=1), targets


def _total_loss(
    mlm_loss: torch.Tensor | None, nsp_loss: torch.Tensor | None
) -> torch.Tensor | None:
    if mlm_loss is None or nsp_loss is None:
        return mlm_loss if nsp_loss is None else nsp_loss
    return mlm_loss + nsp_loss


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (the tied decoder counts once), as papers and Hugging Face count them:
    without the vocabulary padding rows (padded_vocab_size - vocab_size) x (hidden + bias)."""
    count = sum(parameter.numel() for parameter in model.parameters())
    if isinstance(model, BertForPreTraining):
        config = model.config
        count -= (config.padded_vocab_size - config.vocab_size) * (config.hidden_size + 1)
    return count
