"""tandem.hybrid."""
