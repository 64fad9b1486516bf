# s65 call B (one GPU): the loss-layout probe (nine losses, Inductor) and the transformers
# families (world 1, Inductor) on CUDA, at main with the two s65 fixes.
# run from the repository root: bash docs/bench/standin_s65/callB.sh
source docs/bench/s61_not_run/prelude.sh
timeout 200 python3 docs/bench/standin_s65/loss_layouts.py inductor cuda > $R/loss_layouts_cuda.log 2>&1
echo "loss layouts rc=$?"
timeout 330 python3 docs/bench/standin_s65/families_cuda.py cuda > $R/families_cuda.log 2>&1
echo "families rc=$?"
grep -v -i "warn" $R/loss_layouts_cuda.log; grep -E "^[a-z_0-9]+ +(loss|FAILED)" $R/families_cuda.log
