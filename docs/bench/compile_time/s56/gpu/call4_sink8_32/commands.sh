# s56 call 4 (issue 20), the machine start of calls 1-3, run from the checkout (prelude as in ../call1_sink16/commands.sh):
timeout 500 python3 benchmarks/step_overhead.py --model 1b --n-layers 8 32 --batch 4 \
  --modes bound shardc shardc-sink shardc-packed-sink --steps 15 --warmup 3 --rounds 3 --profile-steps 1 \
  --out $OUT/r --name so_sink_8_32
