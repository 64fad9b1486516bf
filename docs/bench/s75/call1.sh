# s75 call 1: s74's torch 2.11 fixes on a GPU (the sweep s74's call 5 could not run): llama4_text
# (failed in s74's call 3) and seven families that share bodies across the dynamic-shape
# recompile, plus dbrx (fixed after s74's call 4), SGD and AdamW; then s75's dropout bodies on
# CUDA (dropout_cuda.py).
source docs/bench/s61_not_run/prelude.sh
export TORCH_WARM_POOL=0 TORCHINDUCTOR_COMPILE_THREADS=2
timeout 250 python3 docs/bench/compat_s74/hf_sweep_gpu.py --jobs 9 --opt sgd,adamw --timeout 230 \
  --logs $R/logs llama4_text llama qwen3 mixtral gpt_oss deepseek_v3 gemma3 olmoe dbrx \
  > $R/after.txt 2>&1; echo "after rc=$? $(date +%T)"
cat $R/after.txt
(PYTHONPATH=$PWD:$PWD/tests timeout 150 python3 docs/bench/s75/dropout_cuda.py > $R/dropout_cuda.log 2>&1); echo "dropout rc=$? $(date +%T)"
grep -v Warning $R/dropout_cuda.log | tail -8
cd $OUT && tar czf call1.tgz r && rm -rf r
