"""Monitor plugins: what a run measures about itself while it trains (`trainkit.analysis` reads it)."""
