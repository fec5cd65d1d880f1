"""Opt-in runtime check of group sizes, with `jax.experimental.checkify`.

Bad group sizes are always safe (negative counts as 0, rows past m are ignored), but
usually a bug upstream. Call `check_group_sizes` inside a function transformed by
`checkify.checkify` to turn them into an error instead:

    checked = checkify.checkify(step)
    err, out = checked(params, batch)
    err.throw()
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jax_dsrelu import groups


def check_group_sizes(group_sizes: jax.Array, num_rows: int) -> None:
    """Records a checkify error unless every size is >= 0 and they sum to at most num_rows."""
    sizes = group_sizes.astype(jnp.int32)
    checkify.check(
        jnp.all(sizes >= 0),
        "group_sizes has a negative entry: {sizes}",
        sizes=sizes,
    )
    if sizes.shape[0] == 0:
        return
    # A saturating sum, capped one past num_rows: enough to tell, and never overflows.
    capped_total = groups.clamped_group_ends(sizes, num_rows + 1)[-1]
    checkify.check(
        capped_total <= num_rows,
        "group_sizes sum to more than the {rows} rows of the input",
        rows=jnp.int32(num_rows),
    )
