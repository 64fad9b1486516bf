"""What runs at step time: the eager collectives, gradient accumulation without sync, the
cross-rank plan check and the errors of failing collectives."""
