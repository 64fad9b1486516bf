# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# CPU runs (this 2-core machine, idle, before any helper started):
# for i in 1 2; do .venv/bin/python benchmarks/compile_time.py --nproc 2 --device cpu --tiny --depths 2 16 --modes shardc shardc-oneop --caches cold --steps 1 --timeout-s 600 --out /tmp/ct22 --name ct_cpu_s22_idle_$i; done

# gpu_1.sh (call 1)
# s22 call 1 (issue 18): one_op_bucket_copies' step time against default shardc, side by side in one process per rank: world 2 (1b 8L batch 1 and 4), world 1 (1b 16L batch 4); then the cold compile of both at 8 layers, world 1, each in its own process with empty caches
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
for b in 1 4; do
  echo "== w2 b$b $(date +%T)"
  timeout 150 torchrun --nproc-per-node 2 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b --modes shardc shardc-oneop --steps 15 --warmup 3 --profile-steps 0 --no-dump-plan --out $R --name oneop_w2_b$b > $R/oneop_w2_b$b.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| (shardc)" $R/oneop_w2_b$b.md | cut -c1-220
done
echo "== w1 16L b4 $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 16 --batch 4 --modes shardc shardc-oneop --steps 12 --warmup 3 --profile-steps 0 --no-dump-plan --out $R --name oneop_w1_16l > $R/oneop_w1_16l.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| (shardc)" $R/oneop_w1_16l.md | cut -c1-220
echo "== compile 8L cold $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/compile_time.py --nproc 1 --model 1b --depths 8 --modes shardc shardc-oneop --caches cold --steps 3 --timeout-s 80 --out $R --name ct_w1_8l > $R/ct_w1_8l.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| 8" $R/ct_w1_8l.md | cut -c1-200
cd $OUT && tar czf c1.tgz r && rm -rf r
