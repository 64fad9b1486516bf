# C collation: the hash line below globs shardc/*.py, whose order (and so the hash) follows the
# locale; the device sets LC_ALL (s64), so the hash runs under LC_ALL=C
export LC_COLLATE=C
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(date -u; nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H; git status --short; LC_ALL=C bash -c "md5sum shardc/*/*.py shardc/*.py | md5sum") > $R/machine.txt
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime"
run() {  # name depth timeout mode caches
  (timeout $3 python3 benchmarks/compile_time.py $B --caches $5 --out $R --name $1 --depths $2 --modes $4 > $R/$1.log 2>&1); echo "$1 rc=$? $(date +%T)"; rm -rf $R/*_caches $R/*_logs; }
rows() {
for f in "$@"; do
  python3 - $R/$f.json $f <<'PY'
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"]
except Exception as e:
    print(sys.argv[2], "no json", e); sys.exit()
for run in runs:
    d = run["record"]; t = d.get("torch_timed_s", {})
    if "first_step_s" not in d: print(sys.argv[2], "error"); continue
    print(sys.argv[2], run["depth"], run["mode"], run["cache"], "first %.2f setup %.2f" % (d["first_step_s"], d["setup_s"]),
          {k: round(v, 2) for k, v in d["first_step_phases_s"].items()},
          {k: t.get(k) for k in ("bytecode_tracing", "build_guards", "create_aot_dispatcher_function", "ShardcPartitioner", "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler")},
          "steady %.1f ms" % (1e3 * d["steady_step_s"]), d.get("loss"), d.get("plan_hashes"))
PY
done
}
