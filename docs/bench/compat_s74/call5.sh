# s74 call 5: after the torch 2.11 fixes (sizes in the partitioned graphs, lazy conjugate views
# recomputed, symbolic views replayed), the GPU sweep again for llama4_text (failed in call 3)
# and seven families that share bodies across the dynamic-shape recompile, SGD and AdamW.
source docs/bench/s61_not_run/prelude.sh
export TORCH_WARM_POOL=0 TORCHINDUCTOR_COMPILE_THREADS=2
timeout 230 python3 docs/bench/compat_s74/hf_sweep_gpu.py --jobs 8 --opt sgd,adamw --timeout 220 \
  --logs $R/logs llama4_text llama qwen3 mixtral gpt_oss deepseek_v3 gemma3 olmoe \
  > $R/after.txt 2>&1; echo "after rc=$? $(date +%T)"
cat $R/after.txt
cd $OUT && tar czf call5.tgz r && rm -rf r
