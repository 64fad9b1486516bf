"""Runtime pieces: sharded parameters, collectives, the buffer pool, FP8 and checkpoint hooks."""
