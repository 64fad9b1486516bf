# call 3 (the same warm machine): round 2, in the reverse order
source docs/bench/compile_time/s69/common.sh
row before b64b 64 75 shardc-packed
row after a64b 64 75 shardc-packed
row fsdp2 f32b 32 50 fsdp2-compile
row after a32b 32 60 shardc-packed
row before b8b 8 50 shardc-packed
row after a8b 8 50 shardc-packed
rows2 b64b a64b f32b a32b b8b a8b > $R/rows3.txt 2>&1; cut -c1-330 $R/rows3.txt
cd $OUT && tar czf call3.tgz r && rm -rf r
