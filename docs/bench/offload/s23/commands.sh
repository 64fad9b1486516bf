# The GPU test logs of this folder come from three calls of the twenty-third session; each call's
# script is kept once, beside the results it made:
# - test_offload_gpu.log: call 1 (machine start A, main 9f8050e exactly), its first step:
#   docs/bench/predict/s23_fp8_rswait/commands.sh (gpu_1.sh).
# - test_budget_alone.log: call 2 (start A), its first step:
#   docs/bench/budget/offload_wide_h200_s23/commands.sh (gpu_2.sh).
# - the allocator history of the failing budget test: call 3 (start B, main 658cfc3's code),
#   its last step: docs/bench/predict/s23_probe/commands.sh (gpu_3.sh), which runs
#   docs/bench/budget/optoff_peak_s23/gpu_snap.py.
# gpu_env.sh (sourced by every call): docs/bench/predict/s21_default/commands.sh
