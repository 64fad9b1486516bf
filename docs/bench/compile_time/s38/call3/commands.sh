# s38 call 3 (issue 18/20): the bucket-copy ops defined at the dispatcher's level
# (shardc/ops/runtime_op.py) instead of torch.library.custom_op. (1) host/device time per op call
# (gpu_ops.py), HEAD's package (gpu_pkgs/before: custom_op, a Python copy per tensor) against
# this tree's; (2) world-1 steps side by side in one process, alternating: shardc vs
# shardc-oneop (world 1's casts one cast_into per bucket), 1b 8L batch 1 and 4.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
for v in before main; do
  echo "== ops $v"; pkg=$PWD; [ $v = before ] && pkg=$PWD/gpu_pkgs/before
  PKG=$pkg python3 gpu_ops.py 2>&1 | tee $R/ops_$v.log | grep "us/call\|shardc from"
done
tb() {  # name, args
  local name=$1; shift
  echo "== $name $(date +%T)"
  timeout 250 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --profile-steps 0 --no-dump-plan --warmup 3 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\[.*(shardc|shardc-oneop): [0-9]" $R/$name.log | cut -c1-200
}
tb w1_8l_b1 --n-layers 8 --batch 1 --modes shardc shardc-oneop shardc shardc-oneop --steps 20
tb w1_8l_b4 --n-layers 8 --batch 4 --modes shardc-oneop shardc --steps 20
cd $OUT && tar czf c3.tgz r && rm -rf r
