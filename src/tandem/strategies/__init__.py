"""tandem.strategies."""
