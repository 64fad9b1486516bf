"""Decisions: buckets, the schedule, the cost model and its simulation, and the plan record."""
