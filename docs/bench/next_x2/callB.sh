# Issue 20, 2 GPUs: the 1b config at batch 4, the wide config at batch 1 and 2 (callA's modes;
# eager fsdp2 last, so the deadline drops it first).
source docs/bench/next_x2/common.sh
tb 1b 4 x2_1b_b4 200 bound shardc shardc-cudagraphs fsdp2-compile simplefsdp fsdp2
tb wide 1 x2_wide_b1 170 bound shardc shardc-cudagraphs fsdp2-compile simplefsdp fsdp2
tb wide 2 x2_wide_b2 170 bound shardc shardc-cudagraphs fsdp2-compile simplefsdp fsdp2
cd $OUT && tar czf callB.tgz r && rm -rf r
