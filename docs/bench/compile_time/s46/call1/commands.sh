# s46 call 1 (issue 18): when Inductor's compile-worker pool starts. Rows alternate the
# benchmark's SHARDC_BENCH_WARM: "" (today: the pool wakes when compile_fx starts), "setup"
# (started before the model is built), "step" (as the first step begins). gpu_exp/ = main + the
# benchmark switch only.
source gpu_env.sh
cd gpu_exp; export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
B="--nproc 1 --model 1b --steps 3 --caches cold --timeout-s 80 --no-prime"
python3 -c "import torch; torch.ones(1, device='cuda')"
timeout 80 python3 benchmarks/compile_time.py $B --out $R --name prime8 --depths 8 --modes shardc-packed > $R/prime8.log 2>&1; echo "prime rc=$?"
rm -rf $R/*_caches
run() {  # name warm depth mode
  SHARDC_BENCH_WARM=$2 timeout 85 python3 benchmarks/compile_time.py $B --out $R --name $1 --depths $3 --modes $4 > $R/$1.log 2>&1; echo "$1 rc=$?"
  rm -rf $R/*_caches
}
run p8_none "" 8 shardc-packed
run p8_setup setup 8 shardc-packed
run p8_step step 8 shardc-packed
run p32_none "" 32 shardc-packed
run p32_setup setup 32 shardc-packed
run p32_step step 32 shardc-packed
run f32_none "" 32 fsdp2-compile
run f32_setup setup 32 fsdp2-compile
rm -rf $R/*_logs
for f in p8_none p8_setup p8_step p32_none p32_setup p32_step f32_none f32_setup; do
  python3 - $R/$f.json $f <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["runs"][0]["record"]; t = d.get("torch_timed_s", {})
print(sys.argv[2], "first %.2f setup %.2f import %.2f" % (d["first_step_s"], d["setup_s"], d["inductor_import_s"]), d["first_step_phases_s"],
      {k: t.get(k) for k in ("async_compile.precompile", "async_compile.wait", "bytecode_tracing", "create_aot_dispatcher_function", "compile_fx.<locals>.bw_compiler")}, d.get("loss"))
PY
done
cd $OUT && tar czf r.tgz r && rm -rf r
