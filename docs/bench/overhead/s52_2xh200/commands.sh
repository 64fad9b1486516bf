# s52 call 5 (2 x H200, the session's last 329 device seconds): issue 20's host-bound row (1b,
# 8 layers, batch 1 per GPU) with shardc's default local-shard optimizer step against every step
# through DTensor, beside the bound, one process per rank (torchrun); then issue 18's packed
# first step at 8 and 32 layers on 2 GPUs, cold, each its own process, as far as time allows.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; find shardc -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum) > $R/machine.txt
PYTHONPATH=$PWD timeout 170 torchrun --nproc-per-node 2 benchmarks/step_overhead.py --model 1b --n-layers 8 --batch 1 --modes bound shardc shardc-dtensoropt --steps 20 --profile-steps 1 --out $R --name so_w2_b1 > $R/so.log 2>&1; echo "so rc=$?"
grep -A6 "^| model | layers | batch | mode | step ms" $R/so_w2_b1.md | head -8
grep -A6 "python_subclass |" $R/so_w2_b1.md | head -6
B="--nproc 2 --model 1b --steps 3 --timeout-s 70 --no-prime --caches cold --modes shardc-packed"
for d in 8 32; do PYTHONPATH=$PWD timeout 75 python3 benchmarks/compile_time.py $B --out $R --name p$d --depths $d > $R/p$d.log 2>&1; echo "p$d rc=$?"; rm -rf $R/*_caches $R/*_logs; grep "cold" $R/p$d.md | head -2; done
