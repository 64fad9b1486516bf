"""Memory: the offset allocator, the communication pool's placement, the step's peak."""
