# CPU measurements of the collector pause (2-core CPU machine, Python 3.11, torch 2.13 CPU),
# run from /tmp with this script; ROOT is the checkout whose shardc/ and benchmarks/ run.
# gctime.py ROOT BLOCKS [BUDGET_BYTES]: one gloo rank, the benchmarks' tiny llama with BLOCKS
# packed blocks, one first training step; prints the SHARDC_LOG stage lines, the first step's
# seconds, the garbage collector's collections and seconds per generation (gc.callbacks) and
# the peak RSS. GCV=A|B|D (experiment only) pauses the partitioner / _compile_region /
# _compile_region and the Inductor compiles of an unpaused tree by wrapping them; IND=0: FX.
# before = fc3fc6d (worktree /tmp/wt_head: only the peak prediction paused), after = main.
# variants_64.log: two rounds of H (before), A, B, D at 64 blocks, Inductor.
for r in 1 2; do for v in H A B D; do GCV=$([ $v = H ] || echo $v) python gctime.py /tmp/wt_head 64; done; done
# before_after_64.log: before and after (ffb72a5's tree) alternated, two rounds.
for r in 1 2; do for v in /tmp/wt_head /work/main; do python gctime.py $v 64; done; done
# The budget rows (not kept as logs; quoted in ../summary.md): FX backend, 64 blocks,
# a 950 MB peak budget, before, main paused whole (ffb72a5), main with e2cc211.
IND=0 python gctime.py /tmp/wt_head 64 9.5e8; IND=0 python gctime.py /work/main 64 9.5e8
