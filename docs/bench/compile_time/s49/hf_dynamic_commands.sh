# s49: transformers' Qwen2 (tiny) first step and then a dynamic recompile (another sequence
# length), world 1, the 2-core CPU machine, torch 2.13, each row its own process with empty
# Inductor/Triton cache directories. "before": main at abbc41c (/work/main), "after": branch
# dyn-member-bodies at 8a88b23 (/work/wt-dyn); the benchmark script is the after's in both.
S=/work/wt-dyn/benchmarks/hf_first_step.py
for round in 1 2; do
for mode in fx ind; do for L in 2 8; do for rev in before after; do
  if [ $rev = before ]; then PP=/work/main; else PP=/work/wt-dyn; fi
  export TORCHINDUCTOR_CACHE_DIR=/tmp/hfd_$rev$mode$L TRITON_CACHE_DIR=/tmp/hfdt_$rev$mode$L
  rm -rf $TORCHINDUCTOR_CACHE_DIR $TRITON_CACHE_DIR
  echo "$round $rev $(PORT=$((20000 + RANDOM % 20000)) PYTHONPATH=$PP /work/main/.venv/bin/python $S $L $mode plain dynamic 2>/dev/null | tail -1)"
done; done; done
done
