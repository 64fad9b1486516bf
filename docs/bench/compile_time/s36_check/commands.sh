# s36: two nvidia-h200 starts (torch 2.11). gpu_pkgs/flip/shardc = main 018e4ac's package with opaque_body_calls defaulted to True.
# call 1: gpu_chk36.sh (its pytest step forked ranks after CUDA was initialised: every test failed with 'Cannot re-initialize CUDA in forked subprocess', an artifact of running the CPU tests on a GPU host); call 2: gpu_chk36b.sh, CUDA hidden.
# s36 (issue 18): opaque_body_calls on torch 2.11: scripts/check_compile_once.py on the GPU with the
# switch defaulted on (gpu_pkgs/flip = main 018e4ac's package with opaque_body_calls=True), and
# tests/test_body_standin.py (CPU, gloo; it turns the switch on and off itself) at main 018e4ac.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
md5sum shardc/passes/body_standin.py shardc/ops/body_standin.py shardc/compile/backend.py gpu_pkgs/flip/shardc/compile/options.py shardc/compile/options.py >> $R/commit.txt
echo "== check_compile_once (switch on) $(date +%T)"
PYTHONPATH=$PWD/gpu_pkgs/flip:$PYTHONPATH SHARDC_LOG=info timeout 200 python3 scripts/check_compile_once.py > $R/check_on.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\{|OK|Error|assert|stand-in" $R/check_on.log | cut -c1-250 | tail -12
echo "== pytest test_body_standin $(date +%T)"
timeout 220 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_body_standin.py > $R/standin_tests.log 2>&1; echo "rc=$? $(date +%T)"
tail -3 $R/standin_tests.log | cut -c1-250
cd $OUT && tar czf chk36.tgz r && rm -rf r

# s36: tests/test_body_standin.py (CPU, gloo, torch 2.11) at main 018e4ac, CUDA hidden (the CPU tests fork).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
md5sum shardc/passes/body_standin.py shardc/ops/body_standin.py tests/test_body_standin.py > $R/commit.txt
python3 -c "import torch; print(torch.__version__)" >> $R/commit.txt
echo "== pytest test_body_standin $(date +%T)"
CUDA_VISIBLE_DEVICES= timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_body_standin.py > $R/standin_tests.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "passed|failed|FAILED" $R/standin_tests.log | tail -6 | cut -c1-250
cd $OUT && tar czf chk36b.tgz r && rm -rf r
