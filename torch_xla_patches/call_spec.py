"""A served call's arguments as one structure: CallSpec, call_key, layout.

[Note: Served call structure]
A served model is called as it is called eagerly: positional and keyword
arguments, each a tensor, a Python scalar, a string, None, or a list, tuple
or dict nesting them (per-layer caches, a dict of inputs). Walking a call's
(args, kwargs) gives its leaves, in order, and its key:
  * the structure: container types, lengths and dict keys. Keyword
    arguments are taken in name order, so the order a caller writes them in
    is not part of the key;
  * per tensor leaf, its type, shape, dtype, device and requires_grad (what
    dynamo's tensor guards compare) and, under SPMD, its sharding spec (which
    dynamo does not guard, and which picks another XLA program: a sharded
    argument run by a replicated program fails in XLA);
  * per other leaf, its type and value. An int leaf may be symbolic in the
    captured graph (dynamic=True) and then feeds the bridge's signature by
    value; a bool, float, string or None is a constant dynamo guards on.
    Either way another value is another key, so a key decides the program.
A call the walk cannot key (another container type, a tensor passed twice,
which dynamo guards as an alias) has no key: it takes the full path.

[Note: Objects in a call]
An argument may be an object holding tensors in its attributes (anything
with a __dict__ that is no tensor, container or constant): a transformers
StaticCache, which generate() passes to every step. A bucket holds an
example of it, as the call would pass it (a cache of the batch and length
the bucket serves, initialized for a decode bucket). The warm-up calls such
a bucket with a deep copy of the example, never the example itself, so the
example keeps what its owner left in it. A bucket's layout names the
object's class and, walking its attributes, each tensor's dtype and rank,
each int as an int and every other constant by value.

A call's key walks such an object as it walks a dict: its class and its
attribute names (in the order of its __dict__), then each attribute's
value, so each tensor's shape, dtype, device and requires_grad and each
constant's value (torch.device and torch.dtype among them) are part of the
key, and the object and its tensors are leaves in walk order. So two calls
of one key hold their tensors at the same attribute paths, and what the
captured code reads through them (`cache.layers[0].keys`) is the leaf at
the same index: the fast path reads this call's object, and a cache of
another length is another key. Only attributes in the instance's __dict__
are walked; an object holding a tensor twice (or one another argument
holds) has no key, nor has a torch.nn.Module passed as an argument (its
state is the model's checks' business), as dynamo guards aliasing.

Buckets are described the same way, with TensorSpec for tensors: CallSpec
holds (args, kwargs) of TensorSpec and constants. Its `layout` is what every
bucket of one served model shares and what an artifact is made for: the
structure, each tensor's dtype and rank, each int as an int (its value may
vary), and every other constant by value.
"""
import copy
import dataclasses
import inspect
import types
from typing import (Any, Callable, Dict, Hashable, List, Optional, Sequence,
                    Set, Tuple)

import torch

from torch_xla_patches import io_utils
from torch_xla_patches import native
from torch_xla_patches.io_utils import TensorSpec

_CONSTANT_TYPES = (bool, int, float, str, type(None))


class CallStructureError(TypeError):
  """A bucket or call that cannot be described; the message names the
  argument."""


@dataclasses.dataclass(frozen=True, init=False)
class CallSpec:
  """One serving bucket: the arguments of a call, with a TensorSpec for each
  tensor, as the model is called.

    CallSpec(TensorSpec((4, 128), torch.long),
             attention_mask=TensorSpec((4, 128), torch.long))
    CallSpec(tokens_spec, [cache_spec] * layers, position=0)

  Args:
    *args, **kwargs: TensorSpecs, Python scalars, strings and None, nested in
      lists, tuples and dicts (see [Note: Served call structure]).
  """
  args: tuple
  kwargs: Dict[str, Any]

  def __init__(self, *args, **kwargs):
    object.__setattr__(self, 'args', tuple(args))
    object.__setattr__(self, 'kwargs', dict(kwargs))
    for index, arg in enumerate(self.args):
      _check_spec_tree(arg, f'argument {index}')
    for name, arg in self.kwargs.items():
      _check_spec_tree(arg, f'argument {name!r}')

  @classmethod
  def of(cls, bucket: Any) -> 'CallSpec':
    """A bucket as serve() and precompile() take it: a CallSpec, a tuple or
    list of positional argument specs, or one TensorSpec."""
    if isinstance(bucket, CallSpec):
      return bucket
    if isinstance(bucket, TensorSpec):
      return cls(bucket)
    if isinstance(bucket, (tuple, list)):
      return cls(*bucket)
    raise CallStructureError(
        f'a bucket is a CallSpec, a tuple of argument specs or a TensorSpec, '
        f'not {type(bucket).__name__}')

  def materialize(self,
                  device: Any,
                  pool: Optional[Dict[Tuple[TensorSpec, int],
                                      torch.Tensor]] = None,
                  for_trace: bool = False) -> Tuple[tuple, Dict[str, Any]]:
    """(args, kwargs) with zeros for every TensorSpec (see
    io_utils.zeros_on_device).

    Args:
      for_trace: for a call that runs nothing (a warm-up's, a capture's, a
        guard check's): each TensorSpec, and each tensor of an object's copy,
        is a placeholder without a buffer (see [Note: Placeholder tensors]
        in io_utils.py).
      pool: tensors made for earlier buckets, by (spec, how many tensors of
        that spec came before it in its call), reused instead of made again
        and filled in with what is made here. A warm-up of many buckets then
        holds one tensor per place, not one per bucket (a KV cache of every
        bucket, say); a tensor is never reused twice in one call. Their
        values are whatever the earlier calls left (warm-up calls compile,
        their results are not read).
    """
    seen: Dict[Any, int] = {}
    copy_object = _copy_for_trace if for_trace else copy.deepcopy

    def tensor(spec: TensorSpec) -> torch.Tensor:
      return spec.for_trace(device) if for_trace else spec.materialize(device)

    def make(leaf: Any) -> Any:
      if is_object_argument(leaf):
        # See [Note: Objects in a call].
        if pool is None:
          return copy_object(leaf)
        place = (('cache', id(leaf)), seen.get(id(leaf), 0))
        seen[id(leaf)] = place[1] + 1
        if place not in pool:
          pool[place] = copy_object(leaf)
        return pool[place]
      if not isinstance(leaf, TensorSpec):
        return leaf
      if pool is None:
        return tensor(leaf)
      place = (leaf, seen.get(leaf, 0))
      seen[leaf] = place[1] + 1
      if place not in pool:
        pool[place] = tensor(leaf)
      return pool[place]

    return _map_leaves(self.args, make), _map_leaves(self.kwargs, make)

  @property
  def tensor_specs(self) -> List[TensorSpec]:
    leaves: List[Any] = []
    _spec_leaves((self.args, self.kwargs), leaves)
    return [leaf for leaf in leaves if isinstance(leaf, TensorSpec)]

  def layout(self) -> Any:
    """What buckets of one model share (see [Note: Served call
    structure]): a JSON-able nesting of lists."""
    kwargs = _sorted(self.kwargs)
    return [
        'call', [_layout(arg) for arg in self.args],
        [[name, _layout(value)] for name, value in kwargs.items()]
    ]

  def describe(self) -> str:
    parts = [_describe(arg) for arg in self.args]
    parts += [
        f'{name}={_describe(value)}' for name, value in self.kwargs.items()
    ]
    return '(' + ', '.join(parts) + ')'


def _sorted(kwargs: Dict[str, Any]) -> Dict[str, Any]:
  return {name: kwargs[name] for name in sorted(kwargs)}


def is_object_argument(value: Any) -> bool:
  """Whether `value` is an object argument (see [Note: Objects in a
  call])."""
  return (hasattr(value, '__dict__') and not isinstance(
      value, (torch.Tensor, TensorSpec, CallSpec, tuple, list, dict, type,
              types.FunctionType, types.MethodType, types.ModuleType)))


def argument_tensors(value: Any) -> List[torch.Tensor]:
  """The tensors of a call's arguments: in lists, tuples and dicts, and in
  the attributes of objects (see [Note: Objects in a call])."""
  found: List[torch.Tensor] = []
  seen: Set[int] = set()

  def walk(value: Any, depth: int) -> None:
    if depth > _MAX_DEPTH or id(value) in seen:
      return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
      found.append(value)
    elif isinstance(value, (tuple, list)):
      for item in value:
        walk(item, depth + 1)
    elif isinstance(value, dict):
      for item in value.values():
        walk(item, depth + 1)
    elif is_object_argument(value):
      for item in vars(value).values():
        walk(item, depth + 1)

  walk(value, 0)
  return found


def _copy_for_trace(value: Any) -> Any:
  """A deep copy of an object argument whose XLA tensors are placeholders
  of their sizes and dtypes (see [Note: Placeholder tensors] in
  io_utils.py): a tensor the object holds twice is one placeholder held
  twice. Views and, on a mesh, every tensor are copied as deepcopy copies
  them (a placeholder has no base to view, nor a sharding)."""
  import torch_xla.runtime as xr
  memo: Dict[int, Any] = {}
  if not xr.is_spmd():
    for tensor in argument_tensors(value):
      if tensor.device.type == 'xla' and not tensor._is_view():
        memo[id(tensor)] = io_utils.placeholder(tensor.shape, tensor.dtype)
  return copy.deepcopy(value, memo)


def _object_layout(value: Any, depth: int = 0) -> Any:
  """The layout of an object argument's attribute (see [Note: Objects in a
  call]): what _layout gives, with a tensor's dtype and rank."""
  if depth > _MAX_DEPTH:
    return ['deep']
  if isinstance(value, torch.Tensor):
    return ['tensor', io_utils.dtype_name(value.dtype), value.dim()]
  if isinstance(value, (tuple, list)):
    return [
        type(value).__name__,
        [_object_layout(item, depth + 1) for item in value]
    ]
  if isinstance(value, dict):
    return [
        'dict',
        [[str(name), _object_layout(item, depth + 1)]
         for name, item in value.items()]
    ]
  if is_object_argument(value):
    return [
        'object',
        type(value).__qualname__,
        [[name, _object_layout(item, depth + 1)]
         for name, item in sorted(vars(value).items())]
    ]
  if isinstance(value, (torch.device, torch.dtype)):
    return [type(value).__name__, str(value)]
  if isinstance(value, _CONSTANT_TYPES):
    return _layout(value)
  # Its repr may hold an address, which would change every process's key.
  return ['opaque', type(value).__qualname__]


def _check_spec_tree(value: Any, where: str) -> None:
  if isinstance(value,
                (TensorSpec,) + _CONSTANT_TYPES) or is_object_argument(value):
    return
  if isinstance(value, (tuple, list)):
    for index, item in enumerate(value):
      _check_spec_tree(item, f'{where}[{index}]')
    return
  if isinstance(value, dict):
    for name, item in value.items():
      if not isinstance(name, str):
        raise CallStructureError(
            f'{where} has a dict key {name!r}; dict keys must be strings')
      _check_spec_tree(item, f'{where}[{name!r}]')
    return
  raise CallStructureError(
      f'{where} is {type(value).__name__}; describe tensors with TensorSpec '
      'and other arguments as Python scalars, strings, None, objects, or '
      'lists, tuples and dicts of them')


def _map_leaves(value: Any, function: Callable[[Any], Any]) -> Any:
  """`value` with `function` applied to each leaf of its lists, tuples and
  dicts."""
  if isinstance(value, (tuple, list)):
    return type(value)(_map_leaves(item, function) for item in value)
  if isinstance(value, dict):
    return {name: _map_leaves(item, function) for name, item in value.items()}
  return function(value)


def _spec_leaves(value: Any, leaves: List[Any]) -> None:
  if isinstance(value, (tuple, list)):
    for item in value:
      _spec_leaves(item, leaves)
  elif isinstance(value, dict):
    for item in value.values():
      _spec_leaves(item, leaves)
  else:
    leaves.append(value)


def _layout(value: Any) -> Any:
  if is_object_argument(value):
    return _object_layout(value)
  if isinstance(value, TensorSpec):
    return ['tensor', io_utils.dtype_name(value.dtype), len(value.shape)]
  if isinstance(value, (tuple, list)):
    return [type(value).__name__, [_layout(item) for item in value]]
  if isinstance(value, dict):
    return ['dict', [[name, _layout(item)] for name, item in value.items()]]
  if isinstance(value, int) and not isinstance(value, bool):
    return ['int']
  return [type(value).__name__, value]


def _describe(value: Any) -> str:
  if isinstance(value, TensorSpec):
    return value.describe()
  if is_object_argument(value):
    tensors = argument_tensors(value)
    return f'{type(value).__name__}({len(tensors)} tensors)'

  if isinstance(value, tuple):
    return '(' + ', '.join(_describe(item) for item in value) + ')'
  if isinstance(value, list):
    return '[' + ', '.join(_describe(item) for item in value) + ']'
  if isinstance(value, dict):
    return '{' + ', '.join(
        f'{name!r}: {_describe(item)}' for name, item in value.items()) + '}'
  return repr(value)


def describe_layout(layout: Any) -> str:
  """A layout (CallSpec.layout) as one line, for messages."""
  kind = layout[0]
  if kind == 'call':
    parts = [describe_layout(item) for item in layout[1]]
    parts += [f'{name}={describe_layout(item)}' for name, item in layout[2]]
    return '(' + ', '.join(parts) + ')'
  if kind == 'tensor':
    return f'{layout[1]}[rank {layout[2]}]'
  if kind == 'int':
    return 'int'
  if kind == 'object':
    return layout[1]
  if kind in ('tuple', 'list'):
    inner = ', '.join(describe_layout(item) for item in layout[1])
    return f'({inner})' if kind == 'tuple' else f'[{inner}]'
  if kind == 'dict':
    return '{' + ', '.join(
        f'{name}: {describe_layout(item)}' for name, item in layout[1]) + '}'
  return repr(layout[1])


# -- calls

ShardingOf = Callable[[torch.Tensor], str]


def call_key(
    args: tuple,
    kwargs: Dict[str, Any],
    sharding_of: Optional[ShardingOf] = None
) -> Tuple[Optional[Hashable], List[Any]]:
  """(key, leaves) of a call (see [Note: Served call structure]); the key is
  None for a call that cannot be keyed. Leaves are in walk order, keyword
  arguments by name. `sharding_of` (under SPMD) gives a tensor's sharding
  spec. Where the native module is loaded (native.py) it computes the key:
  another form, equal for exactly the same calls."""
  helpers = native.loaded()
  if helpers is not None:
    return helpers.call_key(args, kwargs, sharding_of, _OBJECT_KEYING)
  if not kwargs and len(args) == 1:
    # The common case, without a walk.
    (arg,) = args
    if type(arg) is torch.Tensor:
      if sharding_of is None:
        return (arg.shape, arg.dtype, arg.device, arg.requires_grad), [arg]
      return (arg.shape, arg.dtype, arg.device, arg.requires_grad,
              sharding_of(arg)), [arg]
  leaves: List[Any] = []
  parts: List[Any] = []
  try:
    _walk(args, leaves, parts, sharding_of)
    if kwargs:
      names = tuple(sorted(kwargs))
      parts.append(names)
      for name in names:
        _walk(kwargs[name], leaves, parts, sharding_of, depth=1)
  except _Unkeyable:
    return None, leaves
  tensors = [id(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
  if len(set(tensors)) != len(tensors):
    return None, leaves
  return tuple(parts), leaves


class _Unkeyable(Exception):
  pass


# Deeper (or cyclic) structures are not keyed: the call takes dynamo's path.
_MAX_DEPTH = 64


def _walk(value: Any,
          leaves: List[Any],
          parts: List[Any],
          sharding_of: Optional[ShardingOf],
          depth: int = 0) -> None:
  if depth > _MAX_DEPTH:
    raise _Unkeyable()
  kind = type(value)
  if isinstance(value, torch.Tensor):
    leaves.append(value)
    try:
      shape = value.shape
    except RuntimeError:
      # A tensor without sizes (a nested tensor).
      raise _Unkeyable() from None
    if sharding_of is None:
      parts.append(
          (kind, shape, value.dtype, value.device, value.requires_grad))
    else:
      parts.append((kind, shape, value.dtype, value.device, value.requires_grad,
                    sharding_of(value)))
  elif kind is tuple or kind is list:
    parts.append((kind, len(value)))
    for item in value:
      _walk(item, leaves, parts, sharding_of, depth + 1)
  elif kind is dict:
    parts.append((dict, tuple(value)))
    for item in value.values():
      _walk(item, leaves, parts, sharding_of, depth + 1)
  elif kind in _CONSTANT_TYPES or kind in _OBJECT_CONSTANT_TYPES:
    leaves.append(value)
    parts.append((kind, value))
  elif is_keyed_object(kind):
    # See [Note: Objects in a call].
    attributes = getattr(value, '__dict__', None)
    if type(attributes) is not dict:
      raise _Unkeyable()
    leaves.append(value)
    parts.append((kind, tuple(attributes)))
    for item in tuple(attributes.values()):
      _walk(item, leaves, parts, sharding_of, depth + 1)
  else:
    raise _Unkeyable()


# Constants an object argument holds (a cache's device and dtype): keyed by
# value, as the other constants are.
_OBJECT_CONSTANT_TYPES = (torch.device, torch.dtype)
# type -> whether its instances are keyed as objects (is_object_argument,
# which depends on the type alone); shared with the native module.
_keyed_object_types: Dict[type, bool] = {}


def is_keyed_object(kind: type) -> bool:
  """Whether a call's value of type `kind` is an object argument whose
  attributes the call key walks (see [Note: Objects in a call]): it has a
  __dict__ and is no tensor, container, constant, class, function, module
  or torch.nn.Module (whose state the model's own checks cover)."""
  known = _keyed_object_types.get(kind)
  if known is None:
    known = (kind not in _CONSTANT_TYPES and '__dict__' in _slot_names(kind) and
             not issubclass(kind, (torch.nn.Module, TensorSpec, CallSpec)) and
             not issubclass(kind, _NOT_OBJECT_TYPES))
    _keyed_object_types[kind] = known
  return known


_NOT_OBJECT_TYPES = (torch.Tensor, tuple, list, dict, type, types.FunctionType,
                     types.MethodType, types.BuiltinFunctionType,
                     types.ModuleType, torch.device, torch.dtype)

# What the native module's call_key needs to key objects as _walk does.
_OBJECT_KEYING = (_keyed_object_types, is_keyed_object, _OBJECT_CONSTANT_TYPES)


def _slot_names(kind: type) -> Set[str]:
  """The attribute names the instances of `kind` have as a type slot (its
  MRO's __dict__ entries): '__dict__' where instances have one."""
  return {name for klass in kind.__mro__ for name in vars(klass)}


def spec_of_call(args: Sequence[Any], kwargs: Dict[str, Any]) -> CallSpec:
  """The CallSpec a call fits (its tensors' sizes and dtypes)."""

  def spec_of(leaf: Any) -> Any:
    return TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else leaf

  return CallSpec(*_map_leaves(tuple(args), spec_of),
                  **_map_leaves(dict(kwargs), spec_of))


class KeywordBinding:
  """Binds a call of a module to its forward's parameter names, so that
  `model(ids, mask)`, `model(ids, attention_mask=mask)` and
  `model(input_ids=ids, attention_mask=mask)` are one call: no positional
  arguments and the keyword arguments in parameter order. dynamo guards
  the structure of what it captured, so without this one of them would be
  another capture. A forward with *args or positional-only parameters, or a
  call its signature does not bind (the model raises for it as it would
  eagerly), is left as called.

  Args:
    forward: the module's forward; its signature is read through
      `__wrapped__` (the parameters a decorator passes on).
  """

  def __init__(self, forward: Any):
    try:
      signature = inspect.signature(forward)
    except (TypeError, ValueError):
      signature = None
    if signature is not None and any(
        parameter.kind in (inspect.Parameter.VAR_POSITIONAL,
                           inspect.Parameter.POSITIONAL_ONLY)
        for parameter in signature.parameters.values()):
      signature = None
    self._signature = signature

  def __call__(self, args: tuple,
               kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
    signature = self._signature
    if signature is None:
      return args, kwargs
    try:
      bound = signature.bind(*args, **kwargs)
    except TypeError:
      return args, kwargs
    named: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
      if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
        named.update(value)
      else:
        named[name] = value
    return (), named
