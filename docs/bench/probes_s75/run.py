"""Driver: python run.py SCENARIOS WORLDS [fx|inductor|eager] [pack|nopack]"""
import sys
import time

if __name__ == "__main__":
    import probe
    import torch
    import torch._dynamo
    from dist_utils import run_ranks

    torch.set_num_threads(1)
    names = sys.argv[1].split(",")
    worlds = [int(w) for w in sys.argv[2].split(",")]
    mode = sys.argv[3] if len(sys.argv) > 3 else "fx"
    pack = {"pack": True, "nopack": False}.get(sys.argv[4] if len(sys.argv) > 4 else "", None)
    for name in names:
        sc = probe.SCENARIOS[name]
        ref = probe.reference(name)
        for world in worlds:
            if sc.varlen or sc.emulate:
                ref = probe.reference(name, world)
            t0 = time.time()
            try:
                got = run_ranks(probe.sharded_run, world, name, mode, pack)[0]
            except AssertionError as exc:
                print(f"{name} w{world} {mode}: CRASH {str(exc)[-3000:]}", flush=True)
                continue
            base = ref
            if base is None:  # mp: compare against the unpacked sharded run
                base = run_ranks(probe.sharded_run, world, name, mode, False)[0]
            ok, bad, worst = probe.compare(got, base, sc.tol)
            if "--vs-nopack" in sys.argv and pack is None and got["packed"]:
                unp = run_ranks(probe.sharded_run, world, name, mode, False)[0]
                same, diffs, w2 = probe.compare(got, unp, 0.0)
                print(f"  vs pack_blocks=False: {'BITWISE' if same else 'DIFFERS'} "
                      f"max rel {w2:.2e}", flush=True)
                for b in diffs[:8]:
                    print("   ", b, flush=True)
            print(f"{name} w{world} {mode} pack={pack}: {'PASS' if ok else 'FAIL'} "
                  f"max rel {worst:.2e} packed={got['packed']} unpacked={got['unpacked']} "
                  f"handed={got['handed']} ({time.time() - t0:.0f}s)", flush=True)
            for b in bad[:15]:
                print("   ", b, flush=True)
