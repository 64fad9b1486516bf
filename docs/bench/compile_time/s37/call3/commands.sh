# s37 call 3: one nvidia-h200 start, torch 2.11, main 5ea6ecf's tree (+ gpu_dyn.py, kept here). gpu_env.sh = docs/bench/predict/s21_default/commands.sh lines 2-6.
# s37 call 3: why a warm Dynamo trace is slower than a cold one (32 layers): Dynamo's compile_times, cold then warm.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
export TORCHINDUCTOR_CACHE_DIR=$R/cache/inductor TRITON_CACHE_DIR=$R/cache/triton
for c in cold warm; do echo "== $c $(date +%T)"; timeout 150 python3 gpu_dyn.py 32 > $R/dyn_$c.log 2>&1; echo "rc=$?"; grep -E "first step|Dynamo trace|compiled \(backend|Inductor" $R/dyn_$c.log; done
rm -rf $R/cache; cat gpu_dyn.py > $R/gpu_dyn.py; cp gpu_call3.sh $R/
