"""Graph passes and planners. Each module holds one concern and no global state."""
