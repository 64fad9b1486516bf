# s43: transformers' Qwen2 (tiny) first step, world 1, this 2-core CPU, torch 2.13; "before" is
# 330f980's shardc (a git worktree at /tmp/wt_before, put first on PYTHONPATH), "after" ab567b6's.
# Each row its own process; Inductor rows with an empty TORCHINDUCTOR_CACHE_DIR.
S=/work/main/benchmarks/hf_first_step.py
for rev in before after; do
  if [ $rev = before ]; then PP=/tmp/wt_before; else PP=/work/main; fi
  for mode in fx ind; do for L in 2 8; do
    export TORCHINDUCTOR_CACHE_DIR=/tmp/hfc_$rev$mode$L TRITON_CACHE_DIR=/tmp/hfct_$rev$mode$L
    rm -rf $TORCHINDUCTOR_CACHE_DIR $TRITON_CACHE_DIR
    echo "$rev $(PORT=$((20000 + RANDOM % 20000)) PYTHONPATH=$PP python $S $L $mode plain 2>/dev/null | tail -1)"
  done; done
done
for L in 2 8; do echo "after $(PORT=$((20000 + RANDOM % 20000)) PYTHONPATH=/work/main python $S $L fx packed 2>/dev/null | tail -1)"; done
