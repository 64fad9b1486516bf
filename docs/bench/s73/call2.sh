# s73 call 2 (issue 20, world 1), as one inline command on the warm device: the cast variant at 32
# layers, two rounds. Ran out of device memory (three modes in one process on an H100, without
# expandable segments); call 3 ran it with them, one round. Only machine.txt kept (call2_machine.txt).
source docs/bench/s61_not_run/prelude.sh; (PYTHONPATH=$PWD/s73v/cast:$PWD timeout 250 torchrun --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers 32 --batch 4 --modes bound shardc shardc-budget --steps 12 --warmup 3 --rounds 2 --profile-steps 1 --top 24 --out $R --name cast32 > $R/cast32.log 2>&1); echo "cast32 rc=$? $(date +%T)"
