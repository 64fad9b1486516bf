# s51 call 3 (issue 18): main after this session's changes (3993659's shardc/), the goal rows
# with repeats: packed 8 (x3), 32 (cold + warm), 64 (x2), fsdp2-compile 32, default shardc 8 and
# 64; one H200, world 1, the 1b config, each row its own process with empty Inductor/Triton
# cache directories (the warm row reuses its cold row's).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
python3 -c "import torch; print(torch.__version__)" >> $R/machine.txt
(find shardc -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum | sed "s|-|shardc|") >> $R/machine.txt
B="--nproc 1 --model 1b --steps 3 --timeout-s 90 --no-prime"
python3 -c "import torch; torch.ones(1, device='cuda')"
run() { PYTHONPATH=$PWD timeout $3 python3 benchmarks/compile_time.py $B --caches $4 --out $R --name $1 --depths $2 --modes $5 > $R/$1.log 2>&1; echo "$1 rc=$?"; rm -rf $R/*_caches $R/*_logs; }
run prime8 8 60 cold shardc-packed
run p8a 8 50 cold shardc-packed
run p64a 64 80 cold shardc-packed
run f32 32 50 cold fsdp2-compile
run p32 32 90 "cold warm" shardc-packed
run p8b 8 50 cold shardc-packed
run p64b 64 80 cold shardc-packed
run d8 8 50 cold shardc
run d64 64 90 cold shardc
run p8c 8 50 cold shardc-packed
for f in prime8 p8a p64a f32 p32 p8b p64b d8 d64 p8c; do
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
cd $R && tar czf $OUT/call3.tgz *.json rows.txt machine.txt
