# Call 1 of the session: gpu1() in ../lb_h200_s26/commands.sh (b4_never, b4_always)
