# s41 call 3 (issue 18): as ../call4/commands.sh (the same run() function and sampler), but
# recording stacks without op labels and running
#   run shardc 8 cold; run fsdp2-compile 8 cold; run shardc 32 cold; run shardc 32 warm
# (the 32-layer warm stacks are kept here). One H200, torch 2.11, main 06cfeb7.
