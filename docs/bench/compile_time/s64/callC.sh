# s64 call C (issue 18): one GPU, world 1, 1b, batch 4 x 2048: three alternated rounds of the
# packed cold first step at 8, 32 and 64 layers and FSDP2 + per-block compile at 32, each row its
# own process with empty caches (the s63 and s64 single rows spread by up to 42% per depth)
source docs/bench/s61_not_run/prelude.sh
run p8d 8 50 shardc-packed cold
run p32c 32 60 shardc-packed cold
run p64c 64 75 shardc-packed cold
run f32c 32 50 fsdp2-compile cold
run p8e 8 50 shardc-packed cold
run p64d 64 75 shardc-packed cold
run p32d 32 60 shardc-packed cold
run f32d 32 50 fsdp2-compile cold
run p8f 8 50 shardc-packed cold
run p64e 64 75 shardc-packed cold
run p32e 32 60 shardc-packed cold
rows p8d p32c p64c f32c p8e p64d p32d f32d p8f p64e p32e > $R/rowsC.txt 2>&1
cat $R/rowsC.txt | cut -c1-330
cd $OUT && tar czf callC.tgz r && rm -rf r
