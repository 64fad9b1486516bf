"""Counts the bytecode instructions Dynamo interprets, per code object, while a script runs (an
analysis aid; it patches Dynamo's interpreter step in its own process only). s51's per-block
counts: ``PYTHONPATH=$PWD python docs/bench/compile_time/s51/count_instr.py
docs/bench/compile_time/s51/stage.py 8 fx packed`` against 4 blocks, divided by 4."""
import collections
import runpy
import sys

import torch._dynamo.symbolic_convert as sc

counts = collections.Counter()
orig = sc.InstructionTranslatorBase.step
def step(self):
    code = self.f_code
    counts[(code.co_filename.split("site-packages/")[-1].replace("/work/main/", ""), code.co_name)] += 1
    return orig(self)
sc.InstructionTranslatorBase.step = step
import atexit


def dump():
    tot = sum(counts.values())
    print("TOTAL", tot)
    for k, v in counts.most_common(40):
        print(f"{v:7d} {k[0]}:{k[1]}")
atexit.register(dump)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
