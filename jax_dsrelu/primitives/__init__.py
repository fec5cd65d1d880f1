"""The JAX primitives: their schemas, XLA references, lowering, batching, sharding and input checks."""
