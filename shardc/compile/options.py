"""Backend options: one small frozen dataclass, validated on construction."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from shardc.planning import optimizer_kind

# ``activation_offload`` entries naming a block to recompute with its checkpoint offloaded.
CHECKPOINT_PREFIX = "checkpoint:"
# ``ShardcOptions.memory_target``: the peak model's count of device memory.
MEMORY_TARGETS = ("auto", "cuda", "exact")


@dataclass(frozen=True)
class ShardcOptions:
    """Options of the ``shardc`` backend (``shardc.backend(**options)``).

    inductor: compile the planned graphs with Inductor; ``False`` runs the planned FX graphs
        directly (fast to compile; for CPU tests and debugging).
    bucket_by: ``"module"`` groups parameters into one bucket per transformer block / named
        module (see ``bucket_modules``); ``"param"`` gives every parameter its own bucket.
    bucket_modules: module-name regexes whose parameters form one bucket each; empty means the
        children of every ``nn.ModuleList`` (transformer blocks) plus one bucket for the rest.
    bucket_cap_bytes: split a bucket whose gathered size would exceed this many bytes (0: no cap).
    prefetch: issue each bucket's all-gather before the compute of the previous bucket.
    prefetch_depth: how many buckets ahead an all-gather may be issued.
    memory_budget_bytes: a bound on communication memory (0: no limit), applied twice. The
        schedule (``shardc.planning.schedule``) issues a bucket's all-gather no earlier than the
        gathered bytes in flight (its own and those of the buckets prefetched before it) stay
        within it: its "in-flight limit". The pipeline (``shardc.compile.pipeline``) then checks
        the communication pool's size (``plan.predicted.pool_bytes``) against it and re-plans
        with shallower prefetch while the pool exceeds it: its "pool budget". It does not
        bound the step's peak: ``peak_memory_budget_bytes`` does.
    peak_memory_budget_bytes: a bound on the predicted whole-step peak
        (``plan.predicted.peak_bytes``); 0: no bound (the plan is exactly the fixed policy).
        ``"auto"``: the device's capacity less a margin (``shardc.planning.budget``), CUDA only
        (an error elsewhere). The planner keeps buckets gathered from the forward to the
        backward while the predicted peak stays within it (``shardc.planning.budget``); a
        bound below the feasible minimum (plus the margin) is refused at compile time.
    peak_memory_margin: the peak prediction's error the budget allows for, as a fraction of
        the planned-for peak (default 0.02): the planner plans for
        ``peak_memory_budget_bytes / (1 + peak_memory_margin)``, so a measured peak at most
        this fraction above the predicted one stays within the budget
        (``shardc.planning.budget.planned_for``; docs/memory_budget.md). 0: plan for the
        budget itself. Ignored without a budget.
    activation_offload: the third lever of the peak budget (``shardc.planning.offload``,
        docs/memory_budget.md): a block's saved activations copied to host memory in the
        forward and prefetched back for the backward (``shardc.passes.offload_saved``).
        ``"auto"`` (default): under ``peak_memory_budget_bytes``, where freeing a block's
        activations is needed, the planner offloads it instead of recomputing it when the cost
        model prices the copies' exposed time below the recomputation, and offloads the part
        of a block's saved values whose copies its forward hides before freeing any block
        whole (``shardc.planning.offload.hidden_part``). ``"never"``: recompute only.
        ``"prefer"``: offload every block that can be, whole, rather than recompute it (where
        the cost model underrates the host link; tests and benchmarks). A tuple of block
        names (``("layers.0", "layers.1")``, or ``("*",)`` for every block): offload exactly
        those blocks' saved activations, without a budget (refused with one: the planner
        chooses there). An entry ``"checkpoint:<block>"`` (``"checkpoint:*"``: every block
        that can be recomputed) recomputes that block in the backward and offloads what it
        still saves, its checkpoint (its input hidden state), to host memory: the combined
        lever the planner turns to under a budget where recomputing every block is not enough
        (docs/memory_budget.md); forced here for tests and benchmarks.
    optimizer_offload: the peak budget's last lever (``shardc.planning.optimizer_offload``,
        docs/memory_budget.md): the optimizer's state and step on the host, as
        ``OffloadPolicy(params=False, optimizer=True)`` does, for every parameter of the
        model. ``"auto"`` (default): under ``peak_memory_budget_bytes``, where no configuration
        of the other levers meets the budget, the planner puts it there and chooses the other
        levers again. ``"never"``: never (such a budget is refused). ``"simulate"``: as
        ``"auto"``, and also on a CPU mesh, where host and device memory are one (a testing
        mode, like ``OffloadPolicy(simulate_on_cpu=True)``: the host copies are separate
        tensors). Ignored without a budget.
    optimizer_step_chunks: the optimizer step in chunks (``shardc.planning.optimizer_chunks``,
        ``shardc.runtime.chunked_step``, docs/memory_budget.md): ``optimizer.step()`` steps the
        model's parameters in one call per bucket of the plan (its groups narrowed to the
        bucket's parameters, bitwise the same result for the elementwise torch.optim
        optimizers), so torch's ``foreach`` temporaries are one bucket's, not every shard's.
        ``"auto"`` (default): under ``peak_memory_budget_bytes``, where the optimizer step's
        peak is over the budget, the planner tries it before the optimizer's offload (a few
        more launches instead of host copies and a host step). ``"never"``: never. ``"always"``:
        every region's step in chunks, with or without a budget (tests, benchmarks). Refused at
        ``optimizer.step()`` for an optimizer it cannot step exactly (a class not in
        ``shardc.optim.local_step.ELEMENTWISE``, a closure, a step hook that is not shardc's:
        it would run once per chunk); not chosen where the optimizer's
        state is on the host (offload, ``step_in_backward``) or runs fused / per tensor
        (``optimizer_impl``: nothing to save).
    recompute_saved_values: the recompute lever per saved activation (docs/memory_budget.md,
        ``shardc.passes.recompute_part``). ``True`` (default): under
        ``peak_memory_budget_bytes``, where freeing activations is needed, the planner may
        recompute in the backward the saved values of a compile-once block that its body
        computes from its other saved values by elementwise work alone (a Llama block's
        normalized hidden states and SwiGLU product), each block's as one candidate priced by
        the cost model beside the whole block's recompute and offload; those values are then
        left out of the block's offloaded part. ``False``: whole blocks only (and offloaded
        parts drawn from every saved value), as before.
    recompute_to_keep_gathered: under ``peak_memory_budget_bytes``, after the levers chose in
        order (keep buckets gathered while the fully resharded plan fits, else recompute or
        offload blocks with every bucket resharded), also try the two together: blocks
        recomputed so that buckets can stay gathered from the forward to the backward, taken
        where that predicts a shorter step (``shardc.planning.trade``, a bounded search; its
        reasons in the plan). Default True; False keeps the levers in order only. Not tried
        where blocks are offloaded or ``activation_offload`` is not ``"auto"``.
    fused_loss: the output projection and cross-entropy computed by one chunked op
        (``shardc.ops.fused_ce``, ``shardc.passes.fused_loss``, docs/memory_budget.md): the
        full ``[tokens, vocab]`` logits, their fp32 copy and their gradient never exist at
        once. ``"auto"`` (default): only under ``peak_memory_budget_bytes``, where the fully
        resharded plan is over the budget and the cost model prices the fused op's time below
        the cheapest block's recompute (the no-budget plan is never changed). ``True``: fuse
        every cross-entropy that matches, the planner choosing the tokens per chunk; an ``int``
        (>= 1): fuse with that many tokens per chunk; ``False``: never.
    check_plan_consistency: at the first run, all ranks compare the plan's hash (through the process
        group's store, see ``shardc.runtime.plan_check``).
    check_host_memory: the host's memory bounds what shardc's own plan puts there (offloaded
        activations, the peak budget's share of the optimizer): under a peak budget the search
        chooses those levers only while they fit the host's available memory for every local
        rank (the capacity agreed across the ranks: ``shardc.compile.host_memory``), and a plan
        that still does not fit is refused when it is made; False: no limit, no check (a host
        whose available memory is not what the process may use).
    dump_dir: write the plan (text, JSON, trace, memory plot) of every compiled region here;
        defaults to the ``SHARDC_DUMP`` environment variable.
    comm_pool: place communication buffers in one static pool allocated once per training
        region, so steps allocate none. Default (``None``): on with ``inductor=False``, off with
        Inductor, whose caching-allocator reuse frees communication buffers between their
        lifetimes, while a static pool holds its whole size through the activation peak (the
        plan still reports ``pool_bytes``); ``True`` turns it on under Inductor too.
    debug_pool: fill each pool buffer with NaN once it is dead, so overlapping live buffers
        show up as NaNs.
    cluster: ``shardc.planning.cost_model.ClusterSpec`` fields for the cost model's predictions.
    optimizer_state_factor: optimizer state bytes per parameter byte, for the peak prediction
        (2 for Adam/AdamW, 1 for SGD with momentum, 0 for plain SGD).
    optimizer_temp_factor: temporary bytes per parameter byte that the optimizer's ``foreach``
        step allocates, for the peak prediction (1 for Adam/AdamW; 0: none, read as
        ``fused=True`` where ``optimizer_impl`` is ``"auto"``).
    optimizer_impl: the ``torch.optim`` implementation the optimizer runs
        (``shardc.planning.optimizer_kind``): ``"auto"`` (``foreach`` and ``fused`` unset:
        torch's choice per parameter group, foreach on CUDA, per tensor in a group holding host
        tensors, as the peak budget's partial optimizer offload makes it), ``"foreach"``,
        ``"fused"``, ``"per_tensor"`` (``foreach=False``). The peak prediction counts the step's
        temporaries of that implementation; the step prediction prices it.
        ``shardc.planning.optimizer_kind.from_optimizer(opt)`` gives the options of an
        optimizer.
    move_found_collectives: collectives already in the traced graph (DTensor's tensor-parallel
        ones) are issued as soon as their inputs exist and waited before their first reader;
        ``False`` keeps them where they were traced (they are planned and simulated either way).
    compile_blocks_once: compile each distinct repeated block (the identical children of an
        ``nn.ModuleList``, found by ``shardc.shard``: ``shardc.sharding.blocks``) once, as one
        body that every block calls, while the region is still planned as a whole (every
        gather and reduce-scatter stays in the region's graphs). ``False`` inlines the bodies
        again: every block is traced, partitioned and compiled on its own, as before.
    sink_block_residual: with ``compile_blocks_once``, move the residual add that ends each
        block body (``h_out = h_mid + mlp_out``) into the next body call
        (``shardc.passes.sink_residual``): the body takes the previous block's pair and adds it
        first, where Inductor fuses the add into the next block's norm as it does with the
        blocks inline, instead of a kernel of its own between two body calls (about 0.05-0.08
        ms per layer on an H200, docs/overhead.md). The first call takes the hidden state and
        zeros (one body for every block); the region adds the last pair. Where a body's calls
        do not match (output not one residual add, an output read elsewhere, calls inside
        another higher-order op such as activation checkpointing), they stay as they are, said
        once in the log and in the plan's notes. A sunk block that is recomputed whole saves
        its call's pair (both addends, twice the hidden state) as its checkpoint, where the
        block as traced saves one tensor: ``"auto"`` (default) sinks except where a block is
        to be recomputed, so it never saves more. It does not sink where ``activation_offload``
        names checkpoints, and where the peak budget's planner recomputes a whole sunk block,
        the region is compiled again without sinking (said in the log and the plan's notes); a
        part of a sunk block's saved values is recomputed as in any body. ``True`` sinks there
        too; ``False`` never sinks.
    opaque_body_calls: with ``compile_blocks_once``, every call of a block body after its first
        one in a training region's graph reaches AOTAutograd as one opaque op pair
        (``shardc::body_fwd``/``body_bwd``, ``shardc.passes.body_standin``) instead of an
        ``invoke_subgraph`` call, which torch re-traces at every call (its mutation check,
        ``gen_schema``) even where it reuses the body's trace after; the partitioner turns each
        pair back into the calls of the first call's partitioned body, so the joint graph it
        plans is the one it would have been. Calls it cannot take (symbolic sizes, no_grad or
        eval regions, calls inside activation checkpointing, calls whose metadata differs from
        the first call's) keep the ``invoke_subgraph`` call, said once in the log; a region
        whose stand-ins do not fit the partitioned body is compiled again without them. On by
        default (``False``: every call an ``invoke_subgraph`` call, as before).
    one_op_bucket_copies: without the communication pool, fill each bucket's all-gather and
        reduce-scatter send buffer with one ``shardc::pool_pack`` (where it computes the same
        values: casts to the buffer's dtype, a power-of-two divisor), and under Inductor copy a
        bucket that one block-body call reads out of its gathered buffer with one
        ``shardc::unpack_into`` right before the call, instead of nodes per parameter: Inductor
        then generates the same kernels at every depth (compile time, issue 18; the same
        values, plan and predicted memory). Off by default: on two H200s it made the step at
        batch 1 0.62x default shardc's (twenty-second session), when each op copied tensor by
        tensor through ``custom_op``'s Python layers; the ops are now one kernel each where
        the layout allows and dispatcher-level (``shardc.ops.runtime_op``), 54-201 us of host
        time a call on an H200 (docs/design.md, thirty-eighth session), but the two-GPU step
        has not been measured again.
    one_op_local_casts: under Inductor, where a one-rank group's collectives are elided (world
        1, or HSDP's shard groups of one rank), cast a bucket's shards to the compute dtype for
        the one block-body call that reads them, and its gradients to the reduce dtype, with
        one ``shardc::cast_into`` each (a foreach copy: a few launches) instead of a cast per
        parameter, which Inductor lowered, scheduled and generated as a kernel each at every
        block (compile time, issue 18). The same values, plan and predicted memory. On by
        default: measured on one H200 (world 1, 1b config; docs/design.md, thirty-eighth
        session), Inductor's compile at 64 layers 24.3 -> 18.7 s with the same step time and
        peak. ``False``: a cast per parameter, as before.
    reduce_scatter_wait_past_small_buckets: where a bucket's reduce-scatter is waited in the
        backward (``shardc.planning.schedule``). By default it is waited before the next
        bucket's send buffer is first written, so that at most one send buffer is alive besides
        the one being filled. With this option the wait passes over the following buckets whose
        send buffers are at most 1/16 of its bytes (FP8's norm bucket after a layer's Linear
        bucket, whose first write comes a few ops after the large reduce-scatter's issue) and
        goes before the first write of the next bucket that is larger; still never later than
        the first reader of the reduced gradients. The small buffers then live beside the
        large one (the peak prediction counts them), in exchange for the compute stream not
        stalling right after each large issue (docs/cost_model.md: 4.6 ms a step waited under
        CUDA graphs for FP8 on two H200s; with the option 0.6 ms and the step 2.6% faster, FP8
        under CUDA graphs, docs/fp8.md). Off by default until it is measured as a gain without
        CUDA graphs too: with it off the plan is exactly as before.
    memory_target: how the peak prediction counts device memory (``shardc.memory.cuda_blocks``,
        docs/memory_budget.md). ``"auto"`` (default): as the CUDA caching allocator does where
        the region's inputs are on a CUDA device, or where ``cluster`` names a GPU's profile
        (``{"profile": "h200"}``: a plan made on a CPU for that GPU): every allocation as its
        block, plus the profile's runtime workspaces (``ClusterProfile.runtime_bytes``); the
        requested bytes elsewhere (a CPU run, or a CPU mesh with the default profile: no
        allocator statistics to meet). ``"cuda"``: the CUDA count on any device (``python -m
        shardc plan`` sets it: its plan is the profile's GPU's). ``"exact"``: the requested
        bytes on any device, no workspaces.
    """

    inductor: bool = True
    bucket_by: str = "module"
    bucket_modules: tuple[str, ...] = ()
    bucket_cap_bytes: int = 0
    prefetch: bool = True
    prefetch_depth: int = 1
    memory_budget_bytes: int = 0
    peak_memory_budget_bytes: int | str = 0
    # The prediction's known error: on one H100 (1b, 8 layers) the measured peak was up to
    # 0.6 % above the predicted one (docs/memory_budget.md); 2 % covers it with room.
    peak_memory_margin: float = 0.02
    activation_offload: str | tuple[str, ...] = "auto"
    optimizer_offload: str = "auto"
    optimizer_step_chunks: str = "auto"
    recompute_saved_values: bool = True
    recompute_to_keep_gathered: bool = True
    fused_loss: str | bool | int = "auto"
    check_plan_consistency: bool = True
    check_host_memory: bool = True
    dump_dir: str | None = None
    debug_pool: bool = False
    comm_pool: bool | None = None
    cluster: dict | None = None
    optimizer_state_factor: float = 2.0
    optimizer_temp_factor: float = 1.0
    optimizer_impl: str = "auto"
    move_found_collectives: bool = True
    compile_blocks_once: bool = True
    sink_block_residual: bool | str = "auto"
    opaque_body_calls: bool = True
    one_op_bucket_copies: bool = False
    one_op_local_casts: bool = True
    reduce_scatter_wait_past_small_buckets: bool = False
    memory_target: str = "auto"

    def __post_init__(self) -> None:
        optimizer_kind.check(self.optimizer_impl)
        if self.bucket_by not in ("module", "param"):
            raise ValueError(
                f"shardc: bucket_by must be 'module' or 'param', got {self.bucket_by!r}"
            )
        if self.prefetch_depth < 0:
            raise ValueError(f"shardc: prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.bucket_cap_bytes < 0 or self.memory_budget_bytes < 0:
            raise ValueError("shardc: bucket_cap_bytes and memory_budget_bytes must be >= 0")
        budget = self.peak_memory_budget_bytes
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                                 or budget < 0):
            raise ValueError(
                "shardc: peak_memory_budget_bytes must be a number of bytes >= 0 (0: no bound) "
                f"or 'auto', got {budget!r}")
        margin = self.peak_memory_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) \
                or not 0 <= margin < 1:
            raise ValueError(
                "shardc: peak_memory_margin must be a fraction in [0, 1) of the planned-for "
                f"peak (e.g. 0.02 for 2 %), got {margin!r}")
        self._check_activation_offload()
        self._check_fused_loss()
        if self.sink_block_residual not in (True, False, "auto"):
            raise ValueError("shardc: sink_block_residual must be True, False or 'auto', got "
                             f"{self.sink_block_residual!r}")
        if self.memory_target not in MEMORY_TARGETS:
            raise ValueError(f"shardc: memory_target must be one of {MEMORY_TARGETS}, got "
                             f"{self.memory_target!r}")
        if self.optimizer_offload not in ("auto", "never", "simulate"):
            raise ValueError(
                "shardc: optimizer_offload must be 'auto', 'never' or 'simulate' (CPU tests), "
                f"got {self.optimizer_offload!r}")
        if self.optimizer_step_chunks not in ("auto", "never", "always"):
            raise ValueError(
                "shardc: optimizer_step_chunks must be 'auto', 'never' or 'always', got "
                f"{self.optimizer_step_chunks!r}")
        if self.dump_dir is None and os.environ.get("SHARDC_DUMP"):
            object.__setattr__(self, "dump_dir", os.environ["SHARDC_DUMP"])
        object.__setattr__(self, "bucket_modules", tuple(self.bucket_modules))
        if self.comm_pool is None:
            object.__setattr__(self, "comm_pool", not self.inductor)

    def _check_activation_offload(self) -> None:
        value = self.activation_offload
        if isinstance(value, str):
            if value not in ("auto", "never", "prefer"):
                raise ValueError(
                    "shardc: activation_offload must be 'auto', 'never', 'prefer' or a tuple of "
                    f"block names (('*',): every block), got {value!r}")
            return
        if not isinstance(value, (tuple, list)) or not value \
                or not all(isinstance(v, str) and v and v != CHECKPOINT_PREFIX for v in value):
            raise ValueError(
                "shardc: activation_offload must be 'auto', 'never', 'prefer' or a non-empty "
                f"tuple of block names (('*',): every block), got {value!r}")
        if self.peak_memory_budget_bytes:
            raise ValueError(
                f"shardc: activation_offload={tuple(value)!r} forces offload of those blocks "
                "and cannot be combined with peak_memory_budget_bytes, under which the planner "
                "chooses what to offload: pass activation_offload='auto' or 'prefer' with a "
                "budget, or drop the budget")
        object.__setattr__(self, "activation_offload", tuple(value))

    def _check_fused_loss(self) -> None:
        value = self.fused_loss
        if value == "auto" or isinstance(value, bool):
            return
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                "shardc: fused_loss must be 'auto' (fuse the output projection and "
                "cross-entropy only where a peak budget needs the bytes), True (always), False "
                f"(never) or a number of tokens per chunk >= 1, got {value!r}")

    def fused_loss_chunk(self) -> int | None:
        """Tokens per chunk where ``fused_loss`` names them, else None (the planner's)."""
        value = self.fused_loss
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def fused_loss_forced(self) -> bool:
        """Whether the fused loss is used whatever the budget (``True`` or a chunk)."""
        return self.fused_loss is True or self.fused_loss_chunk() is not None

    def sinks_residuals(self) -> bool:
        """Whether block bodies' final residual adds are sunk into their next calls at all
        (``sink_block_residual``; "auto" not where ``activation_offload`` names checkpoints)."""
        if self.sink_block_residual == "auto":
            return not self.forced_checkpoint_offload()
        return bool(self.sink_block_residual)

    def keeps_loss_ops_whole(self) -> bool:
        """Whether Inductor's decompositions leave the cross-entropy's ops whole for the fused
        loss's pattern (``shardc.passes.fused_loss``): under Inductor where the fused loss may
        be used (forced, or ``"auto"`` with a peak budget). The pipeline decomposes those it
        does not fuse (``fused_loss.decompose_whole_loss_ops``)."""
        return self.inductor and (self.fused_loss_forced() or (
            self.fused_loss == "auto" and bool(self.peak_memory_budget_bytes)))

    def forced_offload(self) -> tuple[str, ...]:
        """The blocks whose saved activations are offloaded without a budget (none unless
        ``activation_offload`` names blocks; ``"checkpoint:"`` entries left out)."""
        value = self.activation_offload
        return () if isinstance(value, str) else tuple(
            v for v in value if not v.startswith(CHECKPOINT_PREFIX))

    def forced_checkpoint_offload(self) -> tuple[str, ...]:
        """The blocks recomputed with their checkpoint offloaded without a budget (the names
        of ``activation_offload``'s ``"checkpoint:<block>"`` entries; ``"*"``: every block that
        can be recomputed)."""
        value = self.activation_offload
        return () if isinstance(value, str) else tuple(
            v[len(CHECKPOINT_PREFIX):] for v in value if v.startswith(CHECKPOINT_PREFIX))

    @classmethod
    def from_kwargs(cls, options: dict) -> ShardcOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"shardc: unknown backend option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**options)

    def as_dict(self) -> dict:
        return asdict(self)
