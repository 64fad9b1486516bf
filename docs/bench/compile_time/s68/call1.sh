# call 1: two alternated rounds, before (change.patch reversed) and after, each row its own
# process with empty caches; FSDP2 + per-block compile at 32 layers in the first round
source docs/bench/compile_time/s68/common.sh
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
rows2 b8a a8a b64a a64a a32a f32a a8b b8b a64b b64b > $R/rows1.txt 2>&1; cut -c1-300 $R/rows1.txt
cd $OUT && tar czf call1.tgz r && rm -rf r
