"""The MoE layer around the expert MLP: its options and weights, checked once; routing, dispatch and
combine; the layer; expert parallelism; the Hugging Face NemotronH converter."""
