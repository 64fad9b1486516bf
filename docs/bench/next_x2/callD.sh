# Issue 19, 2 GPUs: the predicted-against-measured matrix's 2-GPU meshes with the shipped h200
# preset (the 2 x H200 calibration), shardc as s19 ran it (blocks once, CUDA graphs, auto
# budget). The table is rebuilt anywhere afterwards with
#   python benchmarks/predict_matrix.py --merge-only --cpu-plans --out <the reports' directory>
source docs/bench/next_x2/common.sh
timeout 560 python3 benchmarks/predict_matrix.py --parts fsdp2,hsdp2x1,tp2,hsdp1x2 \
  --profile shardc/planning/profiles/h200.json --out $R --deadline-s 530 \
  -- --blocks-once --cudagraphs --memory-budget auto --steps 10 > $R/matrix_a.log 2>&1
echo "matrix rc=$? $(date +%T)"; tail -30 $R/matrix_a.log | cut -c1-250
cd $OUT && tar czf callD.tgz r && rm -rf r
