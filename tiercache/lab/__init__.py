"""Policy lab: block-access traces, replay and comparison."""
