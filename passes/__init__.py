"""hoad's passes: capture, differentiate, prune, clean, lower, hoist, choose, plan and compile (see hoad.pipeline)."""
