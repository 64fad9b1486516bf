# s61 call A2 (issue 18): same start as A1: more cold rows alternated, the default (per-parameter) mode, a warm restart at 32
source docs/bench/s61_not_run/prelude.sh
run f32b 32 50 fsdp2-compile cold
run p64b 64 75 shardc-packed cold
run p8c 8 50 shardc-packed cold
run u8 8 60 shardc cold
run u32 32 70 shardc cold
(timeout 150 python3 benchmarks/compile_time.py $B --caches cold warm --out $R --name w32 --depths 32 --modes shardc-packed > $R/w32.log 2>&1); echo "w32 rc=$? $(date +%T)"; rm -rf $R/*_caches $R/*_logs
rows f32b p64b p8c u8 u32 w32 > $R/rowsA2.txt 2>&1
cat $R/rowsA2.txt | cut -c1-330
cd $OUT && tar czf callA2.tgz r && rm -rf r
