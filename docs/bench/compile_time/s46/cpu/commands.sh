# s46 (issue 18): the first AdamW step over the DTensor parameters by parameter count, torch 2.13
# (.venv) and 2.11 (a CPU venv, /tmp/v211), against shardc.optim.local_shard_step; this 2-core
# machine, idle; each setting its own process. Output: first_optimizer_step.log.
# Run at main 77f47a2 (no change to what it times since 1c33e0d), this 2-core CPU machine, idle.
S=docs/bench/compile_time/s46/cpu/first_optimizer_step.py
for py in .venv/bin/python /tmp/v211/bin/python; do
  for n in 8 16 32 64; do
    PYTHONPATH=$PWD $py $S --blocks $n 2>&1 | grep "^torch"
    PYTHONPATH=$PWD $py $S --blocks $n --local 2>&1 | grep "^torch"
  done
done
