"""From a user's module to sharded DTensor parameters read through shardc's gather op."""
