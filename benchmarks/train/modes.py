"""The benchmark's modes by name: which setup builds each, and the config each runs under.

Contract: :func:`setup_mode` builds the model and the :class:`setup.Setup` of a mode on ``mesh``;
:func:`mode_context` is entered around the whole mode (compiles happen inside it, lazily).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Sequence

import bench_mesh
import torch
from torch import nn

import shardc
from shardc.models.llama import LlamaConfig, llama_loss
from train.baselines import CheckpointedBlock, setup_bound, setup_fsdp2
from train.setup import Setup
from train.shardc_mode import FP8_POLICY_TEXT, setup_shardc
from train.simplefsdp import setup_simplefsdp
from train.workload import build_model

MODES: tuple[str, ...] = ("fsdp2", "fsdp2-compile", "simplefsdp", "shardc", "bound")


# Diagnostic variants, run only when named in --modes.
EXTRA_MODES: tuple[str, ...] = ("shardc-keeporder", "shardc-pool", "shardc-localopt",
                                  "shardc-dtensoropt", "shardc-dtensorin",
                                  "shardc-cudagraphs", "shardc-budget", "shardc-noreshard",
                                  "shardc-inline", "shardc-plain", "shardc-plain-budget",
                                  "shardc-plain-pool", "shardc-oneop", "shardc-packed",
                                  "shardc-packed-plain", "shardc-sink", "shardc-packed-sink",
                                  "shardc-nosink", "shardc-unpacked",
                                  "shardc-combo", "shardc-ac", "shardc-fast",
                                  "shardc-fast-budget", "shardc-fast-budget-inline",
                                  "shardc-fast-budget-sink", "shardc-fast-sink",
                                  "shardc-fast-sink-pcasts", "shardc-rswait", "shardc-fast-rswait",
                                  "shardc-offload", "shardc-offload-budget",
                                  "bound-cudagraphs")


SHARDED_BASELINES: tuple[str, ...] = ("fsdp2", "fsdp2-compile", "simplefsdp")


# FSDP2's memory-saving configurations (issue 22's comparison at equal memory), run only when
# named: full activation checkpointing per block, selective checkpointing (matmul outputs
# saved), CPU offload, and torch's activation_memory_budget ratio r as "fsdp2-compile-amb<r>"
# (0 < r <= 1, e.g. fsdp2-compile-amb0.5).
MEMORY_BASELINES: tuple[str, ...] = ("fsdp2-compile-ac", "fsdp2-compile-sac",
                                     "fsdp2-compile-offload")
AMB_PREFIX = "fsdp2-compile-amb"
# The comparison set budget_sweep.py --baselines runs by default: FSDP2 alone (compiled blocks)
# and with each way of saving memory.
CURVE_BASELINES: tuple[str, ...] = ("fsdp2-compile", "fsdp2-compile-ac", "fsdp2-compile-sac",
                                    f"{AMB_PREFIX}0.5", "fsdp2-compile-offload")


# Any FSDP2 mode with this suffix also compiles its loss (``torch.compile`` of the loss function
# over the model's logits, apart from the blocks: torchtitan's ``compile.components = ["model",
# "loss"]``); without it FSDP2's loss runs eagerly after the model, as it always did here.
COMPILED_LOSS_SUFFIX = "-closs"


def split_compiled_loss(mode: str) -> tuple[str, bool]:
    """(the mode without :data:`COMPILED_LOSS_SUFFIX`, whether it had it); the suffix is for
    FSDP2 modes only."""
    if not mode.endswith(COMPILED_LOSS_SUFFIX):
        return mode, False
    base = mode[: -len(COMPILED_LOSS_SUFFIX)]
    if not base.startswith("fsdp2"):
        raise ValueError(f"mode {mode!r}: {COMPILED_LOSS_SUFFIX} (a compiled loss) applies to "
                         "the FSDP2 modes only (shardc and the bound compile the loss with "
                         "the model already)")
    return base, True


def amb_ratio(mode: str) -> float | None:
    """The ``activation_memory_budget`` ratio of an ``fsdp2-compile-amb<r>`` mode (None for
    other modes); a ratio outside (0, 1] is an error."""
    if not mode.startswith(AMB_PREFIX):
        return None
    text = mode[len(AMB_PREFIX):]
    try:
        ratio = float(text)
    except ValueError:
        ratio = -1.0
    if not 0 < ratio <= 1:
        raise ValueError(f"mode {mode!r}: {AMB_PREFIX}<r> needs a ratio 0 < r <= 1 "
                         f"(e.g. {AMB_PREFIX}0.5), got {text!r}")
    return ratio


def mode_name(text: str) -> str:
    """``text`` if it names a mode (argparse ``type``); otherwise an error listing them."""
    base, _ = split_compiled_loss(text)
    if base != text:
        mode_name(base)
        return text
    if text in MODES or text in EXTRA_MODES or text in MEMORY_BASELINES:
        return text
    if text.startswith(AMB_PREFIX):
        amb_ratio(text)
        return text
    raise ValueError(f"unknown mode {text!r}; modes: {', '.join(MODES + EXTRA_MODES)}, "
                     f"{', '.join(MEMORY_BASELINES)}, {AMB_PREFIX}<r>; an FSDP2 mode with "
                     f"{COMPILED_LOSS_SUFFIX} also compiles its loss")


def takes_fp8(mode: str) -> bool:
    """Whether ``mode`` can shard with FP8 weights (``--fp8``): the shardc modes only (FSDP2,
    its memory baselines, SimpleFSDP and the bound have no FP8 path here)."""
    return mode.startswith("shardc")


def check_fp8(modes: list[str] | tuple[str, ...]) -> None:
    """Refuse ``--fp8`` with a mode that cannot take it (a ValueError naming the modes), rather
    than run it in bf16."""
    refused = [m for m in modes if not takes_fp8(m)]
    if refused:
        raise ValueError(f"--fp8 ({FP8_POLICY_TEXT}) applies to the shardc modes only; "
                         f"refused: {', '.join(refused)} (no FP8 path; run it without --fp8, "
                         "in a run of its own)")


def modes_for_fp8(modes: list[str] | None, defaults: Sequence[str], fp8: bool) -> list[str]:
    """The modes a script runs: ``modes`` as given, else ``defaults`` (with ``fp8``, their
    shardc ones); with ``fp8`` every mode must take it (:func:`check_fp8`'s ValueError)."""
    if modes is None:
        modes = [m for m in defaults if takes_fp8(m)] if fp8 else list(defaults)
    if fp8:
        check_fp8(modes)
    return modes


def mode_context(mode: str) -> contextlib.AbstractContextManager:
    """Config a mode runs under (compiles happen lazily, in the first forward and backward).

    ``shardc-keeporder``: shardc with Inductor's ``reorder_for_peak_memory`` off. With it on (the
    default), Inductor's scheduler moves each of shardc's all-gathers (and reduce-scatters) right
    next to its wait, undoing the plan's prefetch; this variant measures the plan as planned.

    ``shardc-combo``: shardc with Inductor's ``combo_kernels`` on (independent small kernels,
    such as the per-parameter casts into a bucket's all-gather input, launched as one; issue
    20's host cost per kernel launch). Private Inductor config, set by this benchmark only.

    ``fsdp2-compile-amb<r>``: torch's partitioner option ``activation_memory_budget = r`` (the
    ratio of the saved activations' bytes the min-cut partitioner may keep; it recomputes the
    cheapest rest) around the blocks' compiles. It is private torch config
    (``torch._functorch.config``), set directly by this benchmark (shardc itself never sets it).
    """
    if mode == "shardc-keeporder":
        return torch._inductor.config.patch(reorder_for_peak_memory=False)
    if mode == "shardc-combo":
        return torch._inductor.config.patch(combo_kernels=True)
    ratio = amb_ratio(split_compiled_loss(mode)[0])
    if ratio is not None:
        return torch._functorch.config.patch(activation_memory_budget=ratio)
    return contextlib.nullcontext()


def setup_mode_fsdp2(mode: str, model: nn.Module, mesh) -> Setup:
    """An FSDP2 mode (``fsdp2``, ``fsdp2-compile``, :data:`MEMORY_BASELINES`,
    ``fsdp2-compile-amb<r>``) on the (tensor-parallel where asked) ``model``."""
    dp = bench_mesh.dp_mesh(mesh)
    if mode == "fsdp2":
        return setup_fsdp2(model, dp, compile_blocks=False)
    if mode == "fsdp2-compile":
        return setup_fsdp2(model, dp, compile_blocks=True)
    if mode in MEMORY_BASELINES:
        checkpoint = {"fsdp2-compile-ac": "full", "fsdp2-compile-sac": "selective"}.get(mode)
        return setup_fsdp2(model, dp, compile_blocks=True, activation_checkpoint=checkpoint,
                           offload=mode == "fsdp2-compile-offload")
    ratio = amb_ratio(mode)
    if ratio is None:
        raise ValueError(f"unknown FSDP2 mode {mode!r}")
    setup = setup_fsdp2(model, dp, compile_blocks=True)
    setup.info["activation_memory_budget"] = (
        f"{ratio} (torch._functorch.config, set by the benchmark around the compiles)")
    return setup


def _with_compiled_loss(setup: Setup) -> Setup:
    """``setup`` with its loss compiled apart from the model (the model's forward stays as the
    mode runs it): :data:`COMPILED_LOSS_SUFFIX`."""
    model = setup.keep[0]
    loss = torch.compile(llama_loss)
    setup.info["loss"] = "torch.compile(loss) over the model's logits, apart from the blocks"
    return dataclasses.replace(setup, loss=lambda tokens, targets: loss(model(tokens), targets),
                               keep=[*setup.keep, loss])


def parse_peak_budget(value: str) -> int | str:
    """A ``peak_memory_budget_bytes`` written on a command line or in the environment:
    ``"auto"`` or a number of bytes."""
    return value if value == "auto" else int(value)


def peak_budget_from_env() -> int | str:
    """The budget of the budgeted shardc modes: ``SHARDC_PEAK_BUDGET``, default ``"auto"``."""
    return parse_peak_budget(os.environ.get("SHARDC_PEAK_BUDGET", "auto"))


# What the ``-rswait`` modes add (``ShardcOptions.reduce_scatter_wait_past_small_buckets``).
RSWAIT_OPTIONS: dict[str, object] = {"reduce_scatter_wait_past_small_buckets": True}


def setup_mode(mode: str, cfg: LlamaConfig, device: torch.device, mesh, loss_in_graph: bool = True,
               fp8: bool = False) -> Setup:
    """``mode``'s model and :class:`Setup`; ``fp8`` (``--fp8``): the shardc modes shard with
    ``shardc_mode.fp8_policy()`` (any other mode is refused, :func:`check_fp8`)."""
    if fp8:
        check_fp8([mode])
    # Every shardc mode shards through this (with the FP8 policy under --fp8).
    setup_shardc_ = functools.partial(setup_shardc, fp8=True) if fp8 else setup_shardc
    model = build_model(cfg, device)
    if mode in ("bound", "bound-cudagraphs"):
        return setup_bound(model, loss_in_graph, cudagraphs=mode == "bound-cudagraphs")
    if mode == "simplefsdp" and mesh.ndim != 1:
        raise NotImplementedError("simplefsdp mode: 1-D meshes only (no --mesh / --tp)")
    model = bench_mesh.parallelize_llama(model, mesh)  # --tp: tensor-parallel blocks first
    mode, loss_compiled = split_compiled_loss(mode)
    if loss_compiled:
        return _with_compiled_loss(setup_mode_fsdp2(mode, model, mesh))
    if mode.startswith("fsdp2"):
        return setup_mode_fsdp2(mode, model, mesh)
    if mode == "simplefsdp":
        return setup_simplefsdp(model, mesh, loss_in_graph)
    if mode == "shardc-dtensorin":
        # The forwards read the DTensor parameters (plain_inputs=False): shardc's default
        # before the fifty-third session.
        setup = setup_shardc_(model, mesh, loss_in_graph, plain_inputs=False)
        setup.info["options"] = "shardc.shard(..., plain_inputs=False)"
        return setup
    if mode in ("shardc-plain", "shardc-plain-budget", "shardc-plain-pool"):
        # Forwards read plain local shards; gradients handed to the DTensor parameters
        # (shardc.shard(..., plain_inputs=True), docs/overhead.md). -budget: with the peak
        # budget of shardc-budget (SHARDC_PEAK_BUDGET, default "auto"); -pool: with the static
        # communication pool under Inductor too (one opaque copy per bucket: fewer outer-graph
        # nodes per block to compile, issue 18).
        options: dict[str, object] = {}
        if mode == "shardc-plain-budget":
            options["peak_memory_budget_bytes"] = peak_budget_from_env()
        if mode == "shardc-plain-pool":
            options["comm_pool"] = True
        setup = setup_shardc_(model, mesh, loss_in_graph, plain_inputs=True, **options)
        setup.info["options"] = ", ".join(
            ["shardc.shard(..., plain_inputs=True)"]
            + [f"{k}={v!r}" for k, v in options.items()])
        return setup
    if mode in ("shardc-sink", "shardc-packed-sink"):
        # Default shardc (or packed blocks) with each body's final residual add sunk into the
        # next body call (sink_block_residual): where Inductor fuses it into the next block's
        # norm, as with the blocks inline; no CUDA graphs, no budget (every bucket resharded).
        packed = mode == "shardc-packed-sink"
        setup = setup_shardc_(model, mesh, loss_in_graph, sink_block_residual=True,
                              **({"pack_blocks": True} if packed else {}))
        setup.info["options"] = "sink_block_residual=True" + (
            ", shardc.shard(..., pack_blocks=True)" if packed else "")
        return setup
    if mode == "shardc-nosink":
        # Default shardc with each body's final residual add where it was traced
        # (sink_block_residual=False): the default before the fifty-ninth session.
        setup = setup_shardc_(model, mesh, loss_in_graph, sink_block_residual=False)
        setup.info["options"] = "sink_block_residual=False"
        return setup
    if mode == "shardc-unpacked":
        # Default shardc with each block's parameters read and gathered one by one
        # (shardc.shard(..., pack_blocks=False)): the default before the seventieth session.
        setup = setup_shardc_(model, mesh, loss_in_graph, pack_blocks=False)
        setup.info["options"] = "shardc.shard(..., pack_blocks=False)"
        return setup
    if mode in ("shardc-packed", "shardc-packed-plain"):
        # Each repeated block's shards in one buffer, read and gathered as one tensor
        # (shardc.shard(..., pack_blocks=True), issue 18: less to trace and guard per block;
        # shard's default since s70, so this is default shardc where nothing else differs);
        # the parameters outside the blocks read as shard's default reads them (plain leaves
        # since s53; before, shardc-packed read them as DTensors and -plain as plain leaves: the
        # two are the same mode now).
        setup = setup_shardc_(model, mesh, loss_in_graph, pack_blocks=True)
        setup.info["options"] = "shardc.shard(..., pack_blocks=True)"
        return setup
    if mode == "shardc-budget":
        # The whole-step peak budget (issue 22): SHARDC_PEAK_BUDGET bytes, or "auto".
        # SHARDC_PEAK_MARGIN: the margin for the prediction's error (default: shardc's).
        options = {"peak_memory_budget_bytes": peak_budget_from_env()}
        if os.environ.get("SHARDC_PEAK_MARGIN"):
            options["peak_memory_margin"] = float(os.environ["SHARDC_PEAK_MARGIN"])
        # SHARDC_FUSED_LOSS: the fused output projection + cross-entropy (auto, 1 = always,
        # 0 = never, or tokens per chunk > 1).
        if os.environ.get("SHARDC_FUSED_LOSS"):
            value = os.environ["SHARDC_FUSED_LOSS"]
            options["fused_loss"] = ("auto" if value == "auto" else bool(int(value))
                                     if value in ("0", "1") else int(value))
        # SHARDC_ACTIVATION_OFFLOAD: the activation offload lever (auto, never, prefer), or
        # comma-separated block names forcing it without a budget (with SHARDC_PEAK_BUDGET=0):
        # "*" offloads every block's saved values, "checkpoint:*" recomputes every block and
        # offloads its checkpoint (its input), "checkpoint:layers.0,layers.1" mixes them.
        if os.environ.get("SHARDC_ACTIVATION_OFFLOAD"):
            value = os.environ["SHARDC_ACTIVATION_OFFLOAD"]
            options["activation_offload"] = value if value in ("auto", "never", "prefer") \
                else tuple(v.strip() for v in value.split(",") if v.strip())
        # SHARDC_CLUSTER_PROFILE: a cluster profile (preset name or JSON path, e.g. one from
        # `python -m shardc calibrate`, whose host link prices the offload lever).
        if os.environ.get("SHARDC_CLUSTER_PROFILE"):
            options["cluster"] = {"profile": os.environ["SHARDC_CLUSTER_PROFILE"]}
        # SHARDC_OPTIMIZER_OFFLOAD: the last lever, the optimizer's state on the host (auto,
        # never).
        if os.environ.get("SHARDC_OPTIMIZER_OFFLOAD"):
            options["optimizer_offload"] = os.environ["SHARDC_OPTIMIZER_OFFLOAD"]
        # SHARDC_OPTIMIZER_STEP_CHUNKS: the optimizer step in chunks (auto, never, always):
        # "always" against "never" at a budget that binds nothing prices the chunks alone.
        if os.environ.get("SHARDC_OPTIMIZER_STEP_CHUNKS"):
            options["optimizer_step_chunks"] = os.environ["SHARDC_OPTIMIZER_STEP_CHUNKS"]
        # SHARDC_PARAM_OFFLOAD=auto: shard with OffloadPolicy(params="auto"), the parameter
        # shards moved to the host by the budget where nothing else meets it (issue 22).
        auto = os.environ.get("SHARDC_PARAM_OFFLOAD") == "auto"
        setup = setup_shardc_(model, mesh, loss_in_graph, **options,
                              **({"offload": "auto"} if auto else {}))
        setup.info["options"] = ", ".join(
            (["shardc.shard(..., offload=shardc.OffloadPolicy(params='auto'))"] if auto else [])
            + [f"{k}={v!r}" for k, v in options.items()])
        return setup
    if mode in ("shardc-offload", "shardc-offload-budget"):
        # CPU offload (shardc.OffloadPolicy: parameter shards, gradients and optimizer state on
        # the host), the point FSDP2's CPUOffloadPolicy is compared with; -budget adds the
        # peak budget of shardc-budget (SHARDC_PEAK_BUDGET; the planner keeps buckets gathered
        # where it allows, and frees blocks' activations below).
        options = {"peak_memory_budget_bytes": peak_budget_from_env()} \
            if mode.endswith("-budget") else {}
        setup = setup_shardc_(model, mesh, loss_in_graph, offload=True, **options)
        # The host AdamW of each bucket runs under the rest of the backward
        # (shardc.step_in_backward, docs/offload.md), as shardc's offload is meant to be used:
        # FSDP2's CPUOffloadPolicy steps after its backward.
        setup.prepare_optimizer = lambda opt: setup.keep.append(shardc.step_in_backward(model, opt))
        setup.info["offload"] = "shardc.OffloadPolicy()"
        setup.info["optimizer"] = "AdamW on the host, each bucket stepped in the backward " \
            "(shardc.step_in_backward)"
        setup.info["options"] = ", ".join(
            ["shardc.shard(..., offload=shardc.OffloadPolicy())"]
            + [f"{k}={v!r}" for k, v in options.items()])
        return setup
    if mode == "shardc-oneop":
        # Each bucket's send buffers and copy-out one op (one_op_bucket_copies, issue 18's
        # compile-time cut; opt-in until its step time is measured against default shardc).
        setup = setup_shardc_(model, mesh, loss_in_graph, one_op_bucket_copies=True)
        setup.info["options"] = "one_op_bucket_copies=True"
        return setup
    if mode == "shardc-rswait":
        # Each reduce-scatter waited past the next buckets of at most 1/16 its bytes (FP8's
        # norm bucket after a layer's Linear bucket; opt-in until measured against default
        # shardc, docs/cost_model.md). In bf16 no Llama bucket is that small: the same plan as
        # shardc (a control); with --fp8 (FP8 Linear and Embedding weights) the norm buckets
        # are, and the plans differ.
        setup = setup_shardc_(model, mesh, loss_in_graph, **RSWAIT_OPTIONS)
        setup.info["options"] = ", ".join(f"{k}={v!r}" for k, v in RSWAIT_OPTIONS.items())
        return setup
    if mode == "shardc-pool":
        setup = setup_shardc_(model, mesh, loss_in_graph, comm_pool=True)
        setup.info["options"] = "comm_pool=True (static communication pool under Inductor)"
        return setup
    if mode == "shardc-dtensoropt":
        # Every AdamW step through DTensor's dispatch: shardc's default local-shard step
        # (shardc.optim.default_local_step) turned off for this mode's optimizer only.
        setup = setup_shardc_(model, mesh, loss_in_graph)
        setup.prepare_optimizer = lambda opt: shardc.optim.set_default_local_step(False, opt)
        setup.info["optimizer"] = "AdamW over the DTensor parameters (default local step off)"
        return setup
    if mode in ("shardc-localopt", "shardc-cudagraphs", "shardc-fast", "shardc-fast-budget",
                "shardc-fast-budget-inline", "shardc-fast-budget-sink", "shardc-fast-sink",
                "shardc-fast-sink-pcasts", "shardc-fast-rswait"):
        # All step AdamW on the local shards; -cudagraphs also compiles with
        # mode="reduce-overhead" (CUDA graph trees; shardc falls back loudly where it cannot);
        # -fast is -cudagraphs with plain inputs too: every opt-in host-overhead option at once;
        # -fast-budget adds the peak budget of shardc-budget (SHARDC_PEAK_BUDGET, default
        # "auto": buckets kept gathered for the backward where memory allows); -inline compiles
        # the blocks inline (compile_blocks_once=False), so Inductor fuses across their
        # boundaries (docs/overhead.md: the world-1 gap left at the body boundary); -sink keeps
        # them compiled once and moves each body's final residual add into the next body call
        # (sink_block_residual), where Inductor fuses it into the next block's norm;
        # -fast-sink is -fast with the sunk residual and no budget (every bucket resharded
        # after the forward: default shardc's peak); -fast-rswait is -fast with shardc-rswait's
        # reduce-scatter waits (under CUDA graphs, where FP8's early waits stall the stream);
        # -fast-sink-pcasts is -fast-sink with world 1's casts generated by Inductor per
        # parameter (one_op_local_casts=False), not one foreach copy per bucket. (Since the
        # fifty-ninth session the default sink_block_residual="auto" sinks in the other modes
        # too; -sink passes True, which sinks even a block the budget recomputes.)
        cudagraphs = mode != "shardc-localopt"
        options: dict[str, object] = {}
        if mode.startswith("shardc-fast"):
            options["plain_inputs"] = True
        if mode.startswith("shardc-fast-budget"):
            options["peak_memory_budget_bytes"] = peak_budget_from_env()
        if mode.endswith("-inline"):
            options["compile_blocks_once"] = False
        if mode.endswith(("-sink", "-sink-pcasts")):
            options["sink_block_residual"] = True
        if mode.endswith("-pcasts"):
            options["one_op_local_casts"] = False
        if mode.endswith("-rswait"):
            options.update(RSWAIT_OPTIONS)
        setup = setup_shardc_(model, mesh, loss_in_graph,
                              compile_mode="reduce-overhead" if cudagraphs else None, **options)
        setup.prepare_optimizer = shardc.optim.local_shard_step
        setup.info["optimizer"] = "AdamW stepping the local shards (shardc.optim.local_shard_step)"
        setup.cudagraphs = cudagraphs
        if cudagraphs:
            setup.info["options"] = ", ".join(
                ['torch.compile(..., mode="reduce-overhead")']
                + [f"{k}={v!r}" for k, v in options.items()])
        return setup
    if mode == "shardc-noreshard":
        # Gathered parameters kept from the forward to the backward (no re-gather; at world 1
        # no re-cast): the bound's memory for the compute-dtype copies.
        setup = setup_shardc_(model, mesh, loss_in_graph, reshard_after_forward=False)
        setup.info["options"] = "shardc.shard(..., reshard_after_forward=False)"
        return setup
    if mode == "shardc-ac":
        # Every block under torch.utils.checkpoint (full, non-reentrant), as fsdp2-compile-ac
        # wraps them: the user's checkpointing compiled inside each block body, against
        # shardc-budget's planner-chosen recompute of the same blocks (issue 22's tokens/s).
        for i, block in enumerate(list(model.layers)):
            model.layers.register_module(str(i), CheckpointedBlock(block, "full"))
        setup = setup_shardc_(model, mesh, loss_in_graph)
        setup.info["options"] = "every block under torch.utils.checkpoint (full)"
        return setup
    if mode == "shardc-inline":
        setup = setup_shardc_(model, mesh, loss_in_graph, compile_blocks_once=False)
        setup.info["options"] = "compile_blocks_once=False (every block compiled inline)"
        return setup
    if mode in ("shardc", "shardc-keeporder", "shardc-combo"):
        setup = setup_shardc_(model, mesh, loss_in_graph)
        if mode == "shardc-keeporder":
            setup.info["inductor_config"] = {"reorder_for_peak_memory": "False"}
        if mode == "shardc-combo":
            setup.info["inductor_config"] = {"combo_kernels": "True"}
        return setup
    raise ValueError(f"unknown mode {mode!r}")
