# s74 call 4: call 3's fp32 mismatches (AdamW) against plain torch.compile of the unsharded model
# on the same GPU, and with SGD (AdamW's first steps move each element by about lr whatever its
# gradient's size, so a near-zero gradient's rounding shows); gptj with eager attention
# (transformers 5.17 has no SDPA for it).
source docs/bench/s61_not_run/prelude.sh
export TORCH_WARM_POOL=0 TORCHINDUCTOR_COMPILE_THREADS=2
F="granite glm4 phi deepseek_v3 granitemoe"
timeout 150 python3 docs/bench/compat_s74/hf_sweep_gpu.py --jobs 6 --opt adamw,sgd --timeout 140 \
  --plain-compile --logs $R/plain_logs $F > $R/plain.txt 2>&1; echo "plain rc=$? $(date +%T)"
cat $R/plain.txt
timeout 150 python3 docs/bench/compat_s74/hf_sweep_gpu.py --jobs 6 --opt sgd --timeout 140 --port 30100 \
  --eager gptj --logs $R/sgd_logs $F gptj > $R/sgd.txt 2>&1; echo "sgd rc=$? $(date +%T)"
cat $R/sgd.txt
cd $OUT && tar czf call4.tgz r && rm -rf r
