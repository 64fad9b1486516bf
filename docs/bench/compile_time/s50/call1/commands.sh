# s50 call 1 (issue 18): main's compile-time goal rows again after s47-s49's changes to
# sharding/blocks.py (member bodies, skeletons): packed 8 / 32 (cold and warm) / 64, default
# shardc 8 / 32, fsdp2-compile at 32; one H200, world 1, the 1b config, each row its own
# process with empty Inductor/Triton cache directories (the warm row reuses its cold row's).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $R/machine.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/shardc/") >> $R/machine.txt
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime"
python3 -c "import torch; torch.ones(1, device='cuda')"
run() { PYTHONPATH=$PWD timeout $3 python3 benchmarks/compile_time.py $B --caches $4 --out $R --name $1 --depths $2 --modes $5 > $R/$1.log 2>&1; echo "$1 rc=$?"; rm -rf $R/*_caches; }
run prime8 8 60 cold shardc-packed
run p8 8 50 cold shardc-packed
run f32 32 50 cold fsdp2-compile
run p32 32 80 "cold warm" shardc-packed
run p64 64 80 cold shardc-packed
run d8 8 50 cold shardc
run d32 32 80 cold shardc
run p8b 8 50 cold shardc-packed
rm -rf $R/*_logs
for f in prime8 p8 f32 p32 p64 d8 d32 p8b; do
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
cat $R/machine.txt
