"""The MoE layer around the expert MLP: routing, dispatch and combine, the layer, expert parallelism."""
