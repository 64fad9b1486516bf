# s46 call 4 (issue 18): main (77f47a2) packed, cold, with compile_time.py --optimizer local
# (shardc.optim.local_shard_step) at 8 and 64 layers, and --optimizer torch at 64 beside them.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/new/") >> $R/machine.txt
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime --caches cold --modes shardc-packed"
python3 -c "import torch; torch.ones(1, device='cuda')"
run() { PYTHONPATH=$PWD timeout $3 python3 benchmarks/compile_time.py $B --optimizer $4 --out $R --name $1 --depths $2 > $R/$1.log 2>&1; echo "$1 rc=$?"; rm -rf $R/*_caches; }
run prime8 8 45 local
run local64 64 60 local
run torch64 64 60 torch
run local8 8 45 local
rm -rf $R/*_logs
for f in prime8 local64 torch64 local8; do
  PYTHONPATH=$PWD python3 - $R/$f.json $f <<'PY'
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    d = run["record"]
    print(sys.argv[2], run["depth"], "first %.2f" % d["first_step_s"], {k: round(v, 2) for k, v in d["first_step_phases_s"].items()},
          "precompile", d.get("torch_timed_s", {}).get("async_compile.precompile"), "steady %.1f ms" % (1e3 * d["steady_step_s"]), d.get("loss"))
PY
done
cd $OUT && tar czf r.tgz r && rm -rf r
