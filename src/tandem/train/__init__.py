"""tandem.train."""
