# The compile-time rows here came from the second half of gpu_c2.sh, recorded with the whole
# script in docs/bench/predict/s18_2xh200/commands.sh (call 2 of the eighteenth session).
