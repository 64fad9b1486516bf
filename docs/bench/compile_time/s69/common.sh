# s69 (issue 18): before = main at 1c41695 (s67's end: shardc/ with change.patch reversed), after =
# this checkout (s68's one traced call per sunk body and call described at trace time, s69's call
# description as one number). The benchmark script is the same in both.
source docs/bench/s61_not_run/prelude.sh
HERE=$PWD; BEFORE=/tmp/before
if [ ! -d $BEFORE ]; then
  mkdir -p $BEFORE && cp -a shardc benchmarks docs tests scripts $BEFORE/ 2>/dev/null
  (cd $BEFORE && git apply -R $HERE/docs/bench/compile_time/s69/change.patch) || echo "REVERSE FAILED"
fi
(cd $BEFORE && LC_ALL=C bash -c "md5sum shardc/*/*.py shardc/*.py | md5sum") | sed 's/^/before /' >> $R/machine.txt
# a row of the after (this) tree, the before tree or FSDP2: tree name depth timeout mode
row() {
  local dir=$HERE; [ "$1" = before ] && dir=$BEFORE
  (cd $dir && PYTHONPATH=$dir timeout $4 python3 benchmarks/compile_time.py $B --caches cold \
    --out $R --name $2 --depths $3 --modes $5 > $R/$2.log 2>&1); echo "$2 rc=$? $(date +%T)"
  rm -rf $R/*_caches; }
rows2() {
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
    print(sys.argv[2], run["depth"], run["mode"], "first %.2f" % d["first_step_s"],
          {k: round(v, 2) for k, v in d["first_step_phases_s"].items()},
          {k: t.get(k) for k in ("bytecode_tracing", "build_guards", "ShardcPartitioner", "aot_trace_joint_graph", "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler")},
          "steady %.1f ms" % (1e3 * d["steady_step_s"]), "peak", d.get("steady_peak_allocated_bytes"),
          d.get("loss"), d.get("plan_hashes"))
PY
done
}
