"""How the library's primitives partition under `jax.jit` with sharded operands.

Each primitive's `jax_dsrelu.primitive_schema.Schema` names the dimensions of its operands and
results; the rules below read nothing else, so every primitive partitions the same way:

- rows (m) sharded over any mesh axes (data parallel): each device runs its rows with
  its local group sizes, cut from the global ones at its row offset; row-indexed results
  stay sharded like the rows; a row index (of a gathered operand) is split like the
  rows, and the source it reads from is kept whole, since any row may read any token;
- any other dimension that is not kept whole (n, the expert hidden dimension; a and b,
  the sides of a ragged contraction) may be sharded over other axes (tensor parallel);
  results keep those dimensions sharded;
- a result that lacks a split dimension (dprob lacks n; dbias, amax and a contraction's
  (E, a, b) lack m) is combined from the per-shard partials as its schema says: sums
  gather the partials and add them in shard order, so they are bitwise reproducible
  whatever the collective's algorithm; max is exact, so it uses pmax.

Dimensions a schema keeps whole (the contraction k before a nonlinear epilogue, the
experts e of a ragged, row-ordered layout) are gathered when an operand is sharded along
them. Expert parallelism (experts on different devices, tokens moved by all-to-all) is
expressed with `jax.shard_map`, where each device calls the primitive on its own experts'
rows; there these rules step aside.

`split_over_leading_axis` partitions a computation that is no primitive (the expert
weights' quantizing pass, the rows' quantizing pass) the simple way: every operand split
as the first one's leading axis is, every other axis whole.

Two mechanisms apply the same rules:
- Auto mesh axes: the lowering is wrapped in `jax.experimental.custom_partitioning`, so
  the SPMD partitioner runs the computation on each device's shard (`partitioned`).
  Outside a multi-device partitioned computation (one device, or inside a fully manual
  shard_map) custom_partitioning runs the local computation as it is.
- Explicit mesh axes (the default of `jax.make_mesh`): shardings are part of the types,
  known at trace time, so the primitive is bound inside a `jax.shard_map` over those
  axes (`explicit_shard_map`), whose out-shardings follow the operands'.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jax_dsrelu import groups
from jax_dsrelu.primitive_schema import GROUP_SIZES, ROWS, Schema

# (operand avals, static params) -> the function computing the results on one device.
LocalImplementation = Callable[[Sequence[Any], Mapping[str, Any]], Callable[..., Sequence[jax.Array]]]
FactorAxes = dict[str, tuple[str, ...]]


def partitioned(
    schema: Schema,
    params: Mapping[str, Any],
    local_implementation: LocalImplementation,
    operand_avals: Sequence[Any],
) -> Callable[..., Sequence[jax.Array]]:
    """The primitive's computation, partitionable by the SPMD partitioner.

    `local_implementation(avals, params)` returns the function that computes the outputs
    for operands of those shapes on one device; it is asked again for each shard's
    shapes, so a backend can decide on the shapes it really gets.
    """
    operand_fields = schema.operand_fields(params)
    result_fields = schema.result_fields(params)
    num_rows = schema.dim_sizes([a.shape for a in operand_avals], params)[ROWS]
    operand_dims = [" ".join(f.letters(params)) for f in operand_fields]
    result_dims = [" ".join(f.letters(params)) for f in result_fields]
    letters = " ".join(operand_dims).split()
    whole = schema.whole(params)

    @custom_partitioning
    def computation(*operands):
        return tuple(local_implementation([jax.typeof(x) for x in operands], params)(*operands))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        specs = [_spec(shape.sharding, len(shape.shape)) for shape in arg_shapes]
        axes = factor_axes(schema, params, specs)

        def sharding_of(field) -> NamedSharding:
            return NamedSharding(mesh, spec_of(field, params, axes))

        arg_shardings = tuple(sharding_of(f) for f in operand_fields)
        result_shardings = tuple(sharding_of(f) for f in result_fields)
        lower_fn = local_computation(schema, params, local_implementation, axes, num_rows)
        return mesh, lower_fn, result_shardings, arg_shardings

    computation.def_partition(
        partition=partition,
        sharding_rule=", ".join(operand_dims) + " -> " + ", ".join(result_dims),
        # In the order the factors first appear in the rule, as Shardy requires.
        need_replication_factors=tuple(dict.fromkeys(f for f in letters if f in whole)),
    )
    return computation


def factor_axes(
    schema: Schema, params: Mapping[str, Any], specs: Sequence[tuple], usable: frozenset | None = None
) -> FactorAxes:
    """The mesh axes each splittable dimension is split over, read from the operands'
    partition specs (the first operand that splits a dimension decides; an axis serves
    one dimension only). `usable` limits the axes considered."""
    axes: FactorAxes = {}
    taken: set[str] = set()
    whole = schema.whole(params)
    for field, spec in zip(schema.operand_fields(params), specs):
        for letter, entry in zip(field.letters(params), spec):
            if letter in whole or axes.get(letter):
                continue
            chosen = tuple(
                a for a in _axes(entry) if a not in taken and (usable is None or a in usable)
            )
            if chosen:
                axes[letter] = chosen
                taken.update(chosen)
    return axes


def spec_of(field, params: Mapping[str, Any], axes: FactorAxes) -> PartitionSpec:
    return PartitionSpec(*(_entry(axes.get(letter, ())) for letter in field.letters(params)))


def local_computation(
    schema: Schema,
    params: Mapping[str, Any],
    local_implementation: LocalImplementation,
    axes: FactorAxes,
    num_rows: int,
) -> Callable[..., tuple[jax.Array, ...]]:
    """What each device runs on its shards: cut the group sizes at its row offset, run
    the local computation, combine the results that lack a split dimension.

    Partials that are summed across shards are computed in float32 and rounded to
    out_dtype once, after the sum, as on one device.
    """
    operand_fields = schema.operand_fields(params)
    result_fields = schema.result_fields(params)
    combined_over = [
        tuple(a for letter, split in axes.items() if letter not in field.letters(params) for a in split)
        for field in result_fields
    ]
    summed_in_out_dtype = any(
        over and field.reduce == "sum" and field.dtype == "out_dtype"
        for field, over in zip(result_fields, combined_over)
    )
    local_params = dict(params, out_dtype=np.dtype(np.float32)) if summed_in_out_dtype else params
    names = [f.name for f in operand_fields]
    # A primitive without group sizes (gather_sum) keeps its rows whole: nothing to cut.
    sizes_index = names.index(GROUP_SIZES) if GROUP_SIZES in names else None
    rows_index = next(i for i, f in enumerate(operand_fields) if ROWS in f.letters(params))
    row_axes = axes.get(ROWS, ())

    def run(*operands):
        local = list(operands)
        if row_axes and sizes_index is not None:
            local_rows = local[rows_index].shape[list(operand_fields[rows_index].letters(params)).index(ROWS)]
            offset = lax.axis_index(row_axes) * local_rows
            local[sizes_index] = groups.local_group_sizes(
                local[sizes_index], num_rows, offset, local_rows
            )
        results = list(local_implementation([jax.typeof(x) for x in local], local_params)(*local))
        for i, (field, over) in enumerate(zip(result_fields, combined_over)):
            if over and field.reduce == "max":
                results[i] = lax.pmax(results[i], over)
            elif over:
                results[i] = _sum_in_shard_order(results[i], over)
            results[i] = results[i].astype(field.result_dtype(params))
        return tuple(results)

    return run


def explicit_mesh(operands: Sequence[Any]) -> Any | None:
    """The mesh of the first operand typed with Explicit mesh axes, or None."""
    for x in operands:
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def explicit_shard_map(
    schema: Schema,
    params: Mapping[str, Any],
    bind: Callable[..., Sequence[jax.Array]],
    operands: Sequence[Any],
    mesh: Any,
) -> list[jax.Array]:
    """`bind(*operands, **params)` on each device's shards of operands typed with Explicit axes.

    Over the mesh's Explicit axes the shardings are in the types, so the split is chosen
    at trace time by the same rules as `partitioned`'s, and the primitive runs inside a
    shard_map over those axes (Auto axes, if any, are left to `partitioned` inside it).
    An operand split along a dimension kept whole, or differently from the others, is
    resharded first, as the partitioner would do.
    """
    explicit = frozenset(
        name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit
    )
    specs = [_spec(jax.typeof(x).sharding, jnp.ndim(x)) for x in operands]
    axes = factor_axes(schema, params, specs, usable=explicit)
    operand_fields = schema.operand_fields(params)
    in_specs = [spec_of(f, params, axes) for f in operand_fields]
    operands = [
        x if _same_split(spec, want, explicit) else jax.sharding.reshard(x, NamedSharding(mesh, want))
        for x, spec, want in zip(operands, specs, in_specs)
    ]
    num_rows = schema.dim_sizes([jnp.shape(x) for x in operands], params)[ROWS]
    run = local_computation(
        schema, params, lambda avals, local_params: functools.partial(bind, **local_params), axes, num_rows
    )
    out_specs = tuple(spec_of(f, params, axes) for f in schema.result_fields(params))
    # check_vma=False: the combined results are equal on every device by construction
    # (gathered, then summed in one order), which vma cannot see through all_gather.
    mapped = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=out_specs,
        axis_names=set(explicit),
        check_vma=False,
    )
    return list(mapped(*operands))


def split_over_leading_axis(
    fn: Callable[..., tuple[jax.Array, ...]], rule: str
) -> Callable[..., tuple[jax.Array, ...]]:
    """fn of one or more operands of one leading axis, for the SPMD partitioner: each device
    runs it on its part of that axis, split as the first operand is, every other axis
    whole; each result is split likewise on its leading axis. `rule` is fn's Shardy rule,
    its first letter the leading axis ("e n k -> e n k, e k n, e p q": experts, whose
    weights a device quantizes alone; "m k, m -> m k, m q": rows and a value per row).
    Over Explicit mesh axes the split is in the operands' type: fn runs in a shard_map over
    them, an operand resharded first where another axis is split."""
    letters = rule.replace("->", " ").replace(",", " ").split()

    @custom_partitioning
    def computation(*operands):
        return fn(*operands)

    def partition(mesh, arg_shapes, result_shape):
        leading = _spec(arg_shapes[0].sharding, len(arg_shapes[0].shape))[0]

        def split(shape) -> NamedSharding:
            return NamedSharding(mesh, PartitionSpec(leading, *(None,) * (len(shape.shape) - 1)))

        return mesh, fn, tuple(split(r) for r in result_shape), tuple(split(a) for a in arg_shapes)

    computation.def_partition(
        partition=partition, sharding_rule=rule,
        need_replication_factors=tuple(dict.fromkeys(f for f in letters if f != letters[0])),
    )

    def call(*operands: jax.Array) -> tuple[jax.Array, ...]:
        mesh = explicit_mesh(list(operands))
        if mesh is None:
            return computation(*operands)
        explicit = frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit)
        spec = _spec(jax.typeof(operands[0]).sharding, jnp.ndim(operands[0]))
        want = PartitionSpec(_entry(tuple(a for a in _axes(spec[0]) if a in explicit)))
        operands = tuple(
            x if _same_split(_spec(jax.typeof(x).sharding, jnp.ndim(x)), want, explicit)
            else jax.sharding.reshard(x, NamedSharding(mesh, want)) for x in operands)
        results = len(jax.eval_shape(fn, *(jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in operands)))
        return jax.shard_map(computation, mesh=mesh, in_specs=(want,) * len(operands),
                             out_specs=(want,) * results, axis_names=set(explicit))(*operands)

    return call


def like_primal(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """The cotangent resharded to its primal's sharding over Explicit mesh axes.

    A custom VJP must return each cotangent with its primal's type, sharding included;
    the primitives split by their own rules (a weight's gradient comes back replicated,
    an operand split along a dimension kept whole comes back unsplit there).
    """
    want = jax.typeof(primal).sharding
    mesh = getattr(want, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return cotangent
    rank = jnp.ndim(primal)
    have = [_axes(e) for e in _spec(jax.typeof(cotangent).sharding, rank)]
    if have == [_axes(e) for e in _spec(want, rank)]:
        return cotangent
    return jax.sharding.reshard(cotangent, want)


def _same_split(spec: tuple, want: PartitionSpec, explicit: frozenset) -> bool:
    have = [tuple(a for a in _axes(entry) if a in explicit) for entry in spec]
    return have == [_axes(entry) for entry in want]


def _spec(sharding: Any, rank: int) -> tuple:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (rank - len(spec))


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]) -> Any:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _sum_in_shard_order(partial: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sum of every shard's partial, added in shard order on every device."""
    return jnp.sum(lax.all_gather(partial, axes), axis=0)
