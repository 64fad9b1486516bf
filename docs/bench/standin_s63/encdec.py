"""transformers encoder-decoder models (tiny random configs) through shardc at world N, against
the same model unsharded; prints per family the largest loss and parameter differences after
three SGD steps and whether a region was compiled twice (its block body stand-ins refused).
A probe, not a test:

    PYTHONPATH=$PWD python docs/bench/standin_s63/encdec.py [--world N] [--inductor] [FAMILY ...]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAMILIES = {
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=3,
                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=64, d_model=32, encoder_layers=3, decoder_layers=3,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                  decoder_ffn_dim=48, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                  max_position_embeddings=64, pad_token_id=1)),
    "marian": ("MarianConfig", "MarianMTModel",
               dict(vocab_size=64, d_model=32, encoder_layers=3, decoder_layers=3,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                    decoder_ffn_dim=48, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, max_position_embeddings=64, pad_token_id=63,
                    decoder_start_token_id=63)),
}
PER_RANK = 2


def _loss(model, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=src, decoder_input_ids=tgt[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt[:, 1:].flatten())


def _family(name: str, rank: int, world: int, mesh, inductor: bool) -> str:
    import transformers

    import shardc

    config_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**fields, attn_implementation="sdpa")
    reference = getattr(transformers, model_cls)(config).train()
    model = copy.deepcopy(reference)
    shardc.shard(model, mesh)
    torch._dynamo.reset()
    forward = torch.compile(model, backend=shardc.backend(inductor=inductor))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    loss_diff = 0.0
    for _ in range(3):
        src = torch.randint(2, 60, (world * PER_RANK, 11), generator=generator)
        tgt = torch.randint(2, 60, (world * PER_RANK, 9), generator=generator)
        ref_loss = _loss(reference, src, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = _loss(forward, src[part], tgt[part])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_diff = max(loss_diff, abs(mean.item() / world - ref_loss.item()))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}
    ref = reference.state_dict()
    param_diff = max((full[k].float() - ref[k].float()).abs().max().item() for k in ref)
    state = shardc.shard_state(model)
    bodies = [len(r.plan.bodies) if r.plan is not None else None for r in state.regions]
    stand_ins = [len(r.stand_ins or ()) for r in state.regions]
    return (f"loss diff {loss_diff:.2e} param diff {param_diff:.2e} bodies {bodies} "
            f"stand-ins {stand_ins}")


def _worker(rank: int, world: int, names: list[str], inductor: bool, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    refused: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: refused.append(record.getMessage()) \
        if "stand-ins do not fit" in record.getMessage() else None
    logging.getLogger("shardc").addHandler(handler)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for name in names:
        refused.clear()
        try:
            line = _family(name, rank, world, mesh, inductor)
            line += f" compiled again: {len(refused)}"
            if refused:
                line += f" ({refused[0].split('(', 1)[1][:160]})"
        except Exception:
            line = "FAILED " + (traceback.format_exc() if os.environ.get("FULL_TB") else traceback.format_exc(limit=-3).replace("\n", " | ")[-600:])
        if rank == 0:
            print(f"{name:8s} {line}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    mp.spawn(_worker, args=(args.world, args.families, args.inductor, 29900 + os.getpid() % 90),
             nprocs=args.world)


if __name__ == "__main__":
    main()
