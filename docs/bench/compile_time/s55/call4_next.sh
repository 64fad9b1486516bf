# Kept for the next GPU session (s55 had none): the step of packed blocks against the
# per-parameter reads, the question left before packed blocks can be shard's default (issue 18:
# step and peak within 1%; s54 measured world 1 at batch 4 only). Modes compiled first, all
# alive at once, then timed in rounds whose order reverses every other round.
# Dry-run on the CPU machine (s55): ... --device cpu --tiny --width 32 --n-layers 4 --batch 1
#   --modes bound shardc shardc-packed --steps 3 --warmup 1 --rounds 2 --profile-steps 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $OUT/machine.txt
# one GPU (nvidia-h200): world 1, 16 layers, batch 1 and 4
timeout 560 python3 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 1 4 \
  --modes bound shardc shardc-packed --steps 15 --warmup 3 --rounds 3 --profile-steps 1 \
  --out $OUT --name so_packed_w1 > $OUT/so_packed_w1.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\|" $OUT/so_packed_w1.md | head -12 | cut -c1-200
# two GPUs (nvidia-h200-x2, a call of its own): the same at world 2, batch 1, 2 and 4
# timeout 560 torchrun --nproc-per-node 2 benchmarks/step_overhead.py --model 1b --n-layers 16 \
#   --batch 1 2 4 --modes bound shardc shardc-packed --steps 15 --warmup 3 --rounds 3 \
#   --profile-steps 1 --out $OUT --name so_packed_w2 > $OUT/so_packed_w2.log 2>&1
