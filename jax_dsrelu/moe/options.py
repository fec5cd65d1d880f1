"""The MoE layer's options, checked once into frozen objects that every entry point shares.

`route`, `moe_layer`, `moe_layer_expert_parallel` and `jax_dsrelu.flax.MoE` take the same
keywords. Each builds these objects from them, so an option is checked in one place with
one message, and the layer's steps receive the options whole instead of a keyword list
threaded through each of them. Every field is a static Python value: the objects are
hashable, so they may sit in an NNX module's static state or be closed over by a trace.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_dsrelu.primitives import validation

# How a router's logits become scores (`route`'s `score`).
SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RoutingOptions:
    """How each token chooses its experts, for num_experts experts: `route`'s options.

    top_k experts per token; scores by softmax over the experts or by each expert's
    sigmoid; experts in num_groups equal contiguous groups of which top_groups are kept
    (None: all); the chosen weights divided by their sum when normalize, then times scale;
    with round_to, each expert's assignments cut to a multiple of round_to (None: none cut).
    """

    num_experts: int
    top_k: int
    score: str = "softmax"
    num_groups: int = 1
    top_groups: int | None = None
    normalize: bool = False
    scale: float = 1.0
    round_to: int | None = None

    def __post_init__(self) -> None:
        num_experts, top_k = self.num_experts, self.top_k
        if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
            raise TypeError(f"top_k must be a Python int, got {top_k!r} ({type(top_k).__name__})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts E={num_experts}, got top_k={top_k}")
        if self.score not in SCORES:
            raise ValueError(f"score must be {' or '.join(map(repr, SCORES))}, got {self.score!r}")
        validation.require_bool("normalize", self.normalize)
        scale = self.scale
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale must be a Python float, got {scale!r} ({type(scale).__name__})")
        if not np.isfinite(scale):
            raise ValueError(f"scale must be finite, got scale={scale!r}")
        num_groups, top_groups = self.num_groups, self.top_groups
        validation.require_int("num_groups", num_groups)
        if num_groups < 1 or num_experts % num_groups:
            raise ValueError(
                f"num_groups must be at least 1 and divide the number of experts E={num_experts}, "
                f"got num_groups={num_groups}"
            )
        if top_groups is not None:
            validation.require_int("top_groups", top_groups)
            if not 1 <= top_groups <= num_groups:
                raise ValueError(
                    f"top_groups must be None or between 1 and num_groups={num_groups}, got top_groups={top_groups}"
                )
            reachable = top_groups * (num_experts // num_groups)
            if top_k > reachable:
                raise ValueError(
                    f"top_k must be at most the {reachable} experts that top_groups={top_groups} groups of "
                    f"E/num_groups={num_experts // num_groups} hold, got top_k={top_k}"
                )

        if self.round_to is not None:
            validation.require_int("round_to", self.round_to)
            if not 1 <= self.round_to < 2**31:
                raise ValueError(
                    f"round_to must be None or a positive number of rows below 2**31, got round_to={self.round_to}"
                )

    @property
    def rounds(self) -> bool:
        """Whether some assignments may be cut to round the experts' row counts."""
        return self.round_to is not None and self.round_to > 1

    @property
    def drops_groups(self) -> bool:
        """Whether some groups are left out of each token's choice."""
        return self.top_groups is not None and self.top_groups < self.num_groups


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """An MoE block's options: its routing, and how its experts run (`moe_mlp`'s
    deterministic and backend)."""

    routing: RoutingOptions
    deterministic: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        validation.require_bool("deterministic", self.deterministic)
        validation.backend_name(self.backend)

    @classmethod
    def of(
        cls,
        num_experts: int,
        *,
        top_k: int,
        score: str,
        num_groups: int,
        top_groups: int | None,
        normalize: bool,
        scale: float,
        deterministic: bool,
        backend: str,
        round_to: int | None = None,
    ) -> LayerOptions:
        """The options from the layers' keywords (see `moe_layer`), checked."""
        routing = RoutingOptions(
            num_experts=num_experts, top_k=top_k, score=score, num_groups=num_groups,
            top_groups=top_groups, normalize=normalize, scale=scale, round_to=round_to,
        )
        return cls(routing=routing, deterministic=deterministic, backend=backend)
