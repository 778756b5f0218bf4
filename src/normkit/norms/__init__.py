"""Activation normalization layers, one module per family."""
