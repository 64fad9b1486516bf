"""What ``python -m shardc plan`` plans: a model named on the command line, built on meta.

Three kinds of names (:func:`parse_model`):

- a built-in preset, ``llama-8b`` (``PRESETS``), or ``llama``, with ``LlamaConfig`` overrides as
  ``llama-8b:n_layers=4,dim=1024`` or as separate ``key=value`` words;
- ``hf:<model type or config class>`` (``hf:llama``, ``hf:Qwen2Config``, ``hf:mixtral``) with
  config overrides as ``key=value`` words: the locally installed transformers builds the config
  (``AutoConfig.for_model`` or the class) and ``AutoModelForCausalLM.from_config``; nothing is
  downloaded;
- ``package.module:factory``: a callable returning an ``nn.Module``, called with the ``key=value``
  words as keyword arguments while the default device is ``meta``. Its ``forward(tokens)`` takes
  a ``(batch, seq)`` tensor of token ids and returns logits ``(batch, seq, vocab)`` (the step's
  loss is their cross-entropy against the targets) or a scalar loss.

Each gives a :class:`ModelSpec`: how to build the model, the step whose loss is differentiated,
and where its repeated blocks are (for the per-block template).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardc.models.llama import LlamaConfig, Transformer, llama_loss

PRESETS: dict[str, dict] = {
    "llama-tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=256),
    "llama-1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, max_seq_len=2048),
    "llama-wide": dict(vocab_size=32000, dim=4096, n_layers=8, n_heads=32, max_seq_len=2048),
    "llama-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                     ffn_dim=14336, max_seq_len=8192),
    "llama-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                      ffn_dim=28672, max_seq_len=8192),
}
DEFAULT_SEQ = 2048  # sequence length of models that name none (hf:, module:factory)


class ModelSpecError(ValueError):
    """A model name or override the planner cannot use; the message says what to do."""


@dataclass
class ModelSpec:
    """A model to plan. ``build()`` returns it on the meta device (unsharded, fp32);
    ``loss(model, tokens, targets)`` is one training step's loss on a batch of input token ids
    and their targets, two tensors as a data loader gives them (one tensor traced as both
    would be one graph input where training has two: a different plan); ``container`` names its
    ``nn.ModuleList`` of identical blocks (``None``: trace it whole); ``default_seq`` is the
    sequence length planned unless one is given."""

    name: str
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    container: str | None = "layers"
    default_seq: int = DEFAULT_SEQ
    checkpoint_blocks: Callable[[nn.Module], None] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # ``parallelize(model, tp_mesh)``: tensor-parallelize the blocks in place (``None``: the
    # planner cannot plan this model with TP).
    parallelize: Callable[[nn.Module, Any], None] | None = None
    # The longest sequence the model's config allows (``None``: not known), the config field
    # that says it, whether the user set that field, and ``with_max_seq(n)``: the same model
    # allowing ``n`` (:func:`fit_seq`).
    max_seq: int | None = None
    max_seq_field: str | None = None
    max_seq_set: bool = False
    with_max_seq: Callable[[int], ModelSpec] | None = None


def fit_seq(spec: ModelSpec, seq: int) -> tuple[ModelSpec, str | None]:
    """``spec`` able to plan sequences of ``seq`` tokens, and a note when it had to change.

    A config whose longest sequence (``max_seq_len``, ``max_position_embeddings``) is below
    ``seq`` is raised to ``seq`` when the user did not set the field (a preset's or the config's
    default), with a note saying so; when the user set it, :class:`ModelSpecError` names the
    field and the fix. (Below ``seq`` the trace fails deep in Dynamo: shardc's Llama slices
    ``seq`` rows from rope tables of ``max_seq_len`` rows.)"""
    if spec.max_seq is None or seq <= spec.max_seq:
        return spec, None
    field_name = spec.max_seq_field or "the maximum sequence length"
    if spec.max_seq_set or spec.with_max_seq is None:
        raise ModelSpecError(
            f"--seq {seq} is longer than the model's {field_name}={spec.max_seq}: set "
            f"{field_name}={seq} (or more), or plan a --seq of at most {spec.max_seq}")
    return spec.with_max_seq(seq), (
        f"{field_name} raised from {spec.max_seq} to {seq} to plan --seq {seq} (set "
        f"{field_name} to choose it)")


def parse_value(raw: str) -> Any:
    """``key=value`` values: Python literals (numbers, ``True``/``true``, ``None``, lists,
    quoted strings), anything else as a string."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def parse_overrides(words: Sequence[str], what: str) -> dict[str, Any]:
    """``["a=1", "b=x"]`` (commas also separate pairs) -> ``{"a": 1, "b": "x"}``."""
    out: dict[str, Any] = {}
    for word in words:
        for item in filter(None, word.split(",")):
            key, eq, raw = item.partition("=")
            if not eq or not key.strip():
                raise ModelSpecError(
                    f"bad override {item!r} for {what}: write overrides as key=value "
                    "(e.g. num_hidden_layers=4)")
            out[key.strip()] = parse_value(raw.strip())
    return out


def parse_model(spec: str, overrides: Sequence[str] = ()) -> ModelSpec:
    """The :class:`ModelSpec` named by ``spec`` (see the module docstring), with ``overrides``
    (``key=value`` words)."""
    if spec.startswith("hf:"):
        return hf_model(spec[3:], parse_overrides(overrides, spec))
    name, sep, inline = spec.partition(":")
    if name == "llama" or name in PRESETS:
        words = [inline, *overrides]
        return llama_model(llama_config(name, words),
                           max_seq_set="max_seq_len" in parse_overrides(words, name))
    if sep and inline and "=" not in inline:
        return factory_model(spec, parse_overrides(overrides, spec))
    raise ModelSpecError(
        f"unknown model {spec!r}: use a preset ({', '.join(PRESETS)}), 'llama:key=value,...', "
        "'hf:<model type or config class>' (e.g. hf:llama, hf:Qwen2Config) or "
        "'package.module:factory'")


# ---------------------------------------------------------------------------------- llama


def llama_config(name: str, overrides: Sequence[str]) -> LlamaConfig:
    values = dict(PRESETS.get(name, {}))
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    for key, value in parse_overrides(overrides, name).items():
        if key not in fields:
            raise ModelSpecError(
                f"unknown LlamaConfig field {key!r}; fields: {', '.join(sorted(fields))}")
        values[key] = value
    return LlamaConfig(**values)


def parse_model_spec(spec: str) -> LlamaConfig:
    """``<preset>[:key=value,...]`` or ``llama:key=value,...`` -> LlamaConfig (SystemExit on
    a bad name, as the command line reports it)."""
    name, _, overrides = spec.partition(":")
    if name != "llama" and name not in PRESETS:
        raise SystemExit(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or 'llama:...')")
    try:
        return llama_config(name, [overrides])
    except ModelSpecError as exc:
        raise SystemExit(str(exc)) from None


class CheckpointedBlock(nn.Module):
    """A block whose activations are recomputed in the backward (``torch.utils.checkpoint``,
    non-reentrant): only its inputs are saved."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_container(container: str) -> Callable[[nn.Module], None]:
    """Wrap every block of ``model.<container>`` in :class:`CheckpointedBlock`."""

    def wrap(model: nn.Module) -> None:
        layers = model.get_submodule(container)
        for i, block in enumerate(layers):
            layers[i] = CheckpointedBlock(block)

    return wrap


def llama_model(cfg: LlamaConfig, *, max_seq_set: bool = False) -> ModelSpec:
    """``max_seq_set``: the user chose ``cfg.max_seq_len`` (:func:`fit_seq` will not raise it)."""

    def build() -> nn.Module:
        with torch.device("meta"):
            return Transformer(cfg)

    return ModelSpec(name=f"llama {cfg.num_params() / 1e9:.2f}B", build=build,
                     loss=lambda model, tokens, targets: llama_loss(model(tokens), targets),
                     default_seq=cfg.max_seq_len, checkpoint_blocks=checkpoint_container("layers"),
                     details={"config": dataclasses.asdict(cfg)}, parallelize=parallelize_llama,
                     max_seq=cfg.max_seq_len, max_seq_field="max_seq_len", max_seq_set=max_seq_set,
                     with_max_seq=lambda n: llama_model(dataclasses.replace(cfg, max_seq_len=n)))


def parallelize_llama(model: nn.Module, tp_mesh) -> None:
    """Megatron-style tensor parallelism of shardc's Llama blocks over ``tp_mesh``: the
    attention's q/k/v and the MLP's w1/w3 split by output (colwise), ``wo`` and ``w2`` by input
    (rowwise); each block's attention is told its local head counts."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    for i, block in enumerate(model.layers):
        attn = block.attention
        if attn.n_heads % tp or attn.kv_heads % tp:
            raise ModelSpecError(f"--tp {tp}: layer {i} has {attn.n_heads} heads and "
                                 f"{attn.kv_heads} key/value heads; both must divide by --tp")
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
        attn.n_heads //= tp
        attn.kv_heads //= tp


# --------------------------------------------------------------------------- Hugging Face


def hf_config(name: str, overrides: dict[str, Any]):
    """A transformers config from its model type (``llama``) or class name (``Qwen2Config``),
    with ``overrides`` checked against the config's own attributes."""
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("hf: models need transformers: pip install transformers") from None
    if name.endswith("Config"):
        cls = getattr(transformers, name, None)
        if not isinstance(cls, type):
            raise ModelSpecError(
                f"unknown config class {name!r} in transformers {transformers.__version__}; "
                "name a class such as LlamaConfig or Qwen2Config, or a model type such as "
                "hf:llama")
        base = cls()
    else:
        try:
            base = transformers.AutoConfig.for_model(name)
        except ValueError:
            raise ModelSpecError(
                f"unknown model type {name!r} in transformers {transformers.__version__}; "
                "name a model type such as hf:llama, hf:qwen2, hf:mixtral, or a config class "
                "such as hf:LlamaConfig") from None
    known = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ModelSpecError(
            f"unknown {type(base).__name__} field(s) {unknown}; fields include "
            f"{', '.join(sorted(k for k in base.to_dict() if not k.startswith('_'))[:40])}")
    return type(base)(**overrides)


def hf_model(name: str, overrides: dict[str, Any]) -> ModelSpec:
    config = hf_config(name, overrides)
    config._attn_implementation = "sdpa"
    model_type = config.model_type

    def build() -> nn.Module:
        import transformers

        try:
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as exc:
            raise ModelSpecError(
                f"transformers has no causal language model for {model_type!r}: {exc}") from None

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # transformers shifts the labels itself: ``targets`` stands for a collator's copy of the
        # input ids (a tensor of its own, as in training)
        return model(input_ids=tokens, labels=targets, use_cache=False).loss

    def checkpoint(model: nn.Module) -> None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    max_seq = getattr(config, "max_position_embeddings", None) or None
    seq = min(max_seq or DEFAULT_SEQ, DEFAULT_SEQ)
    # Set by the user under its own name or the config's (gpt2's n_positions).
    aliases = {"max_position_embeddings",
               getattr(config, "attribute_map", {}).get("max_position_embeddings")}
    return ModelSpec(name=f"hf:{type(config).__name__}", build=build, loss=loss,
                     container="model.layers", default_seq=seq, checkpoint_blocks=checkpoint,
                     details={"config": config.to_diff_dict()},
                     max_seq=max_seq, max_seq_field="max_position_embeddings",
                     max_seq_set=bool(aliases & set(overrides)),
                     with_max_seq=lambda n: hf_model(
                         name, {**overrides, "max_position_embeddings": n}))


# ------------------------------------------------------------------------- module:factory


def factory_model(spec: str, kwargs: dict[str, Any]) -> ModelSpec:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSpecError(
            f"cannot import {module_name!r} for {spec!r}: {exc}; put its directory on "
            "PYTHONPATH or run from it") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSpecError(f"{module_name} has no callable {attr!r} (from {spec!r})")

    def build() -> nn.Module:
        with torch.device("meta"):
            model = factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"{spec}() returned {type(model).__name__}, not an nn.Module")
        return model

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = model(tokens)
        out = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
        if not isinstance(out, torch.Tensor):
            raise ModelSpecError(f"{spec}: forward(tokens) must return logits or a loss tensor")
        if out.dim() == 0:
            return out
        return F.cross_entropy(out.flatten(0, -2).float(), targets.flatten())

    return ModelSpec(name=spec, build=build, loss=loss, container="layers",
                     checkpoint_blocks=checkpoint_container("layers"),
                     details={"factory": spec, "kwargs": kwargs})
