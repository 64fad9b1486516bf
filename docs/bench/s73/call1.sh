# s73 call 1 (issue 20, world 1): the packed unpack as one split (its backward one cat;
# s73v/new) and that with the one-rank gradient cast moved into the body (s73v/cast) against
# main's slices (s73v/old); untracked copies of shardc carried to the device. 1b, batch 4, each
# variant in its own process with the bound in each.
source docs/bench/s61_not_run/prelude.sh
for v in old new cast; do (cd s73v/$v && LC_ALL=C md5sum shardc/*/*.py shardc/*.py | md5sum | sed "s/^/$v /") >> $R/machine.txt; done
so() {  # variant layers modes rounds name timeout
  (PYTHONPATH=$PWD/s73v/$1:$PWD timeout $6 torchrun --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers $2 --batch 4 --modes $3 \
    --steps 15 --warmup 3 --rounds $4 --profile-steps 1 --top 24 --out $R --name $5 > $R/$5.log 2>&1); echo "$5 rc=$? $(date +%T)"
  grep -E "^\| 1b" $R/$5.md | head -9; }
so cast 16 "bound shardc shardc-budget" 2 cast16 200
so old 16 "bound shardc" 2 old16 130
so cast 8 "bound shardc shardc-budget" 2 cast8 100
so new 16 "bound shardc" 2 new16 130
cd $OUT && tar czf call1.tgz r && rm -rf r
