# s51 call 1 (issue 18): the layout check outside Dynamo's trace (e7954cb) against main before
# it (27decf0, unpacked in gpu_before/), packed rows alternated, each its own process with empty
# Inductor/Triton cache directories; fsdp2-compile at 32 layers in the same call; then a
# cProfile of the packed first step at 8 and 64 layers (scripts/profile_compile.py, after).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
python3 -c "import torch; print(torch.__version__)" >> $R/machine.txt
for t in gpu_before .; do (cd $t && find shardc -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum | sed "s|-|$t/shardc|") >> $R/machine.txt; done
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime --caches cold"
python3 -c "import torch; torch.ones(1, device='cuda')"
run() { (cd $1 && PYTHONPATH=$PWD timeout $4 python3 benchmarks/compile_time.py $B --out $R --name $2 --depths $3 --modes $5 > $R/$2.log 2>&1); echo "$2 rc=$?"; rm -rf $R/*_caches $R/*_logs; }
run gpu_before prime8 8 60 shardc-packed
run . a8 8 50 shardc-packed
run gpu_before b8 8 50 shardc-packed
run . a64 64 80 shardc-packed
run gpu_before b64 64 80 shardc-packed
run . a32 32 70 shardc-packed
run . f32 32 50 fsdp2-compile
run gpu_before b32 32 70 shardc-packed
run . a8b 8 50 shardc-packed
PYTHONPATH=$PWD timeout 150 python3 scripts/profile_compile.py --device cuda --blocks 8 64 --pack-blocks --out $R/prof > $R/prof.log 2>&1; echo "prof rc=$?"
for f in prime8 a8 b8 a64 b64 a32 f32 b32 a8b; do
  PYTHONPATH=$PWD python3 - $R/$f.json $f <<'PY'
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    d = run["record"]; t = d.get("torch_timed_s", {})
    if "first_step_s" not in d: print(sys.argv[2], "error"); continue
    print(sys.argv[2], run["depth"], run["mode"], "first %.2f setup %.2f" % (d["first_step_s"], d["setup_s"]),
          {k: round(v, 2) for k, v in d["first_step_phases_s"].items()},
          {k: t.get(k) for k in ("bytecode_tracing", "build_guards", "create_aot_dispatcher_function", "ShardcPartitioner", "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler")},
          "steady %.1f ms" % (1e3 * d["steady_step_s"]), d.get("loss"), d.get("plan_hashes"))
PY
done > $R/rows.txt 2>&1
cat $R/rows.txt; cat $R/machine.txt; tail -40 $R/prof.log
cd $R && tar czf $OUT/call1.tgz . 
