"""What each graph input is (ArgLayout) and the per-call key (ShapeSignature).

[Note: Shape signatures]
With `dynamic=True` (or `mark_dynamic`) dynamo hands the backend one graph for
many shapes. AOTAutograd passes every free size symbol (s0, s1, ...) as an int
graph input, so the values of those inputs pick the concrete program. The
bridge keys its per-shape entries on:
  * the values of every int/float/bool input (shape values and other scalars),
  * the shapes of tensor inputs whose sizes are symbolic in the graph (a guard
    against running a program compiled for other sizes, which XLA does not
    check and which corrupts memory),
  * under SPMD, the sharding specs of the tensor inputs.
Lifted parameters and tensors with static sizes cannot change the program
without dynamo re-tracing (its guards cover dtype, device and static sizes), so
they are not looked at per call. ArgLayout computes the positions once per
graph; `ArgLayout.key_function()` returns a function that builds the key in
O(number of dynamic inputs), using C-level itemgetters where it can; under
SPMD in O(number of tensor inputs), since it reads every tensor input's
sharding spec (one C++ call for all of them).
"""
import dataclasses
import enum
import operator
from numbers import Number
from typing import Any, Callable, Hashable, List, Optional, Sequence, Tuple

import torch


class ArgKind(enum.Enum):
  PARAMETER = 'parameter'  # a lifted nn.Parameter
  TENSOR = 'tensor'  # a buffer or user tensor with static sizes
  DYNAMIC_TENSOR = 'dynamic_tensor'  # a tensor with symbolic sizes
  SHAPE = 'shape'  # an int that is a size symbol (SymInt in the graph)
  SCALAR = 'scalar'  # any other int, float or bool

  @property
  def is_tensor(self) -> bool:
    return self in (ArgKind.PARAMETER, ArgKind.TENSOR, ArgKind.DYNAMIC_TENSOR)


class UnsupportedGraphInput(TypeError):
  """A graph input the bridge cannot compile; the message names it."""


def placeholder_values(xla_model: Optional[torch.fx.GraphModule],
                       num_args: int) -> List[Any]:
  """The fake values dynamo/AOTAutograd recorded for each graph input."""
  if xla_model is None:
    return [None] * num_args
  values = [
      node.meta.get('val')
      for node in xla_model.graph.nodes
      if node.op == 'placeholder'
  ]
  if len(values) != num_args:
    return [None] * num_args
  return values


def _has_symbolic_sizes(value: Any) -> bool:
  if not isinstance(value, torch.Tensor):
    return False
  return any(isinstance(size, torch.SymInt) for size in value.shape)


def describe_arg(index: int, arg: Any) -> str:
  if isinstance(arg, torch.Tensor):
    return (f'graph input {index} (tensor of shape {tuple(arg.shape)}, '
            f'{arg.dtype}, on {arg.device})')
  return f'graph input {index} ({type(arg).__name__} {arg!r})'


def _classify(index: int, arg: Any, fake: Any) -> ArgKind:
  if isinstance(arg, torch.Tensor):
    if arg.device.type != 'xla':
      raise UnsupportedGraphInput(
          f'{describe_arg(index, arg)} is not on the XLA device; move every '
          'input of a graph compiled with backend="openxla" to the XLA device '
          '(torch_xla.device()).')
    if isinstance(arg, torch.nn.Parameter):
      return ArgKind.PARAMETER
    if fake is None or _has_symbolic_sizes(fake):
      # Without recorded metadata we cannot prove the sizes are static, so
      # the shape goes into the signature.
      return ArgKind.DYNAMIC_TENSOR
    return ArgKind.TENSOR
  check_scalar_input(index, arg)
  if isinstance(arg, Number):
    if isinstance(arg, int) and not isinstance(
        arg, bool) and (fake is None or isinstance(fake, torch.SymInt)):
      return ArgKind.SHAPE
    return ArgKind.SCALAR
  raise AssertionError('unreachable: check_scalar_input accepted it')


def check_scalar_input(index: int, arg: Any) -> None:
  """Raises UnsupportedGraphInput, naming the input, for a non-tensor input
  that is not a concrete Python number."""
  if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
    raise UnsupportedGraphInput(
        f'{describe_arg(index, arg)} is symbolic at run time; the bridge needs '
        'concrete values.')
  if not isinstance(arg, Number):
    raise UnsupportedGraphInput(
        f'{describe_arg(index, arg)} has a type the XLA dynamo bridge cannot '
        'handle; graph inputs must be XLA tensors, ints, floats or bools.')


@dataclasses.dataclass(frozen=True)
class ShapeSignature:
  """A signature with named parts, built from a key when one is needed
  (explaining a miss, persisting the index), never on the per-call path."""
  # (position, value) of each int input that is a size symbol.
  shape_values: Tuple[Tuple[int, Any], ...]
  # (position, value) of each other scalar input.
  scalar_values: Tuple[Tuple[int, Any], ...]
  # (position, sizes) of each tensor input with symbolic sizes.
  tensor_shapes: Tuple[Tuple[int, Tuple[int, ...]], ...]
  # (position, sharding spec) of each tensor input under SPMD, else ().
  shardings: Tuple[Tuple[int, str], ...]

  def describe(self) -> str:
    """The signature in one line: the sizes of each tensor with symbolic
    sizes, then each int and scalar input, by graph input position."""
    parts = [
        f'input {pos}: [{", ".join(str(s) for s in sizes)}]'
        for pos, sizes in self.tensor_shapes
    ]
    parts.extend(f'input {pos}: {value!r}' for pos, value in self.shape_values +
                 self.scalar_values)
    return 'signature (' + '; '.join(parts) + ')'

  def differences(self, other: 'ShapeSignature') -> List[str]:
    """The parts in which `other` (before) and self (after) differ."""
    parts = []
    for field in dataclasses.fields(self):
      before = dict(getattr(other, field.name))
      after = dict(getattr(self, field.name))
      for pos in sorted(set(before) | set(after)):
        if before.get(pos) != after.get(pos):
          parts.append(f'{field.name}[input {pos}]: '
                       f'{before.get(pos)!r} -> {after.get(pos)!r}')
    return parts


@dataclasses.dataclass(frozen=True)
class ArgLayout:
  """Which graph input is what; computed once per graph.

  Args:
    kinds: the kind of each graph input, by position.
    spmd: whether input shardings are part of the signature.
  """
  kinds: Tuple[ArgKind, ...]
  spmd: bool = False

  @classmethod
  def from_graph(cls,
                 xla_model: Optional[torch.fx.GraphModule],
                 args: Sequence[Any],
                 spmd: bool = False) -> 'ArgLayout':
    fakes = placeholder_values(xla_model, len(args))
    kinds = tuple(
        _classify(i, arg, fake)
        for i, (arg, fake) in enumerate(zip(args, fakes)))
    return cls(kinds=kinds, spmd=spmd)

  def positions(self, *kinds: ArgKind) -> Tuple[int, ...]:
    return tuple(i for i, kind in enumerate(self.kinds) if kind in kinds)

  @property
  def tensor_positions(self) -> Tuple[int, ...]:
    return tuple(i for i, kind in enumerate(self.kinds) if kind.is_tensor)

  @property
  def scalar_positions(self) -> Tuple[int, ...]:
    return self.positions(ArgKind.SHAPE, ArgKind.SCALAR)

  @property
  def dynamic_tensor_positions(self) -> Tuple[int, ...]:
    return self.positions(ArgKind.DYNAMIC_TENSOR)

  def key_function(self) -> Callable[[Sequence[Any]], Hashable]:
    """A function args -> hashable key; see [Note: Shape signatures]."""
    scalar_getter = tuple_getter(self.scalar_positions)
    dynamic_positions = self.dynamic_tensor_positions
    if self.spmd:
      import torch_xla
      tensor_getter = tuple_getter(self.tensor_positions)
      get_specs = torch_xla._XLAC._get_xla_sharding_specs

      def spmd_key(args):
        return (scalar_getter(args),
                tuple(args[i].shape for i in dynamic_positions),
                tuple(get_specs(list(tensor_getter(args)))))

      return spmd_key
    if not dynamic_positions:
      return scalar_getter
    # Every call computes the key: the common layouts (one size, one
    # dynamic tensor) read their positions inline, with no call per item.
    scalar_positions = self.scalar_positions
    if len(scalar_positions) == 1 and len(dynamic_positions) == 1:
      (scalar,), (dynamic,) = scalar_positions, dynamic_positions

      def one_size_key(args):
        return ((args[scalar],), (args[dynamic].shape,))

      return one_size_key
    dynamic_getter = tuple_getter(dynamic_positions)

    def dynamic_key(args):
      return (scalar_getter(args), tuple(map(_SHAPE_OF, dynamic_getter(args))))

    return dynamic_key

  def signature_of(self, args: Sequence[Any]) -> ShapeSignature:
    """The named signature of a call (slow path only)."""
    shardings = ()
    if self.spmd:
      import torch_xla
      positions = self.tensor_positions
      specs = torch_xla._XLAC._get_xla_sharding_specs(
          [args[i] for i in positions])
      shardings = tuple(zip(positions, specs))
    return ShapeSignature(
        shape_values=tuple((i, args[i]) for i in self.positions(ArgKind.SHAPE)),
        scalar_values=tuple(
            (i, args[i]) for i in self.positions(ArgKind.SCALAR)),
        tensor_shapes=tuple(
            (i, tuple(args[i].shape)) for i in self.dynamic_tensor_positions),
        shardings=shardings)


_SHAPE_OF = operator.attrgetter('shape')


def tuple_getter(
    positions: Tuple[int, ...]) -> Callable[[Sequence[Any]], tuple]:
  """Like operator.itemgetter, but always returns a tuple."""
  if not positions:
    return lambda args: ()
  if len(positions) == 1:
    (position,) = positions
    return lambda args: (args[position],)
  return operator.itemgetter(*positions)
