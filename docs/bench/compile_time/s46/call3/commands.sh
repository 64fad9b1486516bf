# s46 call 3 (issue 18): main (7eeb02c's shardc/, the compile workers started at shard) again,
# a second sample of the rows of call 2 on another machine: packed 8 / 32 (cold and warm) / 64,
# a second 8, and fsdp2-compile at 32.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/new/") >> $R/machine.txt
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime"
python3 -c "import torch; torch.ones(1, device='cuda')"
PYTHONPATH=$PWD timeout 60 python3 benchmarks/compile_time.py $B --caches cold --out $R --name prime8 --depths 8 --modes shardc-packed > $R/prime8.log 2>&1; echo "prime rc=$?"
rm -rf $R/*_caches
new() { PYTHONPATH=$PWD timeout $3 python3 benchmarks/compile_time.py $B --caches $4 --out $R --name $1 --depths $2 --modes $5 > $R/$1.log 2>&1; echo "$1 rc=$?"; rm -rf $R/*_caches; }
new new8 8 50 cold shardc-packed
new f32 32 50 cold fsdp2-compile
new new32 32 80 "cold warm" shardc-packed
new new64 64 80 cold shardc-packed
new new8b 8 50 cold shardc-packed
rm -rf $R/*_logs
for f in prime8 new8 f32 new32 new64 new8b; do
  PYTHONPATH=$PWD python3 - $R/$f.json $f <<'PY'
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    d = run["record"]; t = d.get("torch_timed_s", {})
    if "first_step_s" not in d: print(sys.argv[2], "error"); continue
    print(sys.argv[2], run["depth"], run["mode"], run["cache"], "first %.2f setup %.2f import %.2f" % (d["first_step_s"], d["setup_s"], d["inductor_import_s"] or 0),
          {k: round(v, 2) for k, v in d["first_step_phases_s"].items()},
          {k: t.get(k) for k in ("async_compile.precompile", "bytecode_tracing", "create_aot_dispatcher_function", "compile_fx.<locals>.bw_compiler")},
          "steady %.1f ms" % (1e3 * d["steady_step_s"]), d.get("loss"), d.get("plan_hashes"))
PY
done
cd $OUT && tar czf r.tgz r && rm -rf r
