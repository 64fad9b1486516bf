# s54 call 2 (issues 18, 20): one H200, world 1, 1b config, batch 4 x 2048, main eea830e+ (plain reads default)
# (a) train_bench 32 layers: shardc (per-parameter reads) vs shardc-packed, one process: step and peak
# (b) compile_time rows, each its own process, empty Inductor/Triton caches: packed 8/32/64, shardc 8/32, fsdp2-compile 32, packed 32 warm
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; find shardc -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum; git log -1 --format=%H) > $R/machine.txt
timeout 170 python3 benchmarks/train_bench.py --model 1b --n-layers 32 --modes shardc shardc-packed --steps 10 --warmup 3 --out $R --name tb32 > $R/tb32.log 2>&1; echo "tb rc=$?"
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime"
run() {  # name depth timeout mode caches
  (PYTHONPATH=$PWD timeout $3 python3 benchmarks/compile_time.py $B --caches $5 --out $R --name $1 --depths $2 --modes $4 > $R/$1.log 2>&1); echo "$1 rc=$?"; rm -rf $R/*_caches $R/*_logs; }
run prime8 8 60 shardc-packed cold
run p8 8 50 shardc-packed cold
run u8 8 50 shardc cold
run p32 32 80 shardc-packed "cold warm"
run u32 32 60 shardc cold
run f32 32 50 fsdp2-compile cold
run p64 64 70 shardc-packed cold
run p8b 8 50 shardc-packed cold
for f in prime8 p8 u8 p32 u32 f32 p64 p8b; do
  PYTHONPATH=$PWD python3 - $R/$f.json $f <<'PY'
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    d = run["record"]; t = d.get("torch_timed_s", {})
    if "first_step_s" not in d: print(sys.argv[2], "error"); continue
    print(sys.argv[2], run["depth"], run["mode"], run["cache"], "first %.2f setup %.2f" % (d["first_step_s"], d["setup_s"]),
          {k: round(v, 2) for k, v in d["first_step_phases_s"].items()},
          {k: t.get(k) for k in ("bytecode_tracing", "build_guards", "create_aot_dispatcher_function", "ShardcPartitioner", "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler")},
          "steady %.1f ms" % (1e3 * d["steady_step_s"]), d.get("loss"), d.get("plan_hashes"))
PY
done > $R/rows.txt 2>&1
cat $R/rows.txt; cat $R/tb32.md 2>/dev/null | head -30; cat $R/machine.txt
cd $R && tar czf $OUT/call2.tgz *.json *.md rows.txt machine.txt *.log
