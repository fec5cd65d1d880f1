"""The MoE layer around the expert MLP: its options and weights, checked once, and how its entry
points take them (whole or as keywords); routing, dispatch and combine; the layer; expert
parallelism; the Hugging Face NemotronH converter."""
