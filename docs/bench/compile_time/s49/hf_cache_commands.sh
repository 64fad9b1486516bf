# s49: transformers' Qwen2 (tiny) called with its default cache (use_cache left on), first step
# and a dynamic recompile, world 1, the 2-core CPU machine, torch 2.13, each row its own process
# with empty Inductor/Triton cache directories; "before": main at abbc41c (a worktree at
# /tmp/wt_before), "after": main's shardc/ at this commit; the benchmark script is this
# commit's in both (copied to /tmp/hf_first_step_s49.py). The slow test tier ran beside it (load).
S=/tmp/hf_first_step_s49.py
for round in 1 2; do
for mode in fx ind; do for rev in before after; do
  if [ $rev = before ]; then PP=/tmp/wt_before; else PP=/work/main; fi
  export TORCHINDUCTOR_CACHE_DIR=/tmp/hfc_$rev$mode$round TRITON_CACHE_DIR=/tmp/hfct_$rev$mode$round
  rm -rf $TORCHINDUCTOR_CACHE_DIR $TRITON_CACHE_DIR
  echo "$round $rev $(cd /tmp && PORT=$((20000 + RANDOM % 20000)) PYTHONPATH=$PP /work/main/.venv/bin/python $S 8 $mode plain dynamic cache 2>/dev/null | tail -1)"
done; done
done
