# Issue 20, 2 GPUs: the 1b config at batch 1 and 2 per GPU. The bound first, then shardc as it
# is by default (no CUDA graphs), shardc with CUDA graphs (mode="reduce-overhead"; every other
# host option is shardc's default since s53-s70), the three baselines. Goal: >= 0.97x the bound,
# faster than every baseline, peak not above default shardc's.
source docs/bench/next_x2/common.sh
tb 1b 1 x2_1b_b1 270 bound shardc shardc-cudagraphs fsdp2-compile simplefsdp fsdp2
tb 1b 2 x2_1b_b2 270 bound shardc shardc-cudagraphs fsdp2-compile simplefsdp fsdp2
cd $OUT && tar czf callA.tgz r && rm -rf r
