# s74 call 3: the transformers sweep on one GPU (world 1, NCCL, Inductor with Triton kernels),
# fp32 against the unsharded eager model, AdamW, then bf16 mixed precision as a smoke check.
source docs/bench/s61_not_run/prelude.sh
export TORCH_WARM_POOL=0 TORCHINDUCTOR_COMPILE_THREADS=2
python3 -c "import transformers; print('transformers', transformers.__version__)"
timeout 330 python3 docs/bench/compat_s74/hf_sweep_gpu.py --jobs 8 --opt adamw --timeout 300 \
  --logs $R/fp32_logs > $R/gpu_fp32.txt 2>&1; echo "fp32 rc=$? $(date +%T)"
cat $R/gpu_fp32.txt
timeout 240 python3 docs/bench/compat_s74/hf_sweep_gpu.py --jobs 8 --opt adamw --timeout 220 --bf16 \
  --port 30050 --logs $R/bf16_logs > $R/gpu_bf16.txt 2>&1; echo "bf16 rc=$? $(date +%T)"
cat $R/gpu_bf16.txt
cd $OUT && tar czf call3.tgz r && rm -rf r
