# s69 call 1 (issue 18): where the per-block first-step seconds go on a GPU host. A wall-clock
# cProfile of the first step at 8 and 32 blocks (self times per function, differenced per block),
# and Inductor's output code at 4 blocks (which kernels the outer graphs generate per block).
source docs/bench/s61_not_run/prelude.sh
# the machine's first process is slow (s68): a throwaway one first
(timeout 120 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 2 --pack-blocks \
  --out $R/warm > $R/warm.log 2>&1; echo "warm rc=$? $(date +%T)"); rm -rf $R/warm
(timeout 240 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 8 32 --pack-blocks \
  --out $R/prof > $R/prof.log 2>&1; echo "profile rc=$? $(date +%T)"); tail -22 $R/prof.log | cut -c1-120
(TORCH_LOGS=output_code timeout 150 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 4 \
  --pack-blocks --out $R/oc > $R/oc.log 2>&1; echo "output code rc=$? $(date +%T)"); rm -rf $R/oc
ls -la $R $R/prof
cd $OUT && tar czf call1.tgz r && rm -rf r
