# call 1: rounds 1 and 2, before (change.patch reversed) and after alternated, each row its own
# process with empty caches; FSDP2 + per-block compile at 32 layers once per round
source docs/bench/compile_time/s67/common.sh
row before b8a 8 50 shardc-packed
row after a8a 8 50 shardc-packed
row before b64a 64 75 shardc-packed
row after a64a 64 75 shardc-packed
row after a32a 32 60 shardc-packed
row after f32a 32 50 fsdp2-compile
row after a8b 8 50 shardc-packed
row before b8b 8 50 shardc-packed
row after a64b 64 75 shardc-packed
row before b64b 64 75 shardc-packed
row after f32b 32 50 fsdp2-compile
row after a32b 32 60 shardc-packed
rows2 b8a a8a b64a a64a a32a f32a a8b b8b a64b b64b f32b a32b > $R/rows1.txt 2>&1; cut -c1-300 $R/rows1.txt
cd $OUT && tar czf call1.tgz r && rm -rf r
