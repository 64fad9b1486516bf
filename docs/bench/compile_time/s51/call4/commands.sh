# s51 call 4 (issue 18): the peak prediction's cheaper flattening (main) against main before it
# (36b9ff6, unpacked in gpu_before/), packed rows alternated on one H200, each its own process
# with empty Inductor/Triton cache directories; the rows' "peak prediction" stage compares them.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
python3 -c "import torch; print(torch.__version__)" >> $R/machine.txt
for t in gpu_before .; do (cd $t && find shardc -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum | sed "s|-|$t/shardc|") >> $R/machine.txt; done
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime --caches cold --modes shardc-packed"
python3 -c "import torch; torch.ones(1, device='cuda')"
run() { (cd $1 && PYTHONPATH=$PWD timeout $4 python3 benchmarks/compile_time.py $B --out $R --name $2 --depths $3 > $R/$2.log 2>&1); echo "$2 rc=$?"; rm -rf $R/*_caches $R/*_logs; }
run . prime8 8 60
run gpu_before b64 64 80
run . a64 64 80
run . a8 8 50
run gpu_before b64b 64 80
run . a64b 64 80
run . a8b 8 50
for f in prime8 b64 a64 a8 b64b a64b a8b; do
  PYTHONPATH=$PWD python3 - $R/$f.json $f <<'PY'
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    d = run["record"]
    if "first_step_s" not in d: print(sys.argv[2], "error"); continue
    print(sys.argv[2], run["depth"], "first %.2f" % d["first_step_s"], d.get("stages_rank0_s"),
          "optimizer %.2f" % d["first_step_phases_s"]["optimizer"], "steady %.1f ms" % (1e3 * d["steady_step_s"]), d.get("loss"), d.get("plan_hashes"))
PY
done > $R/rows.txt 2>&1
cat $R/rows.txt; cat $R/machine.txt
cd $R && tar czf $OUT/call4.tgz *.json rows.txt machine.txt
