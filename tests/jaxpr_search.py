"""What a jaxpr holds, searched through every nested jaxpr: for tests that a gradient adds
no two values into one place in an order the GPU chooses."""

from __future__ import annotations

from jax.extend import core


def scatter_adds(jaxpr):
    """The output shapes of every scatter-add in a jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scatter-add":
            yield eqn.outvars[0].aval.shape
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, core.ClosedJaxpr):
                    yield from scatter_adds(sub.jaxpr)
                elif isinstance(sub, core.Jaxpr):
                    yield from scatter_adds(sub)
