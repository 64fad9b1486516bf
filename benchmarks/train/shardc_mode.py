"""The shardc modes: ``shardc.shard`` then ``torch.compile(..., backend="shardc")``.

Contract: :func:`setup_shardc` returns a :class:`setup.Setup` whose ``after_first_step`` summarizes
shardc's plans (``shardc.explain_all``: buckets, collectives, predictions, hashes) and hands the
plans themselves to the driver under ``_plans`` (dumped by rank 0, never serialized with the
results). Only shardc's public API is used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardc
from shardc.models.llama import Transformer
from train.setup import Setup, compiled_loss

# --fp8: the weights shardc gathers in FP8, as predict_step.py's ``:fp8`` configurations shard
# them (mixed precision unchanged: fp32 masters, bf16 compute, fp32 gradient reduction).
FP8_POLICY_TEXT = "shardc.Float8Policy(modules=(nn.Linear, nn.Embedding))"


# What ``predicted_step_time_s`` is (recorded beside it, as ``predicted_peak_kind`` is beside the
# peak): the compiled graphs only, which a reader of "predicted step" may take for the step.
STEP_TIME_KIND = ("forward+backward graphs only (sum of the plans' predicted.step_time_s; no "
                  "optimizer step, gradient hand-off or zero_grad: the whole step is "
                  "benchmarks/predict_step.py's)")


def fp8_policy() -> shardc.Float8Policy:
    """The policy of ``--fp8``: :data:`FP8_POLICY_TEXT`."""
    return shardc.Float8Policy(modules=(nn.Linear, nn.Embedding))


def offload_policy(offload: bool | str, on_cpu: bool) -> shardc.OffloadPolicy | None:
    """The ``shardc.OffloadPolicy`` of a mode's ``offload``: ``True`` or ``"params"``
    ``OffloadPolicy()`` (the parameters' shards, gradients and optimizer state on the host),
    ``"auto"`` ``OffloadPolicy(params="auto")`` (the peak budget decides), ``"optimizer"``
    ``OffloadPolicy(params=False, optimizer=True)`` (the optimizer's state and step only); falsy
    or ``"none"``: None. ``on_cpu``: a CPU mesh, where offload is simulated
    (``simulate_on_cpu``: the copies are real separate tensors, docs/offload.md)."""
    if not offload or offload == "none":
        return None
    if offload not in (True, "params", "auto", "optimizer"):
        raise ValueError(f"offload {offload!r}: use True/'params', 'auto' or 'optimizer'")
    params: bool | str = "auto" if offload == "auto" else offload != "optimizer"
    return shardc.OffloadPolicy(params=params, optimizer=True, simulate_on_cpu=on_cpu)


def _shardc_backend_name() -> str:
    """``"shardc"``, registering it if the package is importable but not installed (no entry
    point, e.g. ``PYTHONPATH=$PWD`` on a fresh machine)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "shardc" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=shardc.shardc_backend, name="shardc")
    return "shardc"


def setup_shardc(model: Transformer, mesh, loss_in_graph: bool, compile_mode: str | None = None,
                 reshard_after_forward: bool = True, plain_inputs: bool | None = None,
                 offload: bool | str = False, fp8: bool = False, pack_blocks: bool | None = None,
                 **options: Any) -> Setup:
    """shardc: shard in place, compile with the shardc backend and its default plan (or these
    backend options; ``compile_mode``: torch.compile's ``mode``, e.g. ``"reduce-overhead"``;
    ``reshard_after_forward``, ``plain_inputs``, ``pack_blocks`` (None: shardc's defaults):
    ``shardc.shard``'s;
    ``offload``: shard with ``shardc.OffloadPolicy()``, the parameters' shards, gradients and
    optimizer state on the host, simulated on a CPU mesh (:func:`offload_policy`; ``"auto"``:
    ``OffloadPolicy(params="auto")``, where the peak budget decides; ``"optimizer"``:
    optimizer-only offload); ``fp8``: shard with :func:`fp8_policy`, the Linear and
    Embedding weights gathered in FP8, as ``predict_step.py``'s ``:fp8`` configurations)."""
    mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    on_cpu = next(model.parameters()).device.type == "cpu"
    policy = offload_policy(offload, on_cpu)
    chosen = {k: v for k, v in (("plain_inputs", plain_inputs), ("pack_blocks", pack_blocks))
              if v is not None}
    shardc.shard(model, mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                 offload=policy, fp8=fp8_policy() if fp8 else None, **chosen)
    backend = shardc.backend(**options) if options else _shardc_backend_name()
    mode = {"mode": compile_mode} if compile_mode else {}
    compiled = compiled_loss(model, loss_in_graph, backend=backend, **mode)

    def plan_summary() -> dict[str, Any]:
        plans = shardc.explain_all(model)
        regions = []
        for plan in plans:
            pred = dict(plan.predicted)
            regions.append({
                "region": plan.region,
                "buckets": len(plan.buckets),
                "collectives": len(plan.collectives),
                "predicted": pred,
                "hash": plan.hash(),
            })
            if plan.budget is not None:  # the whole-step peak budget's decisions (issue 22)
                b = plan.budget
                regions[-1]["budget"] = {
                    "budget_bytes": b.budget_bytes, "minimum_bytes": b.minimum_bytes,
                    "peak_bytes": b.peak_bytes, "trials": b.trials, "kept": b.kept,
                    "buckets": len(b.decisions), "recomputed": b.recomputed,
                    "offloaded": b.offloaded, "checkpoint_offloaded": b.checkpoint_offloaded,
                    "blocks": len(b.blocks), "resharded_bytes": b.resharded_bytes,
                    "margin_bytes": b.margin_bytes, "margin_fraction": b.margin_fraction,
                    # the optimizer levers: its step in chunks, its state on the host
                    "optimizer_chunks": (b.optimizer_chunks.chunks
                                         if b.optimizer_chunks is not None
                                         and b.optimizer_chunks.chunked else 0),
                    "optimizer_host_params": (b.optimizer.params if b.optimizer is not None
                                              and b.optimizer.on_host else 0)}
        out: dict[str, Any] = {"regions": regions, "n_regions": len(plans)}
        if plans and all("peak_bytes" in p.predicted for p in plans):
            out["predicted_peak_bytes"] = max(p.predicted["peak_bytes"] for p in plans)
            out["predicted_peak_kind"] = "peak_bytes (whole step)"
        elif plans:
            out["predicted_peak_bytes"] = max(
                p.predicted.get("peak_comm_buffer_bytes", 0) for p in plans
            )
            out["predicted_peak_kind"] = "peak_comm_buffer_bytes (communication buffers only)"
        # predicted_step_time_s (the key kept for recorded results): the compiled graphs'
        # forward+backward (each plan's predicted.step_time_s), NOT the whole step: no
        # optimizer step (a host step with CPU offload), hand-off or zero_grad. The whole step
        # is shardc.planning.step.predict_step's, which benchmarks/predict_step.py reports.
        for key in ("exposed_comm_s", "step_time_s", "comm_time_s"):
            if plans:
                out[f"predicted_{key}"] = sum(p.predicted.get(key, 0.0) for p in plans)
        if plans:
            out["predicted_step_time_kind"] = STEP_TIME_KIND
        out["_plans"] = plans  # not serialized: dumped separately by rank 0
        return out

    info = {"options": "default (ShardcOptions())"}
    if fp8:
        info["fp8"] = FP8_POLICY_TEXT
    return Setup(compiled, list(model.parameters()), [model, compiled], info, plan_summary)
