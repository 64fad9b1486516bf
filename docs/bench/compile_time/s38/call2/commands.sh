# NOTE (read after the call): python3 gpu_ops.py puts the repository root first on sys.path, so
# ops_before.log timed this tree's ops too (both logs: main's code, custom_op registration); call 3
# repeats it with the package chosen by PKG. gpu_ops.py here called pool.<op>(...) (the custom_op
# objects); call 3's copy (in ../call3/) calls torch.ops.shardc.<op>.default.
# s38 call 2 (issue 18/20): the one-op copies' cost. (1) host/device time per op call, for one
# block's bucket of the 1b config (gpu_ops.py), HEAD's package (gpu_pkgs/before: Python copy per
# tensor) against this tree's (one _chunk_cat / split_with_sizes_copy / _foreach_copy_);
# (2) world-1 steps side by side in one process: shardc vs shardc-oneop (world 1's casts one
# cast_into per bucket), 1b 8L batch 1 and 4, 32L batch 4.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
BASE=$PYTHONPATH
for v in before main; do
  echo "== ops $v"; pp=$BASE; [ $v = before ] && pp=$PWD/gpu_pkgs/before:$BASE
  PYTHONPATH=$pp python3 gpu_ops.py 2>&1 | tee $R/ops_$v.log | grep us/call
done
tb() {  # name, args
  local name=$1; shift
  echo "== $name $(date +%T)"
  timeout 200 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --profile-steps 0 --no-dump-plan --warmup 3 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| (shardc|bound)" $R/$name.md | cut -c1-200
}
tb w1_8l_b1 --n-layers 8 --batch 1 --modes shardc shardc-oneop shardc --steps 20
tb w1_8l_b4 --n-layers 8 --batch 4 --modes shardc-oneop shardc --steps 20
tb w1_32l_b4 --n-layers 32 --batch 4 --modes shardc shardc-oneop --steps 12
cd $OUT && tar czf c2.tgz r && rm -rf r
