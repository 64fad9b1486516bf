# Sourced by each call of this directory (from the checkout's root, on nvidia-h200-x2 or
# nvidia-h100-x2): the device set-up of docs/bench/s61_not_run/prelude.sh ($R, machine.txt with
# the tree's hash: the device's .git is stale) and the train_bench row helper of s20's calls.
source docs/bench/s61_not_run/prelude.sh
tb() {  # model batch name timeout modes... : one train_bench run over 2 ranks, modes in order
  local m=$1 b=$2 n=$3 t=$4; shift 4
  echo "== $n $(date +%T)"
  timeout $t torchrun --nproc-per-node 2 benchmarks/train_bench.py --model $m --batch $b \
    --modes "$@" --steps 12 --warmup 3 --profile-steps 2 --no-dump-plan \
    --deadline-s $((t-25)) --mode-estimate-s 50 --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "Error|rror:" $R/$n.log | tail -4 | cut -c1-300
  grep -E "^\| (shardc|bound|fsdp|simple)" $R/$n.md | cut -c1-200
}
