"""The Hopper (SM90) backend: a fused grouped GEMM + dsReLU kernel written in CuTe DSL."""
