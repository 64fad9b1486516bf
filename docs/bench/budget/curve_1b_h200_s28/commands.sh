# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# Calls 1 and 2 of the twenty-eighth session: gpu_1.sh of ../curve_wide_h200_s28/commands.sh, twice (this 1b sweep on GPU 1)
