"""SymInt-safe tracing rules for XLA kernels that break dynamic tracing.

torch_xla registers its own autograd kernels (dispatch key `AutogradXLA`) for a
few aten ops. Dynamo's fake-tensor pass and AOTAutograd run those kernels on
fake tensors, and some of them cannot handle symbolic sizes. install() puts a
Python kernel in front of each of them that takes a SymInt-safe path for
symbolic inputs and calls torch_xla's own kernel for everything else.

[Note: Scoping the decompositions to symbolic inputs]
The kernels are Python-dispatcher kernels (`OpOverload.py_kernels`), not
`torch.library` registrations: one of those would replace torch_xla's kernel
in the C++ dispatch table, for eager calls too, and leave no supported way to
call the kernel it replaced. The C++ table is never modified, so an eager XLA
call cannot reach these kernels: the Python dispatcher is only enabled while
tracing (dynamo's fake-tensor pass, AOTAutograd, make_fx). Static-shape
compiles trace with it enabled too, so each kernel also checks its inputs: if
no size, stride or size argument is symbolic it calls torch_xla's C++
`AutogradXLA` kernel, exactly what would have run without the kernel, and the
traced graph (so the XLA program) is unchanged. uninstall() removes the
kernels and clears the ops' dispatch caches, which restores the original
dispatch. These dispatcher internals are reached through torch_internals.py
(see [Note: Private torch APIs]).

[Note: SymInt-unsafe kernels of torch_xla 2.8 and 2.9]
The same four kernels fail the same way in torch_xla 2.8.1 and 2.9.0
(docs/module_survey*.md); 2.8.0 has 2.8.1's C++ sources.
native_layer_norm: torch_xla's AutogradXLA kernel runs ATen's
  `math_native_layer_norm`, which calls `numel()` on the input. With symbolic
  sizes that raises "Cannot call numel() on tensor with symbolic
  sizes/strides", so LayerNorm (and everything containing it: transformer
  layers) cannot be traced with dynamic=True. Fix: the aten decomposition,
  which only uses SymInt-aware ops; autograd differentiates the decomposed ops.
native_group_norm: the AutogradXLA kernel turns its SymInt size arguments
  (N, C, HxW) into concrete ints, which makes dynamo specialize the input
  sizes: GroupNorm recompiled for every batch size. Fix: the aten
  decomposition.
max_pool2d: for an input that requires grad, the AutogradXLA kernel calls
  torch_xla's custom op `xla::max_pool2d_forward`, which has no fake-tensor
  kernel, so dynamo graph-breaks and the pooling runs eagerly, outside the
  compiled graph. Fix: `max_pool2d_with_indices`, which has a SymInt-aware
  meta kernel and an aten backward formula.
max_pool3d: the AutogradXLA kernel is handed the fake tensor itself and
  rejects it ("Expected XLA tensor. Got: XLAFloatType"), with or without
  grad, static or dynamic. Fix (symbolic inputs only, like every override
  here, so static compiles still fail as upstream): `max_pool3d_with_indices`.
"""
import collections
import dataclasses
import threading
from typing import Any, Callable, Dict, List

import torch

from torch_xla_patches import torch_internals
from torch_xla_patches import versions

aten = torch.ops.aten
# The type of aten's op overloads (aten.native_layer_norm.default, ...).
OpOverload = type(aten.native_layer_norm.default)

# The key torch_xla registers its autograd kernels under.
_KEY = torch_internals.autograd_xla_key()


def _is_symbolic(value: Any) -> bool:
  if isinstance(value, torch.Tensor):
    return torch_internals.has_symbolic_sizes_strides(value)
  if isinstance(value, (torch.SymInt, torch.SymFloat)):
    return True
  if isinstance(value, (list, tuple)):
    return any(_is_symbolic(v) for v in value)
  return False


def _any_symbolic(args, kwargs) -> bool:
  return any(_is_symbolic(a) for a in args) or any(
      _is_symbolic(v) for v in kwargs.values())


def _layer_norm_symbolic(*args, **kwargs):
  decomp = torch_internals.decomposition(aten.native_layer_norm.default)
  return decomp(*args, **kwargs)


def _group_norm_symbolic(*args, **kwargs):
  decomp = torch_internals.decomposition(aten.native_group_norm.default)
  return decomp(*args, **kwargs)


def _max_pool2d_symbolic(*args, **kwargs):
  return aten.max_pool2d_with_indices.default(*args, **kwargs)[0]


def _max_pool3d_symbolic(*args, **kwargs):
  return aten.max_pool3d_with_indices.default(*args, **kwargs)[0]


@dataclasses.dataclass(frozen=True)
class Override:
  """A SymInt-safe path for one op (see the Notes above).

  Args:
    op: the aten overload whose AutogradXLA kernel is SymInt-unsafe.
    symbolic: what runs instead when an input is symbolic.
  """
  op: OpOverload
  symbolic: Callable[..., Any]

  def make_kernel(self) -> Callable[..., Any]:
    symbolic = self.symbolic
    name = self.op.name()
    # torch_xla's C++ kernel for this key; see [Note: Scoping the
    # decompositions to symbolic inputs].
    original = torch_internals.cpp_kernel(self.op, _KEY)

    def kernel(*args, **kwargs):
      if _any_symbolic(args, kwargs):
        _calls[(name, 'symbolic')] += 1
        return symbolic(*args, **kwargs)
      _calls[(name, 'original')] += 1
      return original(*args, **kwargs)

    kernel.__name__ = f'symint_safe_{name.replace("::", "_")}'
    kernel.__qualname__ = kernel.__name__
    return kernel


OVERRIDES: List[Override] = [
    Override(aten.native_layer_norm.default, _layer_norm_symbolic),
    Override(aten.native_group_norm.default, _group_norm_symbolic),
    Override(aten.max_pool2d.default, _max_pool2d_symbolic),
    Override(aten.max_pool3d.default, _max_pool3d_symbolic),
]

# op -> the kernel install() put in op.py_kernels[_KEY]; empty when not
# installed.
_installed: Dict[OpOverload, Callable[..., Any]] = {}
_lock = threading.Lock()
# (op name, 'symbolic' | 'original') -> calls of the installed kernels, so
# tests can tell which path a trace took. Trace-time only, never per step.
_calls: collections.Counter = collections.Counter()


def calls() -> Dict[str, Dict[str, int]]:
  """Calls of the installed kernels: {op name: {path: count}}."""
  out: Dict[str, Dict[str, int]] = {}
  for (name, path), n in _calls.items():
    out.setdefault(name, {})[path] = n
  return out


def reset_calls() -> None:
  _calls.clear()


def is_installed() -> bool:
  return bool(_installed)


def installed_ops() -> List[OpOverload]:
  return list(_installed)


def _check_target(op: OpOverload) -> None:
  # A kernel in front of a missing C++ kernel would change dispatch instead of
  # narrowing it; a foreign Python kernel must not be overwritten.
  if not torch_internals.has_cpp_kernel(op, _KEY):
    raise RuntimeError(
        f'torch_xla_patches.decompositions expects torch_xla to register an '
        f'{_KEY.name} kernel for {op}; found none. Supported: '
        f'{versions.supported_pairs_text()}.')
  foreign = torch_internals.python_kernel(op, _KEY)
  if foreign is not None:
    raise RuntimeError(f'{op} already has a Python {_KEY.name} kernel '
                       f'({foreign!r}); not overriding it.')


def install() -> None:
  """Installs every override. Safe to call more than once."""
  import torch_xla  # noqa: F401  registers the AutogradXLA kernels
  with _lock:
    if _installed:
      return
    for override in OVERRIDES:
      _check_target(override.op)
    for override in OVERRIDES:
      kernel = override.make_kernel()
      torch_internals.set_python_kernel(override.op, _KEY, kernel)
      _installed[override.op] = kernel


def uninstall() -> None:
  """Removes what install() installed. Safe to call more than once."""
  with _lock:
    for op, kernel in reversed(list(_installed.items())):
      # Also clears the op's cached dispatch decisions, which may still point
      # at the removed kernel.
      torch_internals.remove_python_kernel(op, _KEY, kernel)
    _installed.clear()
