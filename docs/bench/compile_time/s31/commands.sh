# s31 (issue 18): where compile time stands on main: world 1, 1b config, each depth and mode its own process with empty caches (cold), then warm (the cold run's caches), plus fsdp2-compile cold; DEPTHS and FSDP2 from the environment
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
for d in $DEPTHS; do
  echo "== shardc d$d $(date +%T)"
  timeout 330 python3 benchmarks/compile_time.py --nproc 1 --model 1b --depths $d --modes shardc --caches cold warm --steps 2 --timeout-s 250 --out $R --name ct_s31_d$d > $R/ct_s31_d$d.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| *$d" $R/ct_s31_d$d.md | cut -c1-240
done
for d in $FSDP2; do
  echo "== fsdp2 d$d $(date +%T)"
  timeout 120 python3 benchmarks/compile_time.py --nproc 1 --model 1b --depths $d --modes fsdp2-compile --caches cold --steps 2 --timeout-s 100 --out $R --name ct_s31_fsdp2_d$d > $R/ct_s31_fsdp2_d$d.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| *$d" $R/ct_s31_fsdp2_d$d.md | cut -c1-240
done
cd $OUT && tar czf c1.tgz r && rm -rf r
