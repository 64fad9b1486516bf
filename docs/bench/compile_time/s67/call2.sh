# call 2: rounds 2 and 3 (alternated orders)
source docs/bench/compile_time/s67/common.sh
row after a8b 8 50 shardc-packed
row before b8b 8 50 shardc-packed
row after a64b 64 75 shardc-packed
row before b64b 64 75 shardc-packed
row after f32b 32 50 fsdp2-compile
row after a32b 32 60 shardc-packed
row before b8c 8 50 shardc-packed
row after a8c 8 50 shardc-packed
row before b64c 64 75 shardc-packed
row after a64c 64 75 shardc-packed
row after a32c 32 60 shardc-packed
rows2 a8b b8b a64b b64b f32b a32b b8c a8c b64c a64c a32c > $R/rows2.txt 2>&1; cut -c1-400 $R/rows2.txt
cd $OUT && tar czf call2.tgz r && rm -rf r
