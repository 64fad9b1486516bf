import time
from dist_utils import run_ranks

def on_rank(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh
    from harness import step
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for case in cases:
        try:
            bad, bodies = step(mesh, **case)
            out.append(f"{case} -> " + ("OK" if not bad else "BUG mismatch " + "; ".join(bad[:3])) + f" bodies={bodies}")
        except Exception as e:
            out.append(f"{case} -> BUG {type(e).__name__}: {str(e).strip().splitlines()[:2]}")
    return out

if __name__ == "__main__":
    cases = [dict(n=3, consumer="sum1"), dict(n=4, consumer="sumkd"), dict(n=5, consumer="sum01"),
             dict(n=3, consumer="tuple"), dict(n=4, consumer="side_sum"), dict(n=4, consumer="idx-1"),
             dict(n=4, consumer="sum1", mid={1: "expand"}), dict(n=4, consumer="sum", mid={0: "perm"}),
             dict(n=4, consumer="unsq_expand", kind="slice_out"),
             dict(n=3, consumer="sum1", sink=False), dict(n=4, consumer="bcast_w_t", inductor=True),
             dict(n=3, consumer="sum1", inductor=True), dict(n=4, consumer="sum1", mid={2: "expand"}, inductor=True)]
    t = time.time()
    res = run_ranks(on_rank, 2, cases)
    for line in res[0]:
        print(line)
    print("rank1 differs" if res[1] != res[0] else "rank1 same", time.time() - t)
