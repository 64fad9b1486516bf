"""s75 control: the unsharded reference trained through plain torch.compile (no shardc) against
the eager reference, for a scenario of probe.py; tells torch's compile numerics from shardc's.

Run: cd <worktree> && PYTHONPATH=.:tests:docs/bench/probes_s75 python docs/bench/probes_s75/control_compile.py
SCENARIO EMU_WORLD [inductor|aot_eager]
"""
import sys

import torch

import probe

if __name__ == "__main__":
    torch.set_num_threads(1)
    name, world = sys.argv[1], int(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "inductor"
    sc = probe.SCENARIOS[name]
    ref = probe.reference(name, world)
    model = probe.build(sc)
    got = probe.train(model, torch.compile(model, backend=backend), sc, 0, 1, False,
                      emu_world=world)
    ok, bad, worst = probe.compare(got, ref, sc.tol)
    print(f"{name} emulated world {world}: plain torch.compile({backend}) vs eager: "
          f"{'PASS' if ok else 'FAIL'} max rel {worst:.2e}", flush=True)
    for b in bad[:10]:
        print("   ", b, flush=True)
