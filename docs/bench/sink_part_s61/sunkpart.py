"""Reproduce the sunk-part Inductor mismatch: sink forced, part candidates allowed for sunk bodies.
sunkpart.py REUSE(0/1)"""
import os, sys
HERE = os.path.dirname(os.path.abspath(__file__)); ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, ROOT + "/tests", HERE]

def worker(rank, world, reuse):
    import torch
    torch._inductor.config.allow_buffer_reuse = bool(reuse)
    from shardc.compile import budget_search as bs
    orig = bs.recompute_part_candidates
    class R:
        def __init__(self, r): self._r = r
        def __getattr__(self, k): return getattr(self._r, k)
        sunk_block_names = frozenset()
    def patched(probe, blocks, estimates, options, group, region, tag_prefix=""):
        return orig(probe, blocks, estimates, options, group, R(region), tag_prefix)
    bs.recompute_part_candidates = patched
    import test_recompute_part_ranks as t
    out = t._ranks(rank, world, False, True, True)
    return out

if __name__ == "__main__":
    import torch
    reuse = int(sys.argv[1])
    import test_recompute_part_ranks as t
    from dist_utils import run_ranks
    ref_losses, ref_params = t._reference()
    runs = run_ranks(worker, 2, reuse)
    r = runs[0]
    print("recomputed", r["recomputed"], "parts", r["parts"])
    print("notes", [n for n in r["notes"] if "sunk" in n])
    worst = max(((run["params"][k] - v).abs().max().item(), k) for run in runs for k, v in ref_params.items())
    print("loss diff", max((run["losses"] - ref_losses).abs().max().item() for run in runs), "worst param", worst)
