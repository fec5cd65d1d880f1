"""The ragged contraction's alternative tile configurations, which
`sweep_configs.py --kernel contract` times beside the chosen one: their names (as the
sweep's JSON records them, and as readme_table.py orders its columns) and their fields.
Each is walked as the chosen config is; the sweep adds the chosen tiles walked the other
way ("chosen a-fastest" or "chosen b-fastest") and in the other cluster size ("chosen
cluster1" or "chosen cluster2")."""

ALTERNATIVES = {
    "128x192 k32 ab8 whole": dict(tile_n=192, tile_k=32, ab_stages=8, store_stages=6),
    "128x192 k64 ab4 whole": dict(tile_n=192, tile_k=64, ab_stages=4, store_stages=6),
    "128x256 k32 ab6 whole": dict(tile_n=256, tile_k=32, ab_stages=6, store_stages=8),
    "128x256 k32 ab7 ring3": dict(tile_n=256, tile_k=32, ab_stages=7, store_stages=3),
    "128x256 k32 ab8 ring2": dict(tile_n=256, tile_k=32, ab_stages=8, store_stages=2),
    "128x128 k32 ab8 whole": dict(tile_n=128, tile_k=32, ab_stages=8, store_stages=4),
}
