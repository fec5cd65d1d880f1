"""`MoEOptions`: the MoE layer's options, declared, documented and checked in one place.

`moe_layer`, `moe_layer_expert_parallel`, `jax_dsrelu.flax.MoE` and
`MoE.from_hf_nemotron_h` take one `MoEOptions` whole, or its fields as keywords
(`jax_dsrelu.moe.entry_points` turns the keywords into the object). Each field's default
and meaning are declared here once: the entry points' keywords carry no default of their
own, and their docstrings list the fields from this declaration. Every field is a static
Python value: the object is hashable, so it may sit in an NNX module's static state, be a
static argument of `jax.jit`, or be passed to a jitted function as a pytree without leaves.
"""

from __future__ import annotations

import dataclasses
import fractions
import math

import jax
import numpy as np

from jax_dsrelu.kernels import registry
from jax_dsrelu.primitives import validation
from jax_dsrelu.quantization.schema import Recipe

# How a router's logits become scores (`route`'s `score`).
SCORES = ("softmax", "sigmoid")


def _option(default, doc: str):
    """A field with its default and the line that documents it in every entry point."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """How an MoE block routes its tokens and runs its experts.

    The routing fields are `route`'s; deterministic, backend and precision are `moe_mlp`'s. The
    number of experts is the weights' (w1.shape[0]): the checks that need it run when the
    options meet the weights (`check_experts`), every other check when they are built.
    Change a field with `dataclasses.replace(options, top_k=4)`.
    """

    top_k: int = _option(2, "experts each token is routed to")
    score: str = _option("softmax", "'softmax' over the experts, or 'sigmoid' of each expert on its own")
    num_groups: int = _option(1, "the experts in num_groups equal contiguous groups, for group-limited selection")
    top_groups: int | None = _option(None, "the best groups kept for each token (None: all)")
    normalize: bool = _option(False, "the chosen weights divided by their sum")
    scale: float = _option(1.0, "the routed scaling factor, applied after normalize")
    round_to: int | None = _option(
        None, "token rounding: each expert's assignments cut to a multiple of round_to (None: none cut)"
    )
    capacity_factor: float | None = _option(
        None,
        "expert parallelism: each device sends each other at most ceil(capacity_factor * T_local * top_k / D) "
        "rows, the lowest-weighted dropped (None: dropless; moe_layer on one device takes None only)",
    )
    recompute_exchanged: bool = _option(
        False,
        "expert parallelism: the backward exchanges the rows again and remakes their pre-activations instead of "
        "keeping both for the D * C rows received (moe_layer on one device takes False only)",
    )
    deterministic: bool = _option(False, "every gradient bitwise reproducible from run to run")
    backend: str = _option("auto", "'auto', 'xla', 'sm90' or 'sm100': the backend of the experts' GEMMs")
    precision: Recipe | None = _option(
        None,
        "None: the experts' GEMMs in the weights' dtype; jax_dsrelu.quantization.FP8_BLOCKWISE: on FP8 operands "
        "by DeepSeek-V3's blockwise recipe (docs/fp8.md; backend 'xla' or 'auto' so far)",
    )

    def __post_init__(self) -> None:
        top_k = self.top_k
        validation.require_int("top_k", top_k)
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got top_k={top_k}")
        if self.score not in SCORES:
            raise ValueError(f"score must be {' or '.join(map(repr, SCORES))}, got {self.score!r}")
        validation.require_int("num_groups", self.num_groups)
        if self.num_groups < 1:
            raise ValueError(f"num_groups must be at least 1, got num_groups={self.num_groups}")
        if self.top_groups is not None:
            validation.require_int("top_groups", self.top_groups)
            if not 1 <= self.top_groups <= self.num_groups:
                raise ValueError(
                    f"top_groups must be None or between 1 and num_groups={self.num_groups}, "
                    f"got top_groups={self.top_groups}"
                )
        validation.require_bool("normalize", self.normalize)
        scale = self.scale
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale must be a Python float, got {scale!r} ({type(scale).__name__})")
        if not np.isfinite(scale):
            raise ValueError(f"scale must be finite, got scale={scale!r}")
        if self.round_to is not None:
            validation.require_int("round_to", self.round_to)
            if not 1 <= self.round_to < 2**31:
                raise ValueError(
                    f"round_to must be None or a positive number of rows below 2**31, got round_to={self.round_to}"
                )
        capacity_factor = self.capacity_factor
        if capacity_factor is not None:
            if isinstance(capacity_factor, (bool, np.bool_)) or not isinstance(
                capacity_factor, (int, float, np.integer, np.floating)
            ):
                raise TypeError(
                    f"capacity_factor must be None or a Python float, got {capacity_factor!r} "
                    f"({type(capacity_factor).__name__})"
                )
            if not (np.isfinite(capacity_factor) and capacity_factor > 0):
                raise ValueError(
                    f"capacity_factor must be None or a finite number > 0, got capacity_factor={capacity_factor!r}"
                )
        validation.require_bool("recompute_exchanged", self.recompute_exchanged)
        validation.require_bool("deterministic", self.deterministic)
        validation.backend_name(self.backend)
        validation.precision(self.precision)
        registry.check_precision(self.backend, self.precision)

    def check_experts(self, num_experts: int) -> None:
        """Raises unless the options fit num_experts experts: top_k of them, in num_groups
        equal groups, with top_k among the experts of top_groups groups."""
        top_k, num_groups, top_groups = self.top_k, self.num_groups, self.top_groups
        if top_k > num_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts E={num_experts}, got top_k={top_k}")
        if num_experts % num_groups:
            raise ValueError(
                f"num_groups must be at least 1 and divide the number of experts E={num_experts}, "
                f"got num_groups={num_groups}"
            )
        if top_groups is not None:
            reachable = top_groups * (num_experts // num_groups)
            if top_k > reachable:
                raise ValueError(
                    f"top_k must be at most the {reachable} experts that top_groups={top_groups} groups of "
                    f"E/num_groups={num_experts // num_groups} hold, got top_k={top_k}"
                )

    @property
    def rounds(self) -> bool:
        """Whether some assignments may be cut to round the experts' row counts."""
        return self.round_to is not None and self.round_to > 1

    def per_peer_capacity(self, num_rows: int, num_peers: int) -> int:
        """The rows a device sends each of num_peers devices, out of its num_rows (T_local *
        top_k): all of them when dropless (any one peer may own every chosen expert), else
        ceil(capacity_factor * num_rows / num_peers), at most num_rows; at least 1, so that
        the send buffer of a device without tokens still splits into num_peers blocks. The
        product is exact, of the factor as written (1.1 is 11/10): in floating point
        1.1 * 200 / 4 is a hair above 55 and would round up to 56."""
        if self.capacity_factor is None:
            return max(num_rows, 1)
        exact = fractions.Fraction(repr(float(self.capacity_factor))) * num_rows / num_peers
        return max(min(num_rows, math.ceil(exact)), 1)

    @property
    def drops_groups(self) -> bool:
        """Whether some groups are left out of each token's choice."""
        return self.top_groups is not None and self.top_groups < self.num_groups
