# call 4 (the same machine if still warm): round 3, another order
source docs/bench/compile_time/s69/common.sh
row after a64c 64 75 shardc-packed
row before b8c 8 50 shardc-packed
row after a8c 8 50 shardc-packed
row fsdp2 f32c 32 50 fsdp2-compile
row before b64c 64 75 shardc-packed
row after a32c 32 60 shardc-packed
rows2 a64c b8c a8c f32c b64c a32c > $R/rows4.txt 2>&1; cut -c1-330 $R/rows4.txt
cd $OUT && tar czf call4.tgz r && rm -rf r
