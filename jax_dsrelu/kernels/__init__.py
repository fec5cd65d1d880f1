"""GPU kernel backends. Nothing here imports CuTe DSL or cuDNN until a kernel is lowered."""
