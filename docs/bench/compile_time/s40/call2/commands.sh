# s40 call 2 (issue 18): a third pair at 8/32 layers, main first this time and 12 steady steps
# per row (call 1 had two: their median), 226a39c's package against main; main at 64
# layers; then the one-GPU tests of compiled regions at main's code.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc tests -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main shardc+tests/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
BASE=$PYTHONPATH
ct() {  # name, pythonpath, args...
  local name=$1 pp=$2; shift 2
  echo "== $name $(date +%T)"
  PYTHONPATH=$pp timeout 200 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 150 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  rm -rf $R/*_caches
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-220
}
ct main_3 $BASE --depths 8 32 --modes shardc --caches cold --steps 12
ct before_3 $PWD/gpu_pkgs/before:$BASE --depths 8 32 --modes shardc --caches cold --steps 12
ct main_64 $BASE --depths 64 --modes shardc --caches cold
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py tests/gpu/test_checkpoint_sdpa_gpu.py tests/gpu/test_activation_offload_gpu.py > $R/gpu_tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed|FAILED|ERROR" $R/gpu_tests.log | tail -8 | cut -c1-300
cd $OUT && tar czf c2.tgz r && rm -rf r

# What happened: the tests above ran out of their 150 s after 8 passed (they took 186 s in s39);
# they were run again with 280 s in call 3 (docs/bench/gpu_tests_s40/commands.sh).
