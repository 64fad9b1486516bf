# s52 call 2 (issues 18, 20): the optimizer's first and steady AdamW step over the 1b config's
# DTensor parameters, through DTensor and by shardc's default (the local shards), each depth
# and mode its own process; then the step overhead at world 1 (one process: bound, shardc with
# the default step, shardc with every step through DTensor). One H200, torch 2.11.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/machine.txt; nproc >> $R/machine.txt
python3 -c "import torch; print(torch.__version__)" >> $R/machine.txt
(find shardc -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum | sed "s|-|shardc|") >> $R/machine.txt
PYTHONPATH=$PWD timeout 200 python3 benchmarks/optimizer_first_step.py --device cuda --depths 8 32 64 --out $R --name optimizer_first_step_h200 2>&1 | tail -8
PYTHONPATH=$PWD timeout 330 python3 benchmarks/step_overhead.py --model 1b --n-layers 8 32 --modes bound shardc shardc-dtensoropt --steps 20 --out $R --name so_dtensoropt > $R/so.log 2>&1; echo "so rc=$?"
grep -A12 "^| layers\|^| mode" $R/so_dtensoropt.md | head -40
cd $R && tar czf $OUT/call2.tgz *.json *.md machine.txt so.log
