"""The Blackwell (SM100) backend: cuDNN's block-scaled grouped GEMM + dsReLU kernel."""
