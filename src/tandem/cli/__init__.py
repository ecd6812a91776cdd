"""tandem.cli."""
