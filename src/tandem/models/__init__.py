"""tandem.models."""
