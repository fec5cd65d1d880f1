"""`entry_point`: how the MoE functions take the block's weights and options, whole or as keywords.

A function decorated with `entry_point` lists the fields of `MoEWeights` and of
`MoEOptions` among its parameters, so that a call may spell them out:

    moe_layer(x, router, w1, w2, b1=b1, top_k=6, score="sigmoid")

or give them whole:

    moe_layer(x, weights=MoEWeights(router, w1, w2, b1=b1), options=MoEOptions(top_k=6, score="sigmoid"))

but not both for the same object: a call that gives `options` and an option keyword
(or `weights` and a weight array) is refused, since either precedence would silently drop
a value the caller wrote. Its body reads only `weights` and `options`: the wrapper here
gathers the keywords into them, in this one place for every entry point.

The option keywords default to `UNSET` rather than to a value: the defaults are declared
once, in `MoEOptions`, and `entry_point` refuses at import a function whose option
keywords miss a field or carry a default of their own. It writes the options' part of
the function's docstring from the same declaration, where the docstring says
`OPTIONS_MARKER`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from jax_dsrelu.moe.options import MoEOptions
from jax_dsrelu.moe.weights import MoEWeights

OPTION_NAMES = tuple(field.name for field in dataclasses.fields(MoEOptions))
WEIGHT_NAMES = tuple(field.name for field in dataclasses.fields(MoEWeights))
# The weights without which there is no block; the others are None when it has none.
REQUIRED_WEIGHTS = ("router", "w1", "w2")
OPTIONS_MARKER = "{MoEOptions}"


class _Unset:
    """The default of an option keyword: not given, so taken from `options` or from
    `MoEOptions`' declaration."""

    def __repr__(self) -> str:
        return "<MoEOptions default>"


UNSET: Any = _Unset()


def entry_point(
    function: Callable | None = None,
    *,
    fixed_options: Mapping[str, Any] | None = None,
    required_options: tuple[str, ...] = (),
) -> Callable:
    """The function, taking its weights and options whole or as keywords (module docstring).

    fixed_options: fields the function does not take as keywords, because its block has
    only one value for them (a NemotronHMoE block scores by sigmoid); an options object
    with another value is refused. required_options: fields with no default for this
    function when no options object is given (the Hugging Face converter needs top_k
    from the model's config, as its tensors do not say it).
    """
    if function is None:
        return functools.partial(entry_point, fixed_options=fixed_options, required_options=required_options)
    fixed = dict(fixed_options or {})
    signature = inspect.signature(function)
    # MoE.__init__ is called as MoE(...): errors name the class.
    name = function.__qualname__.removesuffix(".__init__")
    option_names, takes_weights = _check_signature(name, signature, fixed)

    @functools.wraps(function)
    def with_whole_arguments(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        given = {field: arguments.pop(field) for field in option_names if field in arguments}
        arguments["options"] = _options(name, arguments.get("options"), given, fixed, required_options)
        if takes_weights:
            arrays = {field: arguments.pop(field) for field in WEIGHT_NAMES if field in arguments}
            arguments["weights"] = _weights(name, arguments.get("weights"), arrays)
        return function(*bound.args, **bound.kwargs)

    with_whole_arguments.__doc__ = _document(name, function.__doc__, option_names, fixed, required_options)
    return with_whole_arguments


def _check_signature(name: str, signature: inspect.Signature, fixed: dict[str, Any]) -> tuple[tuple[str, ...], bool]:
    """(the option keywords, whether the function takes the weights): raises TypeError
    unless its option keywords are exactly MoEOptions' fields but the fixed ones, each
    keyword-only with the default UNSET, and it takes `options` (and, if it lists any
    weight, every weight and `weights`) with the default None."""
    parameters = signature.parameters
    unknown = sorted(set(fixed) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"{name}: fixed_options names {unknown}, which are not fields of MoEOptions")
    option_names = tuple(field for field in OPTION_NAMES if field not in fixed)
    listed = [field for field in OPTION_NAMES if field in parameters]
    if listed != list(option_names):
        raise TypeError(
            f"{name} must take the fields of MoEOptions {list(option_names)} as keywords, got {listed}"
        )
    for field in option_names:
        parameter = parameters[field]
        if parameter.kind is not parameter.KEYWORD_ONLY or parameter.default is not UNSET:
            raise TypeError(
                f"{name}'s keyword {field} must be keyword-only with the default UNSET (its default is "
                f"MoEOptions.{field}={getattr(MoEOptions, field)!r}, declared there once), got {parameter}"
            )
    weights = [field for field in WEIGHT_NAMES if field in parameters]
    takes_weights = bool(weights)
    if takes_weights and weights != list(WEIGHT_NAMES):
        raise TypeError(f"{name} must take every field of MoEWeights {list(WEIGHT_NAMES)} or none, got {weights}")
    for whole in ("options", "weights") if takes_weights else ("options",):
        if whole not in parameters or parameters[whole].default is not None:
            raise TypeError(f"{name} must take {whole}=None")
    for field in weights:
        if parameters[field].default is not None:
            raise TypeError(f"{name}'s weight {field} must default to None, got {parameters[field]}")
    return option_names, takes_weights


def _options(
    name: str, options: Any, given: dict[str, Any], fixed: dict[str, Any], required: tuple[str, ...]
) -> MoEOptions:
    """The one MoEOptions of a call: `options` as given, or built from the keywords."""
    given = {field: value for field, value in given.items() if value is not UNSET}
    if options is None:
        missing = [field for field in required if field not in given]
        if missing:
            raise TypeError(f"{name} needs {' and '.join(missing)}, or options=MoEOptions(...)")
        return MoEOptions(**given, **fixed)
    if not isinstance(options, MoEOptions):
        raise TypeError(
            f"options must be a jax_dsrelu.MoEOptions or None, got {options!r} ({type(options).__name__})"
        )
    if given:
        spelled = ", ".join(f"{field}={value!r}" for field, value in given.items())
        raise TypeError(
            f"{name} takes the options either whole (options=MoEOptions(...)) or as keywords, not both: got "
            f"options and {spelled}; pass dataclasses.replace(options, {spelled}) instead"
        )
    for field, value in fixed.items():
        if getattr(options, field) != value:
            raise ValueError(
                f"options.{field} must be {value!r} for {name}, got {field}={getattr(options, field)!r}"
            )
    return options


def _weights(name: str, weights: Any, arrays: dict[str, Any]) -> MoEWeights:
    """The one MoEWeights of a call: `weights` as given, or built from the arrays."""
    arrays = {field: value for field, value in arrays.items() if value is not None}
    if weights is None:
        # A missing router, w1 or w2 stays None, for MoEWeights.check to name it.
        return MoEWeights(**{**dict.fromkeys(REQUIRED_WEIGHTS), **arrays})
    if not isinstance(weights, MoEWeights):
        raise TypeError(
            f"weights must be a jax_dsrelu.MoEWeights or None, got {type(weights).__name__}"
        )
    if arrays:
        raise TypeError(
            f"{name} takes the weights either whole (weights=MoEWeights(...)) or as arrays, not both: got "
            f"weights and {', '.join(arrays)}"
        )
    return weights


def _document(
    name: str, doc: str | None, option_names: tuple[str, ...], fixed: dict[str, Any], required: tuple[str, ...]
) -> str:
    """The docstring with the line OPTIONS_MARKER replaced by a list of the options:
    each field with its default (from MoEOptions) and its meaning, at the marker's indent."""
    lines = (doc or "").splitlines()
    places = [i for i, line in enumerate(lines) if line.strip() == OPTIONS_MARKER]
    if len(places) != 1:
        raise TypeError(f"{name}'s docstring must hold the line {OPTIONS_MARKER} once, where its options are listed")
    (place,) = places
    indent = lines[place][: len(lines[place]) - len(lines[place].lstrip())]
    entries = []
    for field in dataclasses.fields(MoEOptions):
        if field.name in fixed:
            entries.append((f"{field.name}={fixed[field.name]!r}", "fixed: not a keyword, and options must have this value"))
        elif field.name in required:
            entries.append((field.name, f"required without options: {field.metadata['doc']}"))
        else:
            entries.append((f"{field.name}={field.default!r}", field.metadata["doc"]))
    width = max(len(spelled) for spelled, _ in entries) + 2
    listed = [
        f"{indent}Options: options=MoEOptions(...), or its fields as these keywords (not both):",
        *(f"{indent}    {spelled:<{width}}{meaning}" for spelled, meaning in entries),
    ]
    return "\n".join(lines[:place] + listed + lines[place + 1:])
