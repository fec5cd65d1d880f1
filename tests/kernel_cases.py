"""Problem shapes of the kernels' GPU tier, shared with the CPU self-checks of its bounds.

Kept apart from the GPU test modules, which skip without the GPU packages, so that
`test_tolerances.py` can show on any machine that the bounds reject wrong outputs at
exactly the shapes the kernels are held to.
"""

from __future__ import annotations

import numpy as np

GROUPINGS = {
    # name: (m, k, n, group sizes, or an expert count for Dirichlet-drawn sizes)
    "ragged_with_empty": (4096, 520, 320, [0, 700, 1, 0, 1500, 129, 1766, 0]),
    "short_of_m": (3000, 256, 384, [500, 0, 1200, 3]),
    "past_m": (2000, 128, 256, [900, 800, 700]),
    "negative": (2500, 192, 264, [-5, 1000, -1, 1300, 7]),
    "all_empty": (700, 64, 128, [0, 0, 0]),
    "one_row": (1, 64, 64, [1]),
    "tile_n_256": (16384, 1024, 2048, [3000, 0, 2500, 128, 4000, 1, 3755, 3000]),
    "rows_64k": (65536, 256, 1024, 32),
    # The most experts the sm90 kernels take, a few dozen rows each, many empty or short.
    "experts_512": (24000, 200, 328, 512),
    # Nemotron-3 Nano's expert width, no multiple of the 192-column tile (9 x 192 + 128),
    # over a k of 768 (the 256-expert shape's width), a few hundred rows per expert.
    "width_1856": (6000, 768, 1856, 16),
    # The 128- and 256-expert shapes' width: 4 tiles of 192, as many columns as 3 of 256.
    "width_768": (5000, 512, 768, 16),
}

# The largest of them: where a bound that grew with the problem would stop rejecting.
LARGEST = ["ragged_with_empty", "tile_n_256", "rows_64k"]


def grouping(name: str) -> tuple[int, int, int, list[int]]:
    """(m, k, n, group sizes) of a case."""
    m, k, n, sizes = GROUPINGS[name]
    if isinstance(sizes, int):
        sizes = dirichlet_sizes(m, sizes, seed=5)
    return m, k, n, sizes


def dirichlet_sizes(m: int, num_experts: int, seed: int) -> list[int]:
    """Group sizes of num_experts experts summing to m, drawn from a flat Dirichlet."""
    sizes = np.floor(np.random.default_rng(seed).dirichlet(np.ones(num_experts)) * m).astype(int)
    sizes[-1] += m - sizes.sum()
    return sizes.tolist()
