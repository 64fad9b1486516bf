# s50: transformers' Qwen2 (tiny) first step, then a dynamic recompile (another sequence length),
# world 1, the 2-core CPU machine, torch 2.13, each row its own process with empty
# Inductor/Triton cache directories. "before": main at fce2fe2 (git archive in /tmp/s50/before),
# "after": the working tree of /work/main (symbolic stand-ins); the benchmark script is main's.
S=/work/main/benchmarks/hf_first_step.py
for round in 1 2; do
for mode in fx ind; do for L in 2 8; do for rev in before after; do
  if [ $rev = before ]; then PP=/tmp/s50/before; else PP=/work/main; fi
  export TORCHINDUCTOR_CACHE_DIR=/tmp/s50/c_$rev$mode$L TRITON_CACHE_DIR=/tmp/s50/t_$rev$mode$L
  rm -rf $TORCHINDUCTOR_CACHE_DIR $TRITON_CACHE_DIR
  echo "$round $rev $(cd /tmp && PORT=$((20000 + RANDOM % 20000)) PYTHONPATH=$PP /work/main/.venv/bin/python $S $L $mode plain dynamic 2>/dev/null | tail -1)"
done; done; done
done
