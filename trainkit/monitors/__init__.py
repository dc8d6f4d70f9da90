"""Monitor plugins: what a run measures about itself, and the bottleneck report built from it."""
