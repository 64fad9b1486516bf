"""shardc's custom ops: what a traced graph holds for a sharded parameter (and its argument
codec), and the communication pool's copies."""
