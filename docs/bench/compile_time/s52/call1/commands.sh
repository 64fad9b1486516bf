# s52 call 1 (issues 18, 20): main before this session (f704506, unpacked beside the tree as
# gpu_before/) and after (the default local-shard optimizer step and the body's direct
# substitution), alternated; packed 8 / 32 / 64 layers, fsdp2-compile 32, and 64 layers after
# with the default step turned off (--optimizer dtensor); one H200, world 1, the 1b config,
# each row its own process with empty Inductor/Triton cache directories.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
python3 -c "import torch; print(torch.__version__)" >> $R/machine.txt
for t in . gpu_before; do (cd $t && find shardc -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum | sed "s|-|$t/shardc|") >> $R/machine.txt; done
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime"
python3 -c "import torch; torch.ones(1, device='cuda')"
run() {  # name tree depth timeout mode [extra]
  (cd $2 && PYTHONPATH=$PWD timeout $4 python3 benchmarks/compile_time.py $B --caches cold --out $R --name $1 --depths $3 --modes $5 $6 > $R/$1.log 2>&1); echo "$1 rc=$?"; rm -rf $R/*_caches $R/*_logs; }
run prime8 . 8 60 shardc-packed
run a8 . 8 50 shardc-packed
run b8 gpu_before 8 50 shardc-packed
run a64 . 64 80 shardc-packed
run b64 gpu_before 64 80 shardc-packed
run a64dt . 64 80 shardc-packed "--optimizer dtensor"
run a32 . 32 60 shardc-packed
run f32 . 32 50 fsdp2-compile
run a8b . 8 50 shardc-packed
for f in prime8 a8 b8 a64 b64 a64dt a32 f32 a8b; do
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
cat $R/rows.txt; cat $R/machine.txt
cd $R && tar czf $OUT/call1.tgz *.json rows.txt machine.txt *.log
