# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_1.sh (call 1, machine start A; ran main 9f8050e exactly: commit.txt)
# s23 call 1 (issues 22, 19/20): world-1 CPU-offload GPU tests on cast22's code (the offload copies' casts as shardc::offload_copy_cast, CPU-checked only until now); then FP8's reduce-scatter wait past small buckets against the default rule, interleaved in one process per rank (step_overhead --rounds 3), default mode and the fast (CUDA graphs) mode, 1b 8L batch 4 FP8 at world 2
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== offload gpu tests $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py > $R/test_offload_gpu.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/test_offload_gpu.log
for pair in "shardc shardc-rswait" "shardc-fast shardc-fast-rswait"; do
  n=fp8_$(echo $pair | cut -d' ' -f1)
  echo "== $n $(date +%T)"
  timeout 195 torchrun --nproc-per-node 2 benchmarks/step_overhead.py --model 1b --n-layers 8 --batch 4 --fp8 --modes $pair --rounds 3 --steps 12 --out $R --name $n > $R/$n.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| " $R/$n.md | head -8 | cut -c1-220
done
cd $OUT && tar czf c1.tgz r && rm -rf r
