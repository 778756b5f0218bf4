"""Model-level operations: precise statistics, freezing, conversion."""
