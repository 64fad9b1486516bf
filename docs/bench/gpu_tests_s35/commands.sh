# GPU tests and diagnostics of the thirty-fifth session (one nvidia-h200 start per call, torch 2.11).
# gpu_env.sh: docs/bench/predict/s21_default/commands.sh (lines 2-6). The device's .git is stale; each call's
# commit.txt has the checksum of shardc/optim/step_in_backward.py (main 3ecac3a: dd2d9402...; main 36d3f00: 5a28a369...).
# variants/: gpu_var/det.py, and diag.patch: gpu_var/diag.py against 3ecac3a's file (a log per worker batch, DIAG_SYNC); gpu_var/old.py
# was 36d3f00's file, gpu_var/new.py 3ecac3a's.

# call 1: gpu_t35.sh
# s35: the GPU offload tests at main 3ecac3a (step_in_backward's worker on plain stand-ins). The device's .git is stale;
# commit.txt has the checksum of shardc/optim/step_in_backward.py (main 3ecac3a: dd2d9402...).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
md5sum shardc/optim/step_in_backward.py >> $R/commit.txt
echo "== tests $(date +%T)"
timeout 540 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_gpu.py > $R/gpu_tests.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "passed|failed|FAILED|ERROR" $R/gpu_tests.log | tail -15 | cut -c1-300
cd $OUT && tar czf t35.tgz r && rm -rf r

# call 2: gpu_diag.sh
# s35 diagnostic: tests/gpu/test_offload_gpu.py::test_step_in_backward_equals_the_plain_offload_step[inductor]
# with step_in_backward.py variants copied into place: new (main 3ecac3a), diag (new + a log of
# the events per worker batch; DIAG_SYNC=1: torch.cuda.synchronize() before each worker step),
# old (main 36d3f00, DTensor stand-ins).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; md5sum gpu_var/*.py shardc/optim/step_in_backward.py >> $R/commit.txt
T="tests/gpu/test_offload_gpu.py::test_step_in_backward_equals_the_plain_offload_step[inductor]"
one() {  # name variant [env]
  local name=$1 var=$2; shift 2
  cp gpu_var/$var.py shardc/optim/step_in_backward.py
  echo "== $name $(date +%T)"
  env DIAG_LOG=$R/$name.diag "$@" timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider "$T" > $R/$name.log 2>&1
  echo "rc=$? $(date +%T)"; tail -1 $R/$name.log
  [ -f $R/$name.diag ] && sort $R/$name.diag | uniq -c | head -5
}
cp gpu_var/new.py shardc/optim/step_in_backward.py
echo "== det (new) $(date +%T)"
timeout 200 python3 gpu_var/det.py > $R/det_new.log 2>&1; echo "rc=$? $(date +%T)"; grep differ $R/det_new.log
cp gpu_var/old.py shardc/optim/step_in_backward.py
echo "== det (old) $(date +%T)"
timeout 200 python3 gpu_var/det.py > $R/det_old.log 2>&1; echo "rc=$? $(date +%T)"; grep differ $R/det_old.log
one diag_sync diag DIAG_SYNC=1
cd $OUT && tar czf diag.tgz r && rm -rf r

# call 3: gpu_diag2.sh
# s35 diagnostic 2: the whole tests/gpu/test_offload_gpu.py twice with step_in_backward.py = gpu_var/diag.py
# (main 3ecac3a's + a log of the copy events each worker batch waits for; no extra sync).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; md5sum gpu_var/*.py shardc/optim/step_in_backward.py >> $R/commit.txt
cp gpu_var/diag.py shardc/optim/step_in_backward.py
for i in 1 2; do
  echo "== full_$i $(date +%T)"
  DIAG_LOG=$R/full_$i.diag timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_gpu.py > $R/full_$i.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "passed|failed|FAILED" $R/full_$i.log | tail -3 | cut -c1-200
  sort $R/full_$i.diag | uniq -c | head -8
done
cd $OUT && tar czf diag2.tgz r && rm -rf r
