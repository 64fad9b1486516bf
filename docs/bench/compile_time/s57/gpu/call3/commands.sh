# s57 call 3 (issues 18, 20): the 8/64 packed compile rows again (each its own process, empty caches), then step_overhead at 16 layers batch 4 with shardc-fast-sink
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $R/machine.txt
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime"
run() {
  (timeout $3 python3 benchmarks/compile_time.py $B --caches $5 --out $R --name $1 --depths $2 --modes $4 > $R/$1.log 2>&1); echo "$1 rc=$? $(date +%T)"; rm -rf $R/*_caches $R/*_logs; }
run p8c 8 50 shardc-packed cold
run p64b 64 70 shardc-packed cold
run p8d 8 50 shardc-packed cold
run f32b 32 50 fsdp2-compile cold
for f in p8c p64b p8d f32b; do
  python3 -c "
import json, sys
for run in json.load(open('$R/$f.json'))['runs']:
    d = run['record']; print('$f', run['depth'], run['mode'], 'first %.2f' % d['first_step_s'], {k: round(v, 2) for k, v in d['first_step_phases_s'].items()})
"
done
timeout 260 python3 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 4 \
  --modes bound bound-cudagraphs shardc shardc-sink shardc-fast-sink --steps 15 --warmup 3 --rounds 3 --profile-steps 0 \
  --out $R --name so_fast16 > $R/so_fast16.log 2>&1; echo "so rc=$? $(date +%T)"
grep -E "^\|" $R/so_fast16.md | head -14 | cut -c1-180
cd $OUT && tar czf call3.tgz r && rm -rf r
