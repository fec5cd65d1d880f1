"""Calling a CuTe DSL host function from JAX with a compile cache keyed on static facts.

`cutlass.jax.cutlass_call` caches compiles on every tensor's concrete shape and infers
divisibility assumptions from concrete extents, so a new token count m would recompile,
and code compiled for one m could assume a divisibility that another m breaks. Here
instead:

* Every buffer is described by an `Operand`: its dtype, which dimensions vary from call to
  call (the row dimension, and anything sized from it), and how the kernel sees its modes.
  Varying dimensions are compiled with divisibility 1 and a canonical extent of 1; fixed
  dimensions with their extent, which the caller's key must contain.
* A compile is looked up by the caller's key, which must hold exactly the static facts the
  kernel depends on (dtypes, fixed extents, tile configuration, flags). The same key always
  yields the same object code, whatever m the first call had.
* The call itself is a plain `jax.ffi.ffi_call` of the CuTe DSL runtime's XLA FFI target with
  the cached object as an attribute: one custom call in the HLO.

The pieces used from `cutlass.jax` (`compile.jit_wrapper`, `compile.FunctionSpec`,
`compile.Arg`, `compile._compile_lock`, the export prefix and the FFI target registration)
are internals of nvidia-cutlass-dsl, checked at `KNOWN_CUTLASS_DSL_VERSION` only, the
version this package's `gpu` and `sm100` extras pin. Importing this module with any other
version refuses at once: a new version must be checked against them first.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import tempfile
import types
from typing import Callable, Hashable, Mapping, Sequence

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import jax
import numpy as np
from cutlass.cutlass_dsl.cutlass import CuTeDSL
from cutlass.jax import TensorSpec
from cutlass.jax import compile as cutlass_jax_compile
from cutlass.jax import ffi as cutlass_jax_ffi

# The nvidia-cutlass-dsl release whose cutlass.jax internals this module was read against;
# pyproject's extras pin the same.
KNOWN_CUTLASS_DSL_VERSION = "4.8.1"


def check_cutlass_dsl_version(version: str) -> None:
    """Raises ImportError unless `version` is the CuTe DSL release this bridge knows."""
    if version != KNOWN_CUTLASS_DSL_VERSION:
        raise ImportError(
            f"jax_dsrelu's kernel bridge relies on internals of cutlass.jax that it knows for "
            f"nvidia-cutlass-dsl {KNOWN_CUTLASS_DSL_VERSION} only, but {version} is installed. "
            f"Install that version: pip install 'nvidia-cutlass-dsl[cu13]=="
            f"{KNOWN_CUTLASS_DSL_VERSION}' (what jax-dsrelu's gpu extra pins), or use "
            f"backend='xla'."
        )


check_cutlass_dsl_version(cutlass.__version__)


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one buffer of the call is presented to the CuTe DSL host function.

    `varying` lists the dimensions whose extent changes from call to call without a
    recompile; `mode` reorders the dimensions the kernel sees (a view, never a copy).
    """

    dtype: np.dtype
    rank: int
    varying: tuple[int, ...] = ()
    mode: tuple[int, ...] | None = None

    def compile_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(1 if axis in self.varying else int(extent) for axis, extent in enumerate(shape))

    def tensor_spec(self, shape: Sequence[int]) -> TensorSpec:
        divisibility = tuple(
            1 if axis in self.varying else max(int(extent), 1) for axis, extent in enumerate(shape)
        )
        return TensorSpec(mode=self.mode, divisibility=divisibility, static=False)


@dataclasses.dataclass(frozen=True)
class Compiled:
    module: bytes  # ELF object holding the host launcher and the cubin
    fingerprint: bytes
    # Kept only when asked for: tests read the PTX, the device scripts disassemble the cubin.
    ptx: str | None = None
    cubin: bytes | None = None


# Optional on-disk cache of object code, shared between processes (and machines of one
# architecture): compile on a CPU machine, run on the GPU machine without compiling.
CACHE_DIR_VARIABLE = "JAX_DSRELU_KERNEL_CACHE"


# The device code every kernel shares (expert tables, the slot reduction).
_SHARED_KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")

_cache: dict[Hashable, Compiled] = {}
_compile_count = 0


def compile_count() -> int:
    """How many compiles this process has run through `call` (for no-recompile checks)."""
    return _compile_count


def _function_spec(
    inputs: Sequence[tuple[Operand, tuple[int, ...]]],
    outputs: Sequence[tuple[Operand, tuple[int, ...]]],
    aliases: Mapping[int, int],
) -> cutlass_jax_compile.FunctionSpec:
    def args(described):
        return tuple(
            cutlass_jax_compile.Arg(
                index,
                operand.compile_shape(shape),
                np.dtype(operand.dtype),
                operand.tensor_spec(shape),
            )
            for index, (operand, shape) in enumerate(described)
        )

    in_args = args(inputs)
    out_args = args(outputs)
    # Aliased results are written through their input buffer; the host function does not
    # receive them a second time (this mirrors cutlass.jax's own spec construction).
    kernel_outputs = [arg for arg in out_args if arg.idx not in set(aliases.values())]
    return cutlass_jax_compile.FunctionSpec(
        in_args=in_args,
        input_tree=jax.tree.structure(tuple(range(len(in_args)))),
        out_args=out_args,
        output_tree=jax.tree.structure(tuple(range(len(kernel_outputs)))),
        input_output_aliases=tuple(sorted(aliases.items())),
        input_spec=tuple(arg.spec for arg in in_args),
        output_spec=tuple(arg.spec for arg in out_args),
        compile_options=None,
        use_static_tensors=False,
        kwargs=(),
    )


def compile_function(
    host_function: Callable[..., None],
    key: Hashable,
    inputs: Sequence[tuple[Operand, tuple[int, ...]]],
    outputs: Sequence[tuple[Operand, tuple[int, ...]]],
    aliases: Mapping[int, int],
    *,
    arch: str,
    keep: bool = False,
) -> Compiled:
    """The object code for `host_function`, compiled for `arch` (e.g. "sm_90a") once per key.

    `host_function` has the signature (stream, *inputs, *non-aliased outputs). `key` must
    determine the code completely apart from the architecture. keep=True also returns the
    PTX and the cubin (and bypasses the disk cache).
    """
    global _compile_count
    full_key = (key, arch, keep)
    # cutlass.jax serialises its compiles on this lock too. The target architecture is
    # process-global DSL state (CUTE_DSL_ARCH, else the visible GPU): it is switched to
    # `arch` for the duration of this compile only.
    with cutlass_jax_compile._compile_lock:
        cached = _cache.get(full_key)
        if cached is not None:
            return cached
        disk_path = None if keep else _disk_path(full_key, _defining_modules(host_function))
        if disk_path is not None and os.path.exists(disk_path):
            with open(disk_path, "rb") as file:
                module = file.read()
            result = Compiled(module=module, fingerprint=hashlib.sha256(module).digest())
            _cache[full_key] = result
            return result
        dsl_env = CuTeDSL._get_dsl().envar
        previous_arch = dsl_env.arch
        dsl_env.arch = arch
        try:
            result = _compile(host_function, _function_spec(inputs, outputs, aliases), keep)
        finally:
            dsl_env.arch = previous_arch
        if disk_path is not None:
            partial = f"{disk_path}.{os.getpid()}"
            with open(partial, "wb") as file:
                file.write(result.module)
            os.replace(partial, disk_path)
        _cache[full_key] = result
        _compile_count += 1
        return result


def _defining_modules(host_function) -> list[str]:
    """The modules whose code the host function runs as its own: its module and, for a
    callable object, those of its class and every base class (a variant defined outside
    the package still runs its bases' code)."""
    classes = () if isinstance(host_function, types.FunctionType) else type(host_function).__mro__
    return [host_function.__module__] + [cls.__module__ for cls in classes]


def _disk_path(full_key: Hashable, modules: list[str]) -> str | None:
    """Where the object code for `full_key` is cached on disk, None when no cache is set.

    The file name hashes the key's repr (every static fact is a dataclass, tuple or
    string with a deterministic repr), the CuTe DSL version, and the source of the shared
    kernel modules (`jax_dsrelu/kernels/*.py`), of this FFI layer and of the folders of the
    modules that define the host function (`_defining_modules`), so editing a kernel never
    reuses stale code."""
    directory = os.environ.get(CACHE_DIR_VARIABLE)
    if not directory:
        return None
    digest = hashlib.sha256(repr(full_key).encode())
    digest.update(cutlass.__version__.encode())
    digest.update(_source_digest(_SHARED_KERNEL_DIR))
    digest.update(_source_digest(os.path.dirname(os.path.abspath(__file__))))
    files = {getattr(sys.modules.get(module), "__file__", None) for module in modules}
    for folder in sorted({os.path.dirname(os.path.abspath(file)) for file in files if file}):
        digest.update(_source_digest(folder))
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, digest.hexdigest() + ".o")


@functools.cache
def _source_digest(folder: str) -> bytes:
    """Digest of the Python files directly in `folder`."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as file:
                digest.update(name.encode() + file.read())
    return digest.digest()


def _compile(
    host_function: Callable[..., None], spec: cutlass_jax_compile.FunctionSpec, keep: bool
) -> Compiled:
    with tempfile.TemporaryDirectory() as dump_dir:
        # Kept artifacts are written to files as well: keep those out of the working directory.
        options = f"--keep-ptx --keep-cubin --dump-dir={dump_dir}" if keep else None
        compiled = cute.compile(
            cutlass_jax_compile.jit_wrapper,
            cuda.CUstream(0),
            *spec.get_compile_args(),
            wrapped_fn=host_function,
            spec=spec,
            options=options,
        )
        module = compiled.dump_to_object(cutlass_jax_compile._EXPORT_PREFIX)
        return Compiled(
            module=module,
            fingerprint=hashlib.sha256(module).digest(),
            ptx=compiled.__ptx__ if keep else None,
            cubin=compiled.__cubin__ if keep else None,
        )


def call(
    host_function: Callable[..., None],
    key: Hashable,
    inputs: Sequence[tuple[Operand, jax.Array]],
    outputs: Sequence[tuple[Operand, jax.ShapeDtypeStruct]],
    aliases: Mapping[int, int] | None = None,
    *,
    arch: str,
) -> list[jax.Array]:
    """Runs `host_function` as one XLA custom call on the computation's stream.

    `aliases` maps input positions to output positions that share the buffer (the
    kernel updates the input in place and XLA hands it back as that output).
    """
    aliases = dict(aliases or {})
    described_inputs = [(operand, tuple(array.shape)) for operand, array in inputs]
    described_outputs = [(operand, tuple(out.shape)) for operand, out in outputs]
    for (operand, shape), (_, array) in zip(described_inputs, inputs):
        if np.dtype(array.dtype) != np.dtype(operand.dtype) or len(shape) != operand.rank:
            raise TypeError(
                f"kernel operand expected {np.dtype(operand.dtype).name} of rank {operand.rank}, "
                f"got {np.dtype(array.dtype).name} of shape {shape}"
            )
    compiled = compile_function(
        host_function, key, described_inputs, described_outputs, aliases, arch=arch
    )
    target = cutlass_jax_ffi._register_and_get_default_ffi_call_target(True)
    function = jax.ffi.ffi_call(
        target,
        result_shape_dtypes=[out for _, out in outputs],
        input_output_aliases=aliases,
    )
    return list(
        function(*[array for _, array in inputs], module=compiled.module, key=compiled.fingerprint)
    )
