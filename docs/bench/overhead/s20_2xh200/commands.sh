# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# gpu_a.sh
# s20 call A (issue 20): two H200s, the 1b config at batch 1 and 2 per GPU: the bound, shardc-fast-sink (CUDA graphs, plain inputs, local step, sunk residual, every bucket resharded: no kept buckets), the three baselines, default shardc last (its peak)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
tb() { # model batch name timeout modes...
  local m=$1 b=$2 n=$3 t=$4; shift 4
  echo "== $n $(date +%T)"
  timeout $t torchrun --nproc-per-node 2 benchmarks/train_bench.py --model $m --batch $b --modes "$@" \
    --steps 12 --warmup 3 --profile-steps 2 --no-dump-plan --deadline-s $((t-25)) --mode-estimate-s 50 --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "Error|rror:" $R/$n.log | tail -4 | cut -c1-300
  grep -E "^\| (shardc|bound|fsdp|simple)" $R/$n.md | cut -c1-200
}
tb 1b 1 fs_1b_b1 285 bound shardc-fast-sink fsdp2-compile simplefsdp fsdp2 shardc
tb 1b 2 fs_1b_b2 285 bound shardc-fast-sink fsdp2-compile simplefsdp fsdp2 shardc
cd $OUT && tar czf a.tgz r && rm -rf r

# gpu_b.sh
# s20 call B (issue 20): two H200s, the wide config at batch 1, 2 and 4 per GPU: gpu_a.sh with its two `tb 1b` rows replaced by these three, and the archive named b.tgz
tb wide 1 fs_wide_b1 178 bound shardc-fast-sink fsdp2-compile simplefsdp fsdp2 shardc
tb wide 2 fs_wide_b2 178 bound shardc-fast-sink fsdp2-compile simplefsdp fsdp2 shardc
tb wide 4 fs_wide_b4 178 bound shardc-fast-sink fsdp2-compile simplefsdp fsdp2 shardc

# gpu_c.sh
# s20 call C (issue 20): two H200s, the 1b config at batch 4 per GPU (the modes of calls A and B); then world 1, one process per GPU at once: 1b 32 layers (GPU 0) and 16 layers (GPU 1, a second run), batch 4: the bound, shardc-fast-sink, default shardc
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== fs_1b_b4 $(date +%T)"
timeout 235 torchrun --nproc-per-node 2 benchmarks/train_bench.py --model 1b --batch 4 --modes bound shardc-fast-sink fsdp2-compile simplefsdp fsdp2 shardc \
  --steps 12 --warmup 3 --profile-steps 2 --no-dump-plan --deadline-s 225 --mode-estimate-s 30 --out $R --name fs_1b_b4 > $R/fs_1b_b4.log 2>&1
echo "rc=$? $(date +%T)"; grep -E "Error|rror:" $R/fs_1b_b4.log | tail -4 | cut -c1-300
grep -E "^\| (shardc|bound|fsdp|simple)" $R/fs_1b_b4.md | cut -c1-200
echo "== world 1 $(date +%T)"
for L in 32 16; do
  G=$([ $L = 32 ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$G timeout 335 torchrun --master-port 2960$G --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers $L --batch 4 --modes bound shardc-fast-sink shardc --steps 10 --warmup 3 --profile-steps 0 --no-dump-plan --deadline-s 325 --mode-estimate-s 60 --out $R --name w1_${L}l > $R/w1_${L}l.log 2>&1 &
done
wait; echo "done $(date +%T)"
for L in 32 16; do grep -E "^\| (bound|shardc)" $R/w1_${L}l.md | head -3 | cut -c1-200; done
cd $OUT && tar czf c.tgz r && rm -rf r

# gpu_d.sh
# s20 call D (issue 20): world 1, interleaved rounds (each mode compiled once, then rounds of timed steps in turn): 1b 16 layers (GPU 0) and 8 layers (GPU 1), batch 4: the bound, shardc-fast-sink, default shardc
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
for L in 16 8; do
  G=$([ $L = 16 ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$G timeout 320 torchrun --master-port 2960$G --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers $L --modes bound shardc-fast-sink shardc --rounds 3 --steps 10 --warmup 3 --out $R --name so_${L}l > $R/so_${L}l.log 2>&1 &
done
wait; echo "done $(date +%T)"
for L in 16 8; do grep -E "^\| 1b \| (8|16) " $R/so_${L}l.md | head -4 | cut -c1-200; done
cd $OUT && tar czf d.tgz r && rm -rf r

