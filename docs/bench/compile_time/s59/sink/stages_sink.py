"""s57 stages.py with SINK=auto|0 (sink_block_residual): stages.py N packed(0/1) [world]"""
import os, sys, tempfile, time
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
os.environ["SHARDC_LOG"] = "info"
import torch, torch.distributed as dist, torch.multiprocessing as mp
ROOT = os.getcwd()
def run(rank, world, n, pack, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sys.path[:0] = [ROOT, ROOT + "/benchmarks"]
    if os.environ.get("NOKEY"):  # probe: torch 2.11's trace-once path (opaque later calls)
        from shardc import _torch as T
        T.keyed_compile_region = lambda fn: None
    import bench_mesh
    from train.runner import train_step
    from train.shardc_mode import setup_shardc
    from train.workload import build_model, model_config, synthetic_batches
    cfg = model_config("1b", 32, True, n)
    data = synthetic_batches(1, 2, 32, cfg.vocab_size, rank, torch.device("cpu"))
    setup = setup_shardc(build_model(cfg, torch.device("cpu")), bench_mesh.build_mesh("cpu", world, None, 1), True, pack_blocks=pack, inductor=True, sink_block_residual={"auto": "auto", "0": False}[os.environ.get("SINK", "auto")])
    opt = torch.optim.AdamW(setup.params, lr=1e-4)
    t = time.perf_counter(); train_step(setup, opt, *data[0])
    if rank == 0: print(f"FIRST STEP {n} blocks pack={pack}: {time.perf_counter() - t:.2f} s", flush=True)
    if rank == 0 and os.environ.get("NOTES"):
        import shardc
        for pl in shardc.explain_all(setup.keep[0]):
            print("PEAK", pl.predicted.get("peak_bytes"), [x for x in pl.notes if "donat" in x])
    dist.destroy_process_group()
if __name__ == "__main__":
    n, pack = int(sys.argv[1]), sys.argv[2] == "1"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    mp.spawn(run, args=(world, n, pack, 29600 + os.getpid() % 1000), nprocs=world)
