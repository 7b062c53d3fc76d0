"""Hugging Face interop: our `BertForPreTraining` state dict <-> a `transformers` directory.

The name map is literal on purpose: a rename on either side fails loudly here instead of loading
silently wrong. Two layouts differ from Hugging Face's, and only here are they converted:
- each layer's fused `attention.self.qkv` ([3H, H], [3H]) is HF's `query`, `key` and `value`
  stacked along dim 0 in that order: split on export, concatenated on import;
- the word embeddings and the MLM bias hold `padded_vocab_size` rows (a multiple of 64): export
  keeps the first `vocab_size`, import appends zero rows.
Wrapper prefixes (`module.` from DDP/DeepSpeed, `_orig_mod.` from `torch.compile`) are stripped
by name, never by guessing.

Export writes what `BertForPreTraining.from_pretrained` and `BertTokenizerFast.from_pretrained`
load with no missing or unexpected keys, without importing `transformers` (a dev dependency).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, processors

from bertforge.pipelines.contract.manifest import sha256_file
from bertforge.pipelines.contract.tokenization import SPECIAL_TOKENS, load_tokenizer, read_vocab
from bertforge.training.model import BertConfig

WRAPPER_PREFIXES = ("module.", "_orig_mod.")

# Ours -> Hugging Face, outside the encoder layers.
_EMBEDDING_NAMES = {
    "bert.embeddings.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight": "bert.embeddings.LayerNorm.weight",
    "bert.embeddings.LayerNorm.bias": "bert.embeddings.LayerNorm.bias",
}
# Ours -> Hugging Face, relative to `bert.encoder.layer.{i}.` on both sides. A tuple: our
# tensor is those of Hugging Face concatenated along dim 0, in that order.
_LAYER_NAMES = {
    "attention.self.qkv.weight": (
        "attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
    ),
    "attention.self.qkv.bias": (
        "attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias",
    ),
    "attention.output.dense.weight": "attention.output.dense.weight",
    "attention.output.dense.bias": "attention.output.dense.bias",
    "attention.output.LayerNorm.weight": "attention.output.LayerNorm.weight",
    "attention.output.LayerNorm.bias": "attention.output.LayerNorm.bias",
    "intermediate.dense.weight": "intermediate.dense.weight",
    "intermediate.dense.bias": "intermediate.dense.bias",
    "output.dense.weight": "output.dense.weight",
    "output.dense.bias": "output.dense.bias",
    "output.LayerNorm.weight": "output.LayerNorm.weight",
    "output.LayerNorm.bias": "output.LayerNorm.bias",
}
_HEAD_NAMES = {
    "bert.pooler.dense.weight": "bert.pooler.dense.weight",
    "bert.pooler.dense.bias": "bert.pooler.dense.bias",
    "cls.predictions.bias": "cls.predictions.bias",
    "cls.predictions.transform.dense.weight": "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias": "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight": "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias": "cls.predictions.transform.LayerNorm.bias",
    "cls.seq_relationship.weight": "cls.seq_relationship.weight",
    "cls.seq_relationship.bias": "cls.seq_relationship.bias",
}
# Tied names (ours -> HF) and the tensor each one aliases. Hugging Face's `save_pretrained`
# leaves them out of model.safetensors and re-ties them on load; so do we.
_TIED_NAMES = {
    "cls.predictions.decoder.weight": "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias": "cls.predictions.decoder.bias",
}
_TIED_SOURCES = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
# Ours with padded_vocab_size rows inside the model and vocab_size outside.
_VOCAB_ROWS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")
# Google's TF-converted checkpoints (e.g. the original bert-base-uncased pytorch_model.bin)
# name LayerNorm parameters gamma/beta; transformers renames them on load, and so do we.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}

HF_CONFIG_NAME = "config.json"
# In transformers' order of preference; an index names the shards of a sharded save
# (`save_pretrained(max_shard_size=...)`: BERT-large's 1.3 GB under a 500MB limit, say).
HF_WEIGHTS_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")
HF_TOKENIZER_NAME = "tokenizer.json"


def hf_name_map(num_hidden_layers: int) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> Hugging Face's, for every stored (untied) tensor: one name, or the
    names whose tensors ours concatenates along dim 0 (the fused QKV)."""
    names = {ours: (hf,) for ours, hf in _EMBEDDING_NAMES.items()}
    for index in range(num_hidden_layers):
        prefix = f"bert.encoder.layer.{index}."
        for ours, hf in _LAYER_NAMES.items():
            parts = (hf,) if isinstance(hf, str) else hf
            names[prefix + ours] = tuple(prefix + part for part in parts)
    names.update({ours: (hf,) for ours, hf in _HEAD_NAMES.items()})
    return names


def strip_wrapper_prefixes(name: str) -> str:
    """`module._orig_mod.bert...` -> `bert...`: DDP/DeepSpeed and torch.compile wrappers."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


def _check_names(present: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise ValueError(f"{what} does not match: missing {missing}, unexpected {unexpected}")


def to_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: BertConfig
) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face names and shapes (fused QKV split, vocabulary padding
    rows dropped), tied tensors left out, fp32, contiguous, on CPU."""
    stripped = {strip_wrapper_prefixes(name): tensor for name, tensor in state_dict.items()}
    for tied in _TIED_NAMES:
        stripped.pop(tied, None)
    return rename_to_hf(stripped, hf_name_map(config.num_hidden_layers), config)


def encoder_name_map(num_hidden_layers: int, *, pooler: bool = True) -> dict[str, tuple[str, ...]]:
    """`hf_name_map` restricted to the encoder (`bert.*`): what a task head sits on."""
    return {ours: hf for ours, hf in hf_name_map(num_hidden_layers).items()
            if ours.startswith("bert.") and (pooler or not ours.startswith("bert.pooler."))}


def rename_to_hf(
    state_dict: Mapping[str, torch.Tensor], names: Mapping[str, tuple[str, ...]],
    config: BertConfig,
) -> dict[str, torch.Tensor]:
    """Tensors named as `names`' keys -> Hugging Face names and shapes (fused QKV split,
    vocabulary padding rows dropped), fp32, contiguous, on CPU; exactly `names` must be there."""
    _check_names(set(state_dict), set(names), "state dict")
    hf_state_dict = {}
    for ours, tensor in state_dict.items():
        if ours in _VOCAB_ROWS:
            tensor = tensor[: config.vocab_size]
        parts = tensor.chunk(len(names[ours])) if len(names[ours]) > 1 else (tensor,)
        for hf_name, part in zip(names[ours], parts, strict=True):
            # fp32: bf16 copies of the master weights would lose precision for fine-tuning.
            hf_state_dict[hf_name] = part.detach().to("cpu", torch.float32).contiguous().clone()
    return hf_state_dict


def from_hf_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], config: BertConfig,
    names: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Hugging Face state dict -> ours (QKV fused, vocabulary rows padded with zeros), tied
    names filled in so `load_state_dict` is strict. `names`: the part of `hf_name_map` the
    state dict holds (default: all of it)."""
    renamed = canonical_names(hf_state_dict)
    # Buffers (position_ids) are not parameters; stored tied copies must really be copies.
    renamed.pop("bert.embeddings.position_ids", None)
    tied_copies = {name: renamed.pop(name) for name in _TIED_NAMES.values() if name in renamed}
    ours = rename_from_hf(renamed, names or hf_name_map(config.num_hidden_layers), config)
    for tied, source in _TIED_SOURCES.items():
        copy = tied_copies.get(_TIED_NAMES[tied])
        if source in ours and copy is not None and not torch.equal(
                copy, ours[source][: copy.shape[0]]):
            raise ValueError(f"{tied} differs from {source}: untied checkpoints are unsupported")
    for tied, source in _TIED_SOURCES.items():
        if source in ours:
            ours[tied] = ours[source]
    return ours


# The parts of BertForPreTraining another Hugging Face BERT may lack, by their names' prefix.
OPTIONAL_PARTS = {"pooler": "bert.pooler.", "masked-LM head": "cls.predictions.",
                  "next-sentence head": "cls.seq_relationship."}


def bert_tensors(hf_state_dict: Mapping[str, torch.Tensor],
                 parts: tuple[str, ...] = ("bert.",)) -> dict[str, torch.Tensor]:
    """Any Hugging Face BERT's tensors in canonical names, a BertModel's bare names under
    `bert.`, keeping those under `parts` (`bert.`: the encoder; `cls.` too: the pretraining
    heads); another head's own tensors (a classifier's) are left out."""
    tensors = canonical_names(hf_state_dict)
    if not any(name.startswith(("bert.", "cls.")) for name in tensors):
        tensors = {f"bert.{name}": tensor for name, tensor in tensors.items()}  # a BertModel
    return {name: tensor for name, tensor in tensors.items() if name.startswith(parts)}


def pretraining_state_from_any_hf(
    hf_state_dict: Mapping[str, torch.Tensor], config: BertConfig
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(ours, the OPTIONAL_PARTS it lacks) from any Hugging Face BERT's tensors: a
    BertForPreTraining's, a BertForMaskedLM's, or the encoder of another head's (a
    BertModel's bare names, a fine-tuned classifier's `bert.*`; its own head is no part of
    pretraining and is left out). What it lacks, the caller initialises afresh."""
    tensors = bert_tensors(hf_state_dict, ("bert.", "cls."))
    names = hf_name_map(config.num_hidden_layers)
    lacking = [part for part, prefix in OPTIONAL_PARTS.items()
               if not any(name.startswith(prefix) and name not in _TIED_NAMES.values()
                          for name in tensors)]
    prefixes = tuple(OPTIONAL_PARTS[part] for part in lacking)
    if prefixes:
        names = {ours: hf for ours, hf in names.items() if not ours.startswith(prefixes)}
    return from_hf_state_dict(tensors, config, names), lacking


def rename_from_hf(
    hf_state_dict: Mapping[str, torch.Tensor], names: Mapping[str, tuple[str, ...]],
    config: BertConfig,
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (canonical names) -> ours as `names` maps them: QKV fused,
    vocabulary rows padded with zeros; exactly the Hugging Face names of `names` must be there."""
    _check_names(set(hf_state_dict), {hf for parts in names.values() for hf in parts},
                 "Hugging Face state dict")
    ours = {name: torch.cat([hf_state_dict[hf] for hf in parts]) if len(parts) > 1
            else hf_state_dict[parts[0]] for name, parts in names.items()}
    for name in _VOCAB_ROWS:
        if name in ours:
            ours[name] = _pad_vocab_rows(ours[name], config, name)
    return ours


def _pad_vocab_rows(tensor: torch.Tensor, config: BertConfig, name: str) -> torch.Tensor:
    """[vocab_size, ...] -> [padded_vocab_size, ...], zero rows appended (none need init)."""
    if tensor.shape[0] != config.vocab_size:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, the config's vocab_size is "
                         f"{config.vocab_size}")
    extra = config.padded_vocab_size - config.vocab_size
    return F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, extra))


def canonical_names(hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wrapper prefixes stripped and legacy gamma/beta renamed, nothing else touched."""
    return {
        _legacy_to_current(strip_wrapper_prefixes(name)): tensor
        for name, tensor in hf_state_dict.items()
    }


def _legacy_to_current(name: str) -> str:
    for old, new in _LEGACY_SUFFIXES.items():
        if "LayerNorm" in name and name.endswith(old):
            return name[: -len(old)] + new
    return name


def hf_config_dict(config: BertConfig) -> dict:
    """config.json for `transformers.BertConfig`: every field it reads, ours first."""
    return {
        "architectures": ["BertForPreTraining"],
        "model_type": "bert",
        **config.to_dict(),
        "hidden_act": "gelu",
        # Older transformers read these; 5.x ignores position_embedding_type.
        "position_embedding_type": "absolute",
        "classifier_dropout": None,
        "is_decoder": False,
        "add_cross_attention": False,
        "use_cache": True,
        "tie_word_embeddings": True,
        "dtype": "float32",
    }


def config_from_hf_dict(values: Mapping) -> BertConfig:
    """Our config from a Hugging Face config.json; refuses what our architecture cannot load."""
    if values.get("model_type", "bert") != "bert":
        raise ValueError(f"not a BERT config: model_type {values.get('model_type')!r}")
    for name, supported in (
        ("hidden_act", "gelu"),
        ("position_embedding_type", "absolute"),
        ("is_decoder", False),
        ("add_cross_attention", False),
    ):
        if values.get(name, supported) != supported:
            raise ValueError(f"{name}={values[name]!r} is not supported (only {supported!r})")
    if values.get("tie_word_embeddings", True) is not True:
        raise ValueError("untied MLM decoder weights are not supported")
    defaults = BertConfig().to_dict()
    return BertConfig(**{name: values.get(name, default) for name, default in defaults.items()})


def build_hf_tokenizer_json(vocab_path: str, lower_case: bool) -> str:
    """tokenizer.json of a BertTokenizerFast: our WordPiece set-up plus [CLS]/[SEP] templates."""
    tokenizer = load_tokenizer(vocab_path, lower_case)
    # As BertTokenizerFast registers them: matched before normalisation, never split.
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer.to_str(pretty=True)


def _special_tokens_map() -> dict[str, str]:
    return {
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }


def _tokenizer_config(lower_case: bool, model_max_length: int) -> dict:
    return {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": lower_case,
        "tokenize_chinese_chars": True,
        # None = follow do_lower_case, the same rule pipelines.contract.tokenization applies.
        "strip_accents": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": True,
        **_special_tokens_map(),
    }


def tokenizer_setting(hf_dir: str, key: str) -> Any:
    """One value of a Hugging Face directory's tokenizer_config.json; None when it has no such
    file, key, or readable JSON."""
    try:
        with open(os.path.join(hf_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None


class TokenizerFile:
    """A Hugging Face directory's tokenizer.json, read and parsed at most once: a model's load
    asks it for the vocabulary, the casing, whether vocab.txt agrees and the added tokens, and
    each of those read and parsed the whole file again (bert-base-uncased's is 700 KB of
    JSON). Give one to every function of one load; each makes its own without."""

    def __init__(self, hf_dir: str) -> None:
        self.path = os.path.join(hf_dir, HF_TOKENIZER_NAME)

    @functools.cached_property
    def raw(self) -> bytes | None:
        """The file's bytes; None when there is none (or it cannot be read)."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError:
            return None

    @functools.cached_property
    def parsed(self) -> Any:
        """The file's JSON; None without a file. A ValueError when it is not JSON (not cached:
        every caller that asks is told)."""
        return None if self.raw is None else json.loads(self.raw)

    def parsed_or_none(self) -> Any:
        """The file's JSON, or None where there is none or it is not JSON."""
        try:
            return self.parsed
        except ValueError:
            return None


def hf_lower_case(hf_dir: str, tokenizer_file: TokenizerFile | None = None) -> bool | None:
    """Whether a Hugging Face directory's tokenizer lower-cases: its tokenizer_config.json's
    do_lower_case, else its tokenizer.json's normalizer (a tokenizer saved as a generic
    `PreTrainedTokenizerFast` records no do_lower_case, and a cased one read as BERT's default,
    uncased, was fine-tuned on other ids than its own tokenizer gives); None when neither
    file says."""
    value = tokenizer_setting(hf_dir, "do_lower_case")
    if isinstance(value, bool):
        return value
    tokenizer = (tokenizer_file or TokenizerFile(hf_dir)).parsed_or_none()
    return _lower_cases(tokenizer.get("normalizer")) if isinstance(tokenizer, dict) else None


def _lower_cases(normalizer: Any) -> bool:
    """A tokenizers normalizer lower-cases: BertNormalizer's `lowercase`, a Lowercase step,
    alone or in a Sequence (null, or any other step: the text keeps its case)."""
    if not isinstance(normalizer, dict):
        return False
    kind = normalizer.get("type")
    if kind == "BertNormalizer":
        return bool(normalizer.get("lowercase", True))  # the library's default
    if kind == "Sequence":
        return any(_lower_cases(step) for step in normalizer.get("normalizers") or ())
    return kind == "Lowercase"


def hf_positions_trained(hf_dir: str, config: BertConfig) -> int:
    """A Hugging Face directory's trained positions: its tokenizer's model_max_length where
    that is below max_position_embeddings (a bertforge export says so, `_tokenizer_config`),
    else all of them (Google's and Hugging Face's releases trained every position)."""
    length = tokenizer_setting(hf_dir, "model_max_length")
    if isinstance(length, int) and 0 < length < config.max_position_embeddings:
        return length
    return config.max_position_embeddings


def _write_json(path: str, values: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=2, sort_keys=False)
        f.write("\n")


def _write_hf_files(
    directory: str,
    hf_state_dict: dict[str, torch.Tensor],
    config_dict: dict,
    vocab_path: str,
    lower_case: bool,
    model_max_length: int,
) -> None:
    _write_json(os.path.join(directory, HF_CONFIG_NAME), config_dict)
    # transformers refuses a safetensors file whose metadata lacks format=pt.
    weights_path = os.path.join(directory, "model.safetensors")
    save_file(hf_state_dict, weights_path, {"format": "pt"})
    os.chmod(weights_path, 0o644)
    shutil.copyfile(vocab_path, os.path.join(directory, "vocab.txt"))
    tokenizer_config = _tokenizer_config(lower_case, model_max_length)
    _write_json(os.path.join(directory, "tokenizer_config.json"), tokenizer_config)
    _write_json(os.path.join(directory, "special_tokens_map.json"), _special_tokens_map())
    with open(os.path.join(directory, HF_TOKENIZER_NAME), "w", encoding="utf-8") as f:
        f.write(build_hf_tokenizer_json(vocab_path, lower_case))


def export_hf_directory(
    state_dict: Mapping[str, torch.Tensor],
    config: BertConfig,
    vocab_path: str,
    lower_case: bool,
    output_dir: str,
    *,
    overwrite: bool = False,
) -> str:
    """Write a Hugging Face `BertForPreTraining` + tokenizer directory; returns its path."""
    return write_hf_directory(
        to_hf_state_dict(state_dict, config), hf_config_dict(config), config,
        vocab_path, lower_case, output_dir, overwrite=overwrite,
    )


def write_hf_directory(
    hf_state_dict: dict[str, torch.Tensor],
    config_dict: dict,
    config: BertConfig,
    vocab_path: str,
    lower_case: bool,
    output_dir: str,
    *,
    overwrite: bool = False,
    model_max_length: int | None = None,
) -> str:
    """A Hugging Face model + tokenizer directory: `config_dict` as config.json and
    `hf_state_dict` (Hugging Face's names) as model.safetensors; returns its path.
    `model_max_length`: the tokenizer's, where fewer positions than max_position_embeddings
    were trained (a model pretrained at 128 tokens only).

    Files go to a sibling temp directory renamed into place at the end, so a crash leaves
    either no `output_dir` or a complete one (with `overwrite`, the old one until the swap).
    """
    num_vocab = len(read_vocab(vocab_path, allow_repeats=True))
    # A model vocab may be padded past the file (e.g. to a multiple of 8), never shorter.
    if num_vocab > config.vocab_size:
        raise ValueError(f"{vocab_path} has {num_vocab} tokens > vocab_size {config.vocab_size}")
    output_dir = os.path.abspath(output_dir)
    if os.path.exists(output_dir) and not overwrite and not is_empty_directory(output_dir):
        raise FileExistsError(f"{output_dir} exists; pass overwrite=True to replace it")
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.", dir=parent)
    try:
        # mkdtemp makes it 0700 and safetensors writes 0600: a model directory is for sharing.
        os.chmod(staging, 0o755)
        _write_hf_files(staging, hf_state_dict, config_dict, vocab_path, lower_case,
                        model_max_length or config.max_position_embeddings)
        _replace_directory(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def is_empty_directory(path: str) -> bool:
    """A directory with nothing in it (one made beforehand for an export is no export)."""
    return os.path.isdir(path) and not os.listdir(path)


def _replace_directory(staging: str, output_dir: str) -> None:
    """Rename staging to output_dir; an existing output_dir is moved aside first, then removed."""
    if not os.path.exists(output_dir):
        os.replace(staging, output_dir)
        return
    retired = staging + ".old"
    os.replace(output_dir, retired)
    os.replace(staging, output_dir)
    shutil.rmtree(retired, ignore_errors=True)


def hf_weights_file(hf_dir: str) -> str | None:
    """A Hugging Face directory's weights file: model.safetensors, else a sharded save's index,
    else pytorch_model.bin (or its index); None when it has none of them."""
    for name in HF_WEIGHTS_NAMES:
        path = os.path.join(hf_dir, name)
        if os.path.exists(path):
            return path
    return None


def hf_weights_sha256(hf_dir: str) -> str | None:
    """The SHA-256 of the weights a Hugging Face directory holds (`hf_weights_file`'s; of a
    sharded save, one of its index's and every shard's, in `_shard_files`' order), each file
    read in chunks: BERT-large's is 1.3 GB. None where it has no weights file."""
    path = hf_weights_file(hf_dir)
    if path is None:
        return None
    files = [path, *(_shard_files(path) if path.endswith(".index.json") else [])]
    # One file's is its sha256sum; a sharded save's, one digest of its files' in order.
    digests = [sha256_file(name) for name in files]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256(" ".join(digests).encode("ascii")).hexdigest()


def load_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face directory (`hf_weights_file`'s, every shard of an index)."""
    path = hf_weights_file(hf_dir)
    if path is None:
        raise ValueError(f"{hf_dir} has none of {list(HF_WEIGHTS_NAMES)}")
    if not path.endswith(".index.json"):
        return _load_weights_file(path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shard_files(path):
        tensors.update(_load_weights_file(shard))
    return tensors


def _load_weights_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        return load_file(path, device="cpu")
    # weights_only: a pickle from the internet must not run code.
    return torch.load(path, map_location="cpu", weights_only=True)


def _shard_files(index_path: str) -> list[str]:
    """The shard files a sharded save's index names (its weight_map's values), in order, each
    there: a shard missing is named, not a missing-tensor list."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index_path} is not a sharded save's index ({error})") from None
    folder = os.path.dirname(index_path)
    paths = [os.path.join(folder, os.path.basename(str(name))) for name in names]
    missing = [os.path.basename(path) for path in paths if not os.path.isfile(path)]
    if missing:
        raise ValueError(f"{index_path} names shard(s) the directory lacks: {', '.join(missing)}")
    return paths


def hf_vocab_file(hf_dir: str, tokenizer_file: TokenizerFile | None = None) -> str | None:
    """A Hugging Face directory's WordPiece vocabulary as a vocab.txt path: its own, or, where
    it has only a tokenizer.json (what transformers 5 saves), one written from that file's
    WordPiece vocabulary into the temporary directory, named by the file's sha256 (every
    process that reads the model, a worker on another node too, writes the same bytes). None
    when it has neither; a tokenizer.json of another model (BPE, Unigram) is a ValueError."""
    own = os.path.join(hf_dir, "vocab.txt")
    if os.path.exists(own):
        return own
    tokenizer_file = tokenizer_file or TokenizerFile(hf_dir)
    path, raw = tokenizer_file.path, tokenizer_file.raw
    if raw is None:
        return None
    folder = os.path.join(tempfile.gettempdir(), "bertforge-vocab",
                          hashlib.sha256(raw).hexdigest()[:16])
    written = os.path.join(folder, "vocab.txt")
    if os.path.exists(written):  # these bytes were read and checked before (the driver's)
        return written
    try:
        model = tokenizer_file.parsed["model"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is no tokenizers file ({error})") from None
    if model.get("type") != "WordPiece":
        raise ValueError(f"{path} holds a {model.get('type')} tokenizer, not BERT's WordPiece")
    ids = sorted(model["vocab"].items(), key=lambda item: item[1])
    if [index for _, index in ids] != list(range(len(ids))):
        raise ValueError(f"{path}: its WordPiece ids are not 0..{len(ids) - 1}")
    text = "".join(f"{token}\n" for token, _ in ids).encode("utf-8")
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
        f.write(text)
    os.replace(f.name, written)  # whole or absent, whoever writes it
    return written


def vocab_files_disagree(hf_dir: str, tokenizer_file: TokenizerFile | None = None) -> str | None:
    """Where a Hugging Face directory has both a vocab.txt and a WordPiece tokenizer.json that
    hold different vocabularies (vocab.txt edited, its [unusedN] lines made words, and
    tokenizer.json left as it was), the first id they differ at, said; else None. transformers'
    fast tokenizer (AutoTokenizer's default) reads tokenizer.json, fine-tuning here vocab.txt:
    the two gave one text other ids, silently."""
    if not os.path.exists(os.path.join(hf_dir, "vocab.txt")):
        return None  # nothing to compare
    try:
        tokenizer = (tokenizer_file or TokenizerFile(hf_dir)).parsed
        model = tokenizer["model"]
        # Its added tokens are its too: written into vocab.txt at their ids, they agree.
        fast = {**model["vocab"], **{entry["content"]: entry["id"]
                                     for entry in tokenizer.get("added_tokens") or ()}}
        if model.get("type") != "WordPiece":
            return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # no tokenizer.json, or none to compare: hf_vocab_file says what is wrong
    slow = read_vocab(os.path.join(hf_dir, "vocab.txt"), allow_repeats=True)
    if slow == fast:
        return None
    by_id = [{index: token for token, index in vocab.items()} for vocab in (slow, fast)]
    index = min(i for i in set(by_id[0]) | set(by_id[1]) if by_id[0].get(i) != by_id[1].get(i))
    return (f"id {index} is {by_id[0].get(index)!r} in vocab.txt but {by_id[1].get(index)!r} "
            f"in {HF_TOKENIZER_NAME}")


def hf_added_tokens(hf_dir: str, tokenizer_file: TokenizerFile | None = None) -> dict[str, int]:
    """{token: id} a Hugging Face directory's tokenizer adds on top of its WordPiece vocabulary
    (`tokenizer.add_tokens`, `add_special_tokens`): tokenizer.json's added_tokens and an older
    transformers' added_tokens.json; {} where neither file is there or readable."""
    added: dict[str, int] = {}
    tokenizer = (tokenizer_file or TokenizerFile(hf_dir)).parsed_or_none()
    if isinstance(tokenizer, dict):
        entries = tokenizer.get("added_tokens") or ()
        added.update({entry["content"]: entry["id"] for entry in entries
                      if isinstance(entry, dict) and {"content", "id"} <= entry.keys()})
    try:
        with open(os.path.join(hf_dir, "added_tokens.json"), encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError):
        return added
    if isinstance(values, dict):
        added.update(values)
    return added


def tokens_beyond_vocab(hf_dir: str, vocab_path: str, lower_case: bool,
                        tokenizer_file: TokenizerFile | None = None) -> list[str]:
    """The added tokens of `hf_dir`'s tokenizer that BERT's tokenizer of `vocab_path` alone
    (with its special tokens, as fine-tuning tokenizes) does not read as their ids, in id
    order: it splits them into pieces (`covid19` into `co`, `##vid`, `##19`; `[E1]` into
    `[`, `e1`, `]`) where the model's own tokenizer gives their trained ids."""
    tokenizer = load_tokenizer(vocab_path, lower_case)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    added = sorted((index, token)
                   for token, index in hf_added_tokens(hf_dir, tokenizer_file).items()
                   if isinstance(index, int) and isinstance(token, str))
    return [token for index, token in added
            if tokenizer.encode(token, add_special_tokens=False).ids != [index]]


def read_hf_config(hf_dir: str) -> BertConfig:
    """The BertConfig of a Hugging Face directory's config.json."""
    config_path = os.path.join(hf_dir, HF_CONFIG_NAME)
    if not os.path.exists(config_path):
        raise ValueError(f"{hf_dir} has no {HF_CONFIG_NAME}")
    with open(config_path, encoding="utf-8") as f:
        return config_from_hf_dict(json.load(f))
