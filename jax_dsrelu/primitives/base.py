"""How each of the library's primitives is put together, once for all.

A `GroupedPrimitive` is a JAX primitive described by its `Schema`, an XLA reference and a
function building the backend request from operand shapes. It provides:

- abstract evaluation from the schema's dimensions and result dtypes;
- lowering: every platform lowers "xla" (and "auto", off CUDA) through the reference; on
  CUDA the backend is resolved when lowering, and a kernel backend's implementation is
  lowered in its place; either way the computation is wrapped for the SPMD partitioner
  (`jax_dsrelu.primitives.sharding`), so sharded operands are not gathered;
- eager calls through that same lowering (a one-equation jit);
- batching: any subset of operands batched, one grouped problem per batch element;
- `bind` by operand name: the one place where a call's static facts are settled (group
  sizes as int32, the backend request, an explicitly named backend refused at trace time),
  and which binds inside a shard_map over Explicit mesh axes.

The reference and the kernel implementations take the present operands as keyword
arguments named as the schema names them (`Schema.call_arguments`) and return their
results as a mapping by the schema's result names (`Schema.ordered_results`, which checks
each one's shape and dtype): no argument or result is matched by position.

Gathered operands (`schema.row_gathered`): a call may give an operand as a source
(T, ...) and a row index (m,) int32, meaning the operand source[index]. A kernel backend
names the operands it reads that way itself (its `gathers_rows(request)`, through
`registry.gathered_reads`); its implementation is then called with the source in the
operand's place and the index beside it (`lhs_index=...`, `grad_index=...`), and builds the
kernel variant that loads those rows through the index. Every other gathered operand is
gathered here, before the implementation (or the XLA reference) is called with the rows
in place, so a backend that gathers nothing runs such a call unchanged. Indices outside
[0, T) are clamped into it, as a kernel must do too, so no index reads out of bounds.
The request is the same either way: gathering changes no static fact but the operand's
row count, which no request holds.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.interpreters import batching, mlir

from jax_dsrelu import jax_internals
from jax_dsrelu.kernels import registry
from jax_dsrelu.primitives import sharding
from jax_dsrelu.primitive_schema import GROUP_SIZES, Schema

# (operand avals by the schema's names, absent ones None; static params) -> the request.
RequestBuilder = Callable[[Mapping[str, Any], Mapping[str, Any]], Any]


class GroupedPrimitive:
    """reference(**operands, **params) computes the results by name in plain JAX (params
    without `backend` and the row-index flags); request_of(operand avals by name, params)
    gives the backend request."""

    def __init__(self, schema: Schema, reference: Callable[..., Mapping[str, jax.Array]], request_of: RequestBuilder):
        self.schema = schema
        self.reference = reference
        self.request_of = request_of
        self.primitive = jax.extend.core.Primitive(schema.name)
        self.primitive.multiple_results = True
        self.primitive.def_abstract_eval(self._abstract_eval)
        self.primitive.def_impl(self._eager_impl)
        # The lowering wraps the computation in custom_partitioning, which needs the
        # device assignment; JAX supplies it while lowering only to computations that
        # contain a primitive in this set, and custom_partitioning's own equation
        # appears only inside our lowering, too late to be seen.
        jax_internals.require_devices_while_lowering(self.primitive)
        mlir.register_lowering(self.primitive, functools.partial(self._lower, platform=None))
        mlir.register_lowering(
            self.primitive, functools.partial(self._lower, platform="cuda"), platform="cuda"
        )
        batching.primitive_batchers[self.primitive] = self._batch

    def bind(self, named: Mapping[str, Any], **params: Any) -> dict[str, jax.Array | None]:
        """Operands by name -> results by name (absent ones None).

        The kernels and the references read group sizes as int32, and an explicitly named
        backend that cannot serve the call is refused here, at trace time, from the same
        request its lowering will build.
        """
        if GROUP_SIZES in named:
            named = dict(named, group_sizes=named[GROUP_SIZES].astype(jnp.int32))
        operands = self.schema.bound_operands(named, params)
        request = self.request_of(self.schema.named_operands(operands, params), params)
        registry.check_explicit_backend(params["backend"], request)
        mesh = sharding.explicit_mesh(operands)
        if mesh is None:
            results = self.primitive.bind(*operands, **params)
        else:
            results = sharding.explicit_shard_map(self.schema, params, self.primitive.bind, operands, mesh)
        return self.schema.named_results(results, params)

    def _abstract_eval(self, *operands, **params):
        return [
            jax_internals.result_aval(shape, dtype, operands)
            for shape, dtype in self.schema.result_shapes([x.shape for x in operands], params)
        ]

    def _reference_call(self, *operands, **params):
        operands, params = self._gathered(operands, params, reads=frozenset())
        reference_params = {
            k: v for k, v in params.items() if k != "backend" and not self._is_index_flag(k)
        }
        results = self.reference(**self.schema.call_arguments(operands, params), **reference_params)
        return tuple(self.schema.ordered_results(results, [x.shape for x in operands], params, "the XLA reference"))

    def _kernel_call(self, implementation, backend: str, reads: frozenset, params, *operands):
        """The kernel implementation on the operands, the gathered ones it does not read
        through their index itself gathered first."""
        operands, params = self._gathered(operands, params, reads)
        results = implementation(**self.schema.call_arguments(operands, params))
        producer = f"backend={backend!r}'s implementation"
        return tuple(self.schema.ordered_results(results, [x.shape for x in operands], params, producer))

    def _gathered(self, operands, params, reads: frozenset):
        """(operands, params) with every gathered operand not in `reads` replaced by its
        rows, source[index] (indices clamped into the source), and its index dropped."""
        fields = self.schema.index_fields(params)
        if all(f.gathers in reads for f in fields):
            return list(operands), params
        named = self.schema.named_operands(operands, params)
        params = dict(params)
        for field in fields:
            if field.gathers not in reads:
                named[field.gathers] = jnp.take(named[field.gathers], named[field.name], axis=0, mode="clip")
                named[field.name] = None
                params[field.present_if] = False
        return self.schema.bound_operands(named, params), params

    def _is_index_flag(self, param: str) -> bool:
        return any(f.present_if == param for f in self.schema.operands if f.gathers is not None)

    def _eager_impl(self, *operands, **params):
        # Outside jit, run the primitive as a one-equation computation so that eager
        # calls go through exactly the lowering a jitted call uses.
        return jax.jit(lambda *ops: self.primitive.bind(*ops, **params))(*operands)

    def _local_implementation(self, platforms: Sequence[str]):
        """For operands of the given shapes on one device: the function computing the outputs."""

        def for_shapes(operand_avals, params):
            if "cuda" in platforms:
                # Built again from the local shapes: under a partitioned jit a device may
                # hold part of n, and its kernel is compiled for its own part.
                request = self.request_of(self.schema.named_operands(operand_avals, params), params)
                name, implementation = registry.cuda_implementation(params["backend"], request)
                if implementation is not None:
                    reads = registry.gathered_reads(name, request)
                    return functools.partial(self._kernel_call, implementation, name, reads, params)
            elif params["backend"] not in ("xla", "auto"):
                raise NotImplementedError(
                    f"backend={params['backend']!r} runs only on CUDA GPUs, but this computation "
                    f"is lowered for {', '.join(platforms)}. Use backend='xla' or 'auto' there."
                )
            return functools.partial(self._reference_call, **params)

        return for_shapes

    def _lower(self, ctx: mlir.LoweringRuleContext, *operands: Any, platform: str | None, **params: Any):
        platforms = (platform,) if platform else tuple(ctx.module_context.platforms)
        computation = sharding.partitioned(
            self.schema, params, self._local_implementation(platforms), ctx.avals_in
        )
        return mlir.lower_fun(computation, multiple_results=True)(ctx, *operands)

    def _batch(self, batched_operands, batch_dims, **params):
        """vmap runs one grouped problem per batch element, in sequence.

        The experts of different batch elements cannot share one launch without a padding
        expert per element whose rows must still come out exactly 0, so a map is both
        the simple and the exact choice. Unbatched operands are closed over, not
        broadcast, so shared weights are read in place by every element.
        """
        mapped = [
            jnp.moveaxis(operand, dim, 0)
            for operand, dim in zip(batched_operands, batch_dims)
            if dim is not None
        ]

        def one(slices):
            slices = iter(slices)
            operands = [
                operand if dim is None else next(slices)
                for operand, dim in zip(batched_operands, batch_dims)
            ]
            return tuple(self.primitive.bind(*operands, **params))

        results = lax.map(one, mapped)
        return list(results), [0] * len(results)
