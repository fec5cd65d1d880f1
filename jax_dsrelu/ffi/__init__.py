"""What talks to XLA's FFI: the custom-call bridge to `cutlass.jax` and the kernel disk cache."""
