# s65 call C (one GPU): the loss-layout probe again at the final code (after c04cf6e's review
# mend: body_operand_layouts recomputes expand operands only).
# run from the repository root: bash docs/bench/standin_s65/callC.sh
source docs/bench/s61_not_run/prelude.sh
timeout 200 python3 docs/bench/standin_s65/loss_layouts.py inductor cuda > $R/loss_layouts_cuda.log 2>&1
echo "loss layouts rc=$?"
grep -v -i "warn" $R/loss_layouts_cuda.log
