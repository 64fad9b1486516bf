"""The optimizer steps the local shards of shardc's parameters by default
(``shardc.optim.default_local_step``), where that is exact and nothing else could see it; every
other step goes through DTensor as torch.optim does by itself (world 1, eager, in this process:
a one-rank gloo group over a ``HashStore``; what the step computes does not depend on the world
size, and ``tests/test_parity.py`` trains the default against the unsharded reference at worlds
1-4).

Which path a step took is read from the tensors torch's foreach ops receive (a
``TorchFunctionMode``, public torch API): DTensors through DTensor's dispatch, plain tensors
when the local shards step.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import one_rank_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.overrides import TorchFunctionMode

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, ffn_dim=45, max_seq_len=16)


class _ForeachArgs(TorchFunctionMode):
    """Records, per foreach op called, whether its first list holds DTensors."""

    def __init__(self) -> None:
        super().__init__()
        self.dtensor: list[bool] = []
        self.dtensor_lengths: set[int] = set()  # the lengths of the DTensor lists

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            dtensor = any(isinstance(t, DTensor) for t in args[0])
            self.dtensor.append(dtensor)
            if dtensor:
                self.dtensor_lengths.add(len(args[0]))
        return func(*args, **(kwargs or {}))


class _AdamWSubclass(torch.optim.AdamW):
    pass


def _step_path(opt, closure=None) -> str:
    """Run one ``opt.step()`` and say how its foreach ops saw the parameters."""
    with _ForeachArgs() as seen:
        opt.step(closure) if closure is not None else opt.step()
    assert seen.dtensor, "no foreach op ran"
    # (the step counters are plain tensors on either path)
    return "dtensor" if any(seen.dtensor) else "local"


def _train(mesh, *, default_local: bool = True, pack: bool = False, optimizer=torch.optim.AdamW,
           steps: int = 3, prepare=None) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    shardc.optim.set_default_local_step(default_local)
    try:
        torch.manual_seed(0)
        model = shardc.shard(Transformer(CFG), mesh, pack_blocks=pack)
        opt = optimizer(model.parameters(), lr=1e-2, foreach=True)
        if prepare is not None:
            prepare(model, opt)
        gen, paths = torch.Generator().manual_seed(1), []
        for _ in range(steps):
            toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
            llama_loss(model(toks), toks).backward()
            paths.append(_step_path(opt))
            opt.zero_grad()
        return model, opt, paths
    finally:
        shardc.optim.set_default_local_step(True)


def _assert_same_training(a, b) -> None:
    (model_a, opt_a, _), (model_b, opt_b, _) = a, b
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert isinstance(pb, DTensor) and pb.placements == pa.placements, name
        assert torch.equal(pa.to_local(), pb.to_local()), name
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys(), name
        for key, va in sa.items():
            vb = sb[key]
            assert type(va) is type(vb), (name, key)
            if isinstance(va, DTensor):
                assert vb.placements == va.placements, (name, key)
                va, vb = va.to_local(), vb.to_local()
            assert torch.equal(va, vb), (name, key)


@pytest.mark.parametrize("pack", [False, True], ids=["per_param", "packed"])
def test_the_default_step_is_the_local_shards_and_bitwise_the_dtensor_step(pack):
    with one_rank_mesh() as mesh:
        local = _train(mesh, pack=pack)
        dtensor = _train(mesh, default_local=False, pack=pack)
        assert local[2] == ["local"] * 3
        assert dtensor[2] == ["dtensor"] * 3
        _assert_same_training(dtensor, local)
        # Outside step() the optimizer holds the DTensor parameters, keyed state and all.
        params = list(local[0].parameters())
        assert local[1].param_groups[0]["params"] == params
        assert set(local[1].state) == set(params)
        assert local[1].state_dict()["state"].keys() == dtensor[1].state_dict()["state"].keys()


def _user_hook(model, opt):
    seen = []

    def hook(o, args, kwargs):
        seen.append(all(isinstance(p, DTensor) for p in o.param_groups[0]["params"]))

    opt.register_step_pre_hook(hook)
    opt._test_seen = seen


def _foreign_dtensor(model, opt):
    mesh = next(model.parameters()).device_mesh
    extra = torch.nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    extra.grad = distribute_tensor(torch.full((3,), 0.5), mesh, [Replicate()])
    opt.add_param_group({"params": [extra]})


@pytest.mark.parametrize("prepare,optimizer", [
    (_user_hook, torch.optim.AdamW),
    (None, _AdamWSubclass),
    (_foreign_dtensor, torch.optim.AdamW),
], ids=["step_hook", "subclass", "foreign_dtensor"])
def test_steps_another_could_see_or_that_may_not_be_elementwise_keep_the_dtensor_step(
        prepare, optimizer):
    with one_rank_mesh() as mesh:
        model, opt, paths = _train(mesh, optimizer=optimizer, prepare=prepare, steps=2)
        assert paths == ["dtensor", "dtensor"]
        if prepare is _user_hook:
            assert opt._test_seen == [True, True]  # the user's hook saw DTensor parameters


def test_a_closure_keeps_the_dtensor_step_and_the_next_step_steps_locally():
    with one_rank_mesh() as mesh:
        torch.manual_seed(0)
        model = shardc.shard(Transformer(CFG), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        toks = torch.randint(0, CFG.vocab_size, (2, 8))

        def closure():
            opt.zero_grad()
            loss = llama_loss(model(toks), toks)
            loss.backward()
            return loss

        assert _step_path(opt, closure) == "dtensor"
        closure()
        assert _step_path(opt) == "local"


def test_explicit_local_shard_step_is_not_swapped_twice():
    with one_rank_mesh() as mesh:
        explicit = _train(mesh, prepare=lambda m, o: shardc.optim.local_shard_step(o))
        dtensor = _train(mesh, default_local=False)
        assert explicit[2] == ["local"] * 3
        _assert_same_training(dtensor, explicit)


def test_a_step_that_raises_is_put_back_and_the_next_one_trains_as_before():
    with one_rank_mesh() as mesh:
        reference = _train(mesh, default_local=False, steps=2)
        torch.manual_seed(0)
        model = shardc.shard(Transformer(CFG), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        gen = torch.Generator().manual_seed(1)
        for step in range(2):
            toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
            llama_loss(model(toks), toks).backward()
            if step == 0:
                opt.param_groups[0]["betas"] = None  # the step raises inside torch's AdamW
                with pytest.raises(TypeError):
                    opt.step()
                # The failed step left the local shards in the groups; state_dict() (as the
                # next step() would) puts the DTensor parameters back first.
                assert not any(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
                opt.state_dict()
                assert all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
                opt.param_groups[0]["betas"] = reference[1].param_groups[0]["betas"]
            assert _step_path(opt) == "local"
            opt.zero_grad()
        _assert_same_training(reference, (model, opt, None))


def test_a_gradient_laid_out_otherwise_than_its_parameter_keeps_the_dtensor_step():
    """A partial-sum gradient would be stepped unreduced on the local shard: DTensor's step
    reduces it first."""
    from torch.distributed.tensor import Partial

    with one_rank_mesh() as mesh:
        torch.manual_seed(0)
        model = shardc.shard(Transformer(CFG), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        toks = torch.randint(0, CFG.vocab_size, (2, 8))
        llama_loss(model(toks), toks).backward()
        p = next(model.parameters())
        p.grad = DTensor.from_local(p.grad.to_local(), mesh, [Partial()])
        assert _step_path(opt) == "dtensor"
        opt.zero_grad()
        llama_loss(model(toks), toks).backward()
        assert _step_path(opt) == "local"


def test_the_default_step_keeps_no_optimizer_alive():
    """Dropping the model and its optimizer frees them (their state and parameters with them):
    nothing of the default step's bookkeeping holds the optimizer."""
    import gc
    import weakref

    with one_rank_mesh() as mesh:
        model, opt, paths = _train(mesh, steps=1)
        assert paths == ["local"]
        gone = weakref.ref(opt), weakref.ref(opt.state[next(model.parameters())]["exp_avg"])
        del model, opt
        gc.collect()
        assert gone[0]() is None and gone[1]() is None


def test_a_chunked_step_goes_through_dtensor_in_every_chunk(caplog):
    """The plan's optimizer step in chunks (``shardc.runtime.chunked_step``) calls the step
    once per chunk: each chunk's step keeps DTensor's path too (one reason, logged once)."""
    import logging

    from shardc.runtime import chunked_step

    with one_rank_mesh() as mesh:
        torch.manual_seed(0)
        model = shardc.shard(Transformer(CFG), mesh)
        params = list(model.parameters())
        chunked_step.adopt([("first", params[:5]), ("rest", params[5:])])
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
        toks = torch.randint(0, CFG.vocab_size, (2, 8))
        with caplog.at_level(logging.INFO, logger="shardc"):
            for _ in range(2):
                llama_loss(model(toks), toks).backward()
                with _ForeachArgs() as seen:
                    opt.step()
                opt.zero_grad()
                # Each chunk's foreach ops run over its own parameters, as DTensors in both.
                assert seen.dtensor_lengths == {5, len(params) - 5}, seen.dtensor_lengths
        said = [r.getMessage() for r in caplog.records if "steps" in r.getMessage()
                and "AdamW" in r.getMessage()]
        assert said == ["shardc: this AdamW steps through DTensor: the plan steps it in chunks"]


def test_a_backward_that_does_not_reach_the_plain_parameters_is_said_at_the_step(caplog):
    """With the default plain reads the DTensor parameters are not in the autograd graph:
    ``backward(inputs=params)`` leaves every ``.grad`` None without an error of its own, so the
    next step warns, naming the parameters and ``plain_inputs=False``; a backward() that
    reaches them does not warn, and with the DTensor reads ``backward(inputs=...)`` reaches
    them."""
    import logging

    toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with one_rank_mesh() as mesh:
        torch.manual_seed(0)
        model = shardc.shard(Transformer(CFG), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with caplog.at_level(logging.WARNING, logger="shardc"):
            llama_loss(model(toks), toks).backward()
            opt.step()
            opt.zero_grad()
            assert "found no gradient" not in caplog.text
            llama_loss(model(toks), toks).backward(inputs=list(model.parameters()))
            assert all(p.grad is None for p in model.parameters())
            opt.step()
        said = [r.getMessage() for r in caplog.records if "found no gradient" in r.getMessage()]
        assert len(said) == 1 and "plain_inputs=False" in said[0], said
        assert "'tok_embeddings.weight'" in said[0] or "'layers.0" in said[0], said
        torch.manual_seed(0)
        dtensor_reads = shardc.shard(Transformer(CFG), mesh, plain_inputs=False)
        llama_loss(dtensor_reads(toks), toks).backward(inputs=list(dtensor_reads.parameters()))
        assert all(p.grad is not None for p in dtensor_reads.parameters())


def test_a_step_with_a_closure_is_not_warned_of_missing_gradients(caplog):
    """``optimizer.step(closure)`` (LBFGS, or any optimizer stepped so) computes the gradients
    inside the step, after shardc's pre-step hook: the hook must not warn that no gradient
    reached the parameters (s75's probe: it did, with wrong advice). The step itself computes
    them (the closure's loss is returned, every ``.grad`` set)."""
    import logging

    toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with one_rank_mesh() as mesh:
        torch.manual_seed(0)
        model = shardc.shard(Transformer(CFG), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)

        def closure():
            opt.zero_grad()
            loss = llama_loss(model(toks), toks)
            loss.backward()
            return loss

        with caplog.at_level(logging.WARNING, logger="shardc"):
            loss = opt.step(closure)
        assert loss is not None and all(p.grad is not None for p in model.parameters())
        assert "found no gradient" not in caplog.text, caplog.text
