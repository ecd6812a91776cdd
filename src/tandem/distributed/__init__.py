"""tandem.distributed."""
