# s72 call 6 (issue 20): Inductor's generated code for the bound and shardc (2 layers of the 1b
# llama, batch 1): the body kernels behind shardc's +1.7 ms/step of fused kernels at 16 layers.
source docs/bench/s61_not_run/prelude.sh
for m in bound shardc; do TORCH_LOGS=output_code timeout 100 python3 docs/bench/s72/oc_probe.py $m > $R/oc_$m.log 2>&1; echo "$m rc=$? $(date +%T)"; gzip $R/oc_$m.log; done
cd $OUT && tar czf call6.tgz r && rm -rf r
