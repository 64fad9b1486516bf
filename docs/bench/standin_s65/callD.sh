# s65 call D (one GPU): the loss-layout probe at the final code (after 48a5bdd: outputs that view
# an operand), plain and with every block checkpointed.
# run from the repository root: bash docs/bench/standin_s65/callD.sh
source docs/bench/s61_not_run/prelude.sh
timeout 150 python3 docs/bench/standin_s65/loss_layouts.py inductor cuda > $R/loss_layouts_cuda.log 2>&1
echo "plain rc=$?"
CHECKPOINT=1 timeout 150 python3 docs/bench/standin_s65/loss_layouts.py inductor cuda > $R/loss_layouts_cuda_checkpointed.log 2>&1
echo "checkpointed rc=$?"
grep -v -i "warn" $R/loss_layouts_cuda.log $R/loss_layouts_cuda_checkpointed.log
