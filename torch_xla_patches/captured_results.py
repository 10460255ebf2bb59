"""The results the captured code builds (see [Note: Results the captured
code builds]): output_map, which rebuilds a served call's result from its
graph outputs and arguments and checks it against the full call's it was
learned from; and what call_plan's reading of the code after the graph
(the epilogue) calls the objects and containers that code makes (Made,
MroEntry, MadeMethod, TYPE_OF_MADE, ITEMS; RESULT_OPCODES, BUILTINS).
PlanError, which both modules raise, is defined here, below call_plan."""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import torch_internals


class PlanError(Exception):
  """Why a served model's calls cannot take the fast path."""


# Epilogue opcodes that only build the result: opcode -> how many values it
# pops (a function of its argument) and whether it pushes one.
RESULT_OPCODES = {
    'BUILD_LIST': (lambda n: n, True),
    'BUILD_TUPLE': (lambda n: n, True),
    'BUILD_MAP': (lambda n: 2 * n, True),
    'BUILD_CONST_KEY_MAP': (lambda n: n + 1, True),
    'LIST_EXTEND': (lambda n: 1, False),
    'LIST_APPEND': (lambda n: 1, False),
    'LIST_TO_TUPLE': (lambda n: 1, True),
    'BINARY_SUBSCR': (lambda n: 2, True),
}

# [Note: Results the captured code builds]
# dynamo rebuilds a result object the forward made (transformers'
# ModelOutput, any dataclass) after the graph: `cls.__new__(cls)`, then
# `object.__setattr__` of each attribute and, for a dict subclass, its
# base's `clear` and `__setitem__` of each item, with values from the
# graph's outputs, the call's arguments and constants. The fast path stands
# in for that code when
#   * the epilogue calls only those, on objects it made itself (with
#     classes read from its globals and `type(made).__mro__[i]`), or
#     stores attributes of such an object (a plain dataclass's fields: the
#     rebuilt result, compared with the learned one, shows a class whose
#     __setattr__ does more); reads no attribute of anything but a global;
#     and loops only over a dict it built;
#   * every global it reads (the result's class, `object`, `type`) is the
#     object the learned call found, checked per call with the state it
#     sets back (SetBackState); and
#   * the learned call's result, walked, holds only graph outputs, the
#     call's tensors and object arguments (by identity, so a swapped cache
#     object is this call's), constants and None, in tuples, lists, dicts
#     and objects of those classes (output_map).
# A constant in the result is then one the code holds, or a value the call
# key fixes (an argument's value, a size): the epilogue reads nothing else.
# An object the call passed is taken from this call's leaves, never frozen.

# dynamo's name of the builtins module among the captured code's globals.
BUILTINS = '__import_builtins'


@dataclasses.dataclass(frozen=True)
class Made:
  """An object the epilogue made: a result object or a container."""
  index: int


@dataclasses.dataclass(frozen=True)
class MroEntry:
  """`type(made).__mro__[i]`, or an attribute of it."""
  attribute: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class MadeMethod:
  """A method of an object the epilogue made: `made.items`."""
  name: str


# The epilogue's `type(made)` (and its `__mro__`), and `made.items()`
# (and its iterator).
TYPE_OF_MADE = object()
ITEMS = object()

OutputMap = Callable[[Sequence[Any], Sequence[Any]], Any]


def output_map(
    result: Any,
    graph_outputs: Sequence[Any],
    user_args: Sequence[Any],
    result_classes: Sequence[type] = ()) -> OutputMap:
  """A function (graph outputs, user arguments) -> the user's result, read
  off one full call whose result was `result`, and checked to rebuild it.
  Objects of `result_classes` in it are built as the captured code builds
  them (see [Note: Results the captured code builds]). Raises PlanError for
  a part of the result that is not a graph output, a user argument, a
  constant or None."""
  output_index = {id(out): i for i, out in enumerate(graph_outputs)}
  if isinstance(result, torch.Tensor) and id(result) in output_index:
    return _bare_output(output_index[id(result)])
  argument_index = {
      id(leaf): index
      for index, leaf in enumerate(user_args)
      if not isinstance(leaf, _CONSTANTS)
  }
  classes = tuple(result_classes)
  rebuild = _rebuilder(result, output_index, argument_index, classes, 0)
  try:
    rebuilt = rebuild(graph_outputs, user_args)
  except Exception as e:  # pylint: disable=broad-except
    raise PlanError(f'the result cannot be rebuilt ({e})') from None
  if not _same_result(rebuilt, result):
    raise PlanError('the result rebuilt from the graph\'s outputs is not '
                    'the one the captured code built')
  return rebuild


_CONSTANTS = (bool, int, float, str, type(None))
_MAX_RESULT_DEPTH = 32


def _rebuilder(value: Any, output_index: Dict[int, int],
               argument_index: Dict[int, int], classes: Tuple[type, ...],
               depth: int) -> OutputMap:
  """How `value`, a part of a learned result, is made from a call's graph
  outputs and leaves."""
  if depth > _MAX_RESULT_DEPTH:
    raise PlanError('the result is nested too deep')
  if isinstance(value, torch.Tensor) and id(value) in output_index:
    index = output_index[id(value)]
    return lambda outputs, args: outputs[index]
  if id(value) in argument_index:
    # A tensor or object the call passed: this call's, never frozen.
    index = argument_index[id(value)]
    return lambda outputs, args: args[index]
  if type(value) in _CONSTANTS:
    # Fixed by the code or by the call key (see [Note: Results the
    # captured code builds]).
    return lambda outputs, args: value

  def parts(items):
    return [
        _rebuilder(item, output_index, argument_index, classes, depth + 1)
        for item in items
    ]

  kind = type(value)
  if kind in (tuple, list):
    items = parts(value)
    return lambda outputs, args: kind(item(outputs, args) for item in items)
  if kind is dict:
    names, items = tuple(value), parts(value.values())
    return lambda outputs, args: {
        name: item(outputs, args) for name, item in zip(names, items)
    }
  if kind in classes:
    return _object_rebuilder(value, parts)
  # Another container torch's pytree knows (a named tuple, an OrderedDict).
  flatten, unflatten = torch_internals.pytree()
  leaves, spec = flatten(value)
  if not (len(leaves) == 1 and leaves[0] is value):
    items = parts(leaves)
    return lambda outputs, args: unflatten(
        [item(outputs, args) for item in items], spec)
  raise PlanError(f'the result holds a {kind.__name__} that is not a graph '
                  'output or an argument of the call')


def _object_rebuilder(value: Any,
                      parts: Callable[[Any], List[OutputMap]]) -> OutputMap:
  """An object of a result class, made as dynamo's code makes it: new,
  then each attribute and, for a dict, each item, set below any override."""
  kind = type(value)
  names = tuple(vars(value))
  attributes = parts(vars(value).values())
  base = next(
      (klass for klass in kind.__mro__
       if klass.__module__ in ('builtins',
                               'collections') and issubclass(klass, dict)),
      None) if isinstance(value, dict) else None
  keys = tuple(value) if base is not None else ()
  if any(type(key) not in _CONSTANTS for key in keys):
    raise PlanError(f'a {kind.__name__} in the result has a key that is '
                    'not a constant')
  items = parts(value.values()) if base is not None else []
  set_attribute = object.__setattr__

  def rebuild(outputs: Sequence[Any], args: Sequence[Any]) -> Any:
    made = kind.__new__(kind)
    for name, part in zip(names, attributes):
      set_attribute(made, name, part(outputs, args))
    if base is not None:
      set_item = base.__setitem__
      for key, part in zip(keys, items):
        set_item(made, key, part(outputs, args))
    return made

  return rebuild


def _same_result(ours: Any, theirs: Any) -> bool:
  """Whether a rebuilt result is the learned one: the same types and
  structure, the same objects at the leaves, equal constants."""
  if type(ours) is not type(theirs):
    return False
  if ours is theirs:
    return True
  if type(theirs) in _CONSTANTS:
    return ours == theirs or (ours != ours and theirs != theirs)
  if isinstance(theirs, torch.Tensor):
    return False
  if hasattr(theirs, '__dict__') and type(theirs).__module__ != 'builtins':
    if list(vars(ours)) != list(vars(theirs)) or not all(
        _same_result(vars(ours)[k],
                     vars(theirs)[k]) for k in vars(theirs)):
      return False
    if not isinstance(theirs, dict):
      return True
    return list(dict.keys(ours)) == list(dict.keys(theirs)) and all(
        _same_result(dict.__getitem__(ours, k), dict.__getitem__(theirs, k))
        for k in dict.keys(theirs))
  flatten, _ = torch_internals.pytree()
  our_leaves, our_spec = flatten(ours)
  their_leaves, their_spec = flatten(theirs)
  if len(their_leaves) == 1 and their_leaves[0] is theirs:
    return False
  return our_spec == their_spec and all(
      _same_result(a, b) for a, b in zip(our_leaves, their_leaves))


def _bare_output(index: int) -> OutputMap:
  rebuild = lambda outputs, args: outputs[index]
  rebuild.output_index = index
  return rebuild


def bare_output_index(rebuild: OutputMap) -> Optional[int]:
  """The graph output a map returns as it is (a result that is one graph
  output), which a caller may then index directly; else None."""
  return getattr(rebuild, 'output_index', None)
