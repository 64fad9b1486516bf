# s61 call A1 (issue 18): one GPU, world 1, 1b, batch 4 x 2048, main b2654cd: cold compile rows, each its own process, empty caches, depths alternated
source docs/bench/s61_not_run/prelude.sh
run prime8 8 60 shardc-packed cold
run p8a 8 50 shardc-packed cold
run p32a 32 60 shardc-packed cold
run f32a 32 50 fsdp2-compile cold
run p64a 64 75 shardc-packed cold
run p8b 8 50 shardc-packed cold
run p32b 32 60 shardc-packed cold
rows prime8 p8a p32a f32a p64a p8b p32b > $R/rowsA1.txt 2>&1
cat $R/rowsA1.txt | cut -c1-330
cd $OUT && tar czf callA1.tgz r && rm -rf r
