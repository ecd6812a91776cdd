"""tandem.data."""
