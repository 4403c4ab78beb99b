"""Quantized linear layers: schemes (no jax) and the layer (linear.py)."""
