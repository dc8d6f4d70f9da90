"""Example third-party trainkit plugin."""
