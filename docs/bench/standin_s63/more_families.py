"""More transformers families (tiny random configs) through shardc (world 1, or WORLD ranks) with its default
backend (Inductor, blocks compiled once), three SGD steps against the unsharded model on a
loss of the logits (their log-sum-exp mean): prints per family the largest loss difference and
each region's bodies and inline blocks, or the failure's traceback. A probe, not a test:
``[WORLD=N] PYTHONPATH=$PWD python docs/bench/standin_s63/more_families.py [FAMILY ...]``
(the ranks' mean loss against the unsharded model's on the whole batch). Sixty-third
session: GPT-J failed before `4d5d805` ("Input-to-input aliasing detected at nodes sin and
cos"), every family here passed after it."""
import copy, os, sys, traceback, warnings, logging
import torch, torch.distributed as dist
FAM = {
 "bert": ("BertConfig", "BertForMaskedLM", dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)),
 "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64, pad_token_id=1)),
 "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, hidden_dim=48, dropout=0.0, attention_dropout=0.0, max_position_embeddings=64)),
 "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, max_position_embeddings=64, pad_token_id=0, global_attn_every_n_layers=1)),
 "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(vocab_size=64, embedding_size=32, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)),
 "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=64, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_positions=64)),
 "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=48, dropout=0.0, attention_dropout=0.0, max_position_embeddings=64, word_embed_proj_dim=32)),
 "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=64, hidden_size=32, n_layer=3, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
 "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=64, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_positions=64)),
 "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)),
 "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=64)),
}
def worker(rank, world, names):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29950))
    dist.init_process_group("gloo", rank=rank, world_size=world); torch.set_num_threads(1); warnings.filterwarnings("ignore")
    import transformers, shardc
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for name in names:
        try:
            c, m, f = FAM[name]; torch.manual_seed(0)
            cfg = getattr(transformers, c)(**f, attn_implementation="sdpa" if name not in ("gptj","bloom","deepseek_v3") else "eager")
            ref = getattr(transformers, m)(cfg).train(); model = copy.deepcopy(ref)
            shardc.shard(model, mesh); torch._dynamo.reset()
            fwd = torch.compile(model, backend=shardc.backend())
            g = torch.Generator().manual_seed(1); ld = 0.0
            ro = torch.optim.SGD(ref.parameters(), lr=0.1); o = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                ids = torch.randint(2, 60, (2*world, 9), generator=g)
                l0 = ref(input_ids=ids).logits.float().logsumexp(-1).mean(); l0.backward(); ro.step(); ro.zero_grad()
                p = slice(rank*2, rank*2+2)
                l = fwd(input_ids=ids[p]).logits.float().logsumexp(-1).mean(); l.backward(); o.step(); o.zero_grad()
                mean = l.detach().clone(); dist.all_reduce(mean)  # the global batch's loss
                ld = max(ld, abs(mean.item() / world - l0.item()))
            st = shardc.shard_state(model)
            line = f"loss diff {ld:.2e} bodies {[len(r.plan.bodies) if r.plan else None for r in st.regions]} inline {[len(r.plan.inline_blocks) if r.plan else None for r in st.regions]}"
        except Exception:
            line = "FAILED " + traceback.format_exc()
        if rank == 0: print(f"{name:12s} {line}", flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    import torch.multiprocessing as mp
    world = int(os.environ.get("WORLD", "1"))  # ranks (the batch grows with them)
    mp.spawn(worker, args=(world, sys.argv[1:] or list(FAM)), nprocs=world)
