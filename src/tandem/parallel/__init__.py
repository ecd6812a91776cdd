"""tandem.parallel."""
