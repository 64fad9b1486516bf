# The script that made these reports (call 3 of the nineteenth session, gpu_c3.sh, with the
# device set-up gpu_env.sh) is recorded once, in docs/bench/overhead/s19_2xh200/commands.sh:
# its first half ran predict_step.py here, its second half the world-1 peaks there.
