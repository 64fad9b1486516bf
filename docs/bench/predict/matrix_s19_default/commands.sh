# The script that made these reports (call 5 of the nineteenth session, gpu_c5.sh, with the
# device set-up gpu_env.sh) is recorded once, in docs/bench/overhead/s19_2xh200/commands.sh:
# its second half ran predict_matrix.py --parts fsdp2 here, its first half the world-1 rows there.
