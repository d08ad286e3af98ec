"""Attention backends: base.py is the interface; torch_ref.py (CPU default) and triton.py (CUDA default)."""
