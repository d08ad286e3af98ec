"""pytest hooks: which instruction-set levels of the compiled kernels this run tested and skipped."""
