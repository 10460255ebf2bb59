"""How a served call is run without its captured code: the plan of its
arguments (ArgumentPlan; its outputs are captured_results.output_map's),
the check that the captured code does nothing else ([Note: Captured code
the fast path can stand in for]), and the check that the tensors a plan
bound are unchanged (BoundTensorCheck). fast_dispatch learns and runs
plans."""
import builtins
import dataclasses
import dis
import functools
import itertools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import native
from torch_xla_patches.io_utils import TensorSpec
from torch_xla_patches import torch_internals
from torch_xla_patches.captured_results import (BUILTINS, ITEMS, RESULT_OPCODES,
                                                TYPE_OF_MADE, Made, MadeMethod,
                                                MroEntry, PlanError)

# [Note: Captured code the fast path can stand in for]
# The fast path replaces the captured code, so it may only do so for code
# that reads the graph's arguments (from the model's _modules, _parameters
# and _buffers, from other attributes of the model (ModulePath) and the
# call's arguments, sizes through dynamo's call_size), calls the graph and
# builds the result from its outputs and the arguments. Anything else (a
# setattr dynamo replays, a global read, a constructor call, an attribute
# of a call's argument) is a reason for no plan. The code is read with
# Python 3.11's and 3.12's opcodes; under another Python (3.10 and 3.13
# lay out a call's stack otherwise) nothing is read and there is no plan.
#
# An attribute of the model other than a parameter, buffer or submodule (a
# StaticCache the module holds: `module.static_cache.layers[0].keys`) is no
# registration ModuleWatch sees: the plan binds what the learned call read
# there, so every fast call checks that each such path still reads the
# same object (ModulePath), and a call that finds another takes the full
# path (COUNTER_FALLBACK_MODULE).
#
# Items and attributes of the call's arguments (a StaticCache's
# `cache.layers[0].keys`) need no such check: the call key walks every
# attribute of an object argument, so a call of a learned key has the
# same attribute names at every level, and its leaves (the plan's graph
# arguments) are the tensors found at the same places, in this call's
# object (see [Note: Objects in a call] in call_spec.py). A swapped cache
# object of the same sizes is read from; another size is another key.

# The Pythons whose bytecode the plans read (see [Note: Captured code the
# fast path can stand in for]).
_READ_PYTHONS = ((3, 11), (3, 12))
# Python 3.12 folds LOAD_METHOD into LOAD_ATTR (the low bit of its
# argument) and ends a for loop with END_FOR; 3.11 has neither.
_METHODS_IN_LOAD_ATTR = sys.version_info >= (3, 12)
_PLAIN_OPCODES = frozenset({
    'RESUME', 'NOP', 'CACHE', 'LOAD_FAST', 'LOAD_CONST', 'STORE_FAST',
    'DELETE_FAST', 'BINARY_SUBSCR', 'COPY', 'SWAP', 'POP_TOP', 'PUSH_NULL',
    'PRECALL', 'CALL', 'KW_NAMES', 'BUILD_TUPLE', 'BUILD_LIST', 'BUILD_MAP',
    'BUILD_CONST_KEY_MAP', 'LIST_EXTEND', 'LIST_APPEND', 'LIST_TO_TUPLE',
    'UNPACK_SEQUENCE', 'RETURN_VALUE', 'RETURN_CONST'
})
_PLAIN_ATTRIBUTES = frozenset({
    '_modules', '_parameters', '_buffers', 'call_size',
    'record_pregraph_bytecode_enter', 'record_pregraph_bytecode_exit'
})
_PLAIN_GLOBAL_PREFIXES = ('__compiled_fn', '__import_torch_dot__dynamo_dot_')


@dataclasses.dataclass(frozen=True)
class CapturedCode:
  """What the fast path must find unchanged to stand in for captured code.

  Args:
    set_back: the global state it sets back (see [Note: Global state the
      captured code sets back]); () where it sets none.
    module_paths: the model's attributes, other than parameters, buffers
      and submodules, it reads before the graph (see [Note: Captured code
      the fast path can stand in for]).
    result_classes: the classes whose objects it builds the result from
      (see [Note: Results the captured code builds] in
      captured_results.py); also in `set_back`,
      which holds every global its result and state are made with.
  """
  set_back: Tuple['GlobalPath', ...] = ()
  module_paths: Tuple['ModulePath', ...] = ()
  result_classes: Tuple['GlobalPath', ...] = ()


def check_captured_code(code: Any) -> CapturedCode:
  """What the fast path must find unchanged to stand in for `code`. Raises
  PlanError naming the first instruction it cannot stand in for (see [Note:
  Captured code the fast path can stand in for])."""
  if sys.version_info[:2] not in _READ_PYTHONS:
    raise PlanError(
        f'the captured code of Python '
        f'{sys.version_info[0]}.{sys.version_info[1]} is not '
        f'read (only {", ".join("%d.%d" % v for v in _READ_PYTHONS)})')
  instructions = list(dis.get_instructions(code))
  epilogue = next((index + 1
                   for index, instruction in enumerate(instructions)
                   if instruction.opname == 'STORE_FAST' and
                   str(instruction.argval).startswith('graph_out')), None)
  if epilogue is None:
    epilogue = len(instructions)
  module_paths = _module_paths(instructions[:epilogue], _argument_locals(code))
  rest = instructions[epilogue:]
  if _first_unplain(rest) is None:
    return CapturedCode(module_paths=module_paths)
  paths, classes = _set_back_paths(rest)
  return CapturedCode(set_back=paths,
                      module_paths=module_paths,
                      result_classes=classes)


def _first_unplain(instructions: Sequence[Any]) -> Optional[Any]:
  for instruction in instructions:
    name, argument = instruction.opname, instruction.argval
    if name in _PLAIN_OPCODES:
      continue
    if name == 'LOAD_ATTR' and argument in _PLAIN_ATTRIBUTES:
      continue
    if name == 'LOAD_GLOBAL' and str(argument).startswith(
        _PLAIN_GLOBAL_PREFIXES):
      continue
    return instruction
  return None


@dataclasses.dataclass(frozen=True)
class ModulePath:
  """Attributes and items read in turn from the served model, at least one
  of them an attribute other than _modules, _parameters and _buffers:
  ('static_cache', 'layers', 0, 'keys')."""
  steps: Tuple[Any, ...]

  def value(self, model: Any) -> Any:
    """What the path reads now; raises (AttributeError, KeyError,
    IndexError, TypeError) when a part of it is gone."""
    value = model
    for step in self.steps:
      value = getattr(value, step[1]) if step[0] == 'attr' else value[step[1]]
    return value

  def describe(self) -> str:
    return 'model' + ''.join(f'.{name}' if kind == 'attr' else f'[{name!r}]'
                             for kind, name in self.steps)


class ModulePathCheck:
  """Whether each ModulePath reads the object the learned call found."""

  def __init__(self, paths: Sequence[ModulePath], model: Any):
    self._paths = tuple(paths)
    self._model = model
    self._values = self.values()

  def values(self) -> Optional[Tuple[Any, ...]]:
    try:
      return tuple(path.value(self._model) for path in self._paths)
    except (AttributeError, KeyError, IndexError, TypeError):
      return None

  def tensors(self) -> List[torch.Tensor]:
    """The tensors the paths read when this check was made."""
    return [
        value for value in self._values or ()
        if isinstance(value, torch.Tensor)
    ]

  def unchanged(self) -> bool:
    if not self._paths:
      return True
    now = self.values()
    return (now is not None and self._values is not None and
            all(a is b for a, b in zip(now, self._values)))


# The captured function's parameter holding the served model (call_module
# and call_forward in serialization.py).
_MODEL_LOCAL = 'module'
# Opcodes of the code before the graph call that only move values, and how
# many they pop (a function of their argument) and push.
_PROLOGUE_EFFECTS = {
    'PUSH_NULL': (lambda n: 0, 1),
    'PRECALL': (lambda n: 0, 0),
    'KW_NAMES': (lambda n: 0, 0),
    'CALL': (lambda n: n + 2, 1),
    'POP_TOP': (lambda n: 1, 0),
    'BUILD_TUPLE': (lambda n: n, 1),
    'BUILD_LIST': (lambda n: n, 1),
    'BUILD_MAP': (lambda n: 2 * n, 1),
    'BUILD_CONST_KEY_MAP': (lambda n: n + 1, 1),
    'LIST_EXTEND': (lambda n: 1, 0),
    'LIST_APPEND': (lambda n: 1, 0),
    'LIST_TO_TUPLE': (lambda n: 1, 1),
}


def _argument_locals(code: Any) -> Tuple[str, ...]:
  """The captured function's parameters that hold the call's arguments (all
  but the model's)."""
  count = code.co_argcount + code.co_kwonlyargcount
  count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
  return tuple(
      name for name in code.co_varnames[:count] if name != _MODEL_LOCAL)


def _module_paths(
    prologue: Sequence[Any], argument_locals: Sequence[str] = ()
) -> Tuple[ModulePath, ...]:
  """Every ModulePath the code before the graph call reads; raises
  PlanError where it does more than read the graph's arguments (see [Note:
  Captured code the fast path can stand in for])."""
  stack: List[Any] = []
  local_values: Dict[str, Any] = {_MODEL_LOCAL: ()}
  local_values.update((name, _ARGUMENT) for name in argument_locals)
  paths: Dict[ModulePath, None] = {}

  def pop(instruction):
    if not stack:
      raise _does_more(instruction)
    return stack.pop()

  def extend(value: Any, step: Tuple[str, Any]) -> Any:
    if not isinstance(value, tuple):
      return _OTHER
    steps = value + (step,)
    if any(kind == 'attr' and name not in _PLAIN_ATTRIBUTES
           for kind, name in steps):
      paths[ModulePath(steps)] = None
    return steps

  for instruction in prologue:
    name, argument = instruction.opname, instruction.argval
    if name in ('RESUME', 'NOP', 'CACHE', 'DELETE_FAST'):
      continue
    if name == 'LOAD_FAST':
      stack.append(local_values.get(argument, _OTHER))
    elif name == 'STORE_FAST':
      local_values[argument] = pop(instruction)
    elif name == 'LOAD_CONST':
      stack.append(_Constant(argument))
    elif name == 'LOAD_GLOBAL':
      if not str(argument).startswith(_PLAIN_GLOBAL_PREFIXES):
        raise _does_more(instruction)
      if instruction.arg & 1:
        stack.append(_OTHER)  # the NULL before a callable
      stack.append(_OTHER)
    elif name == 'LOAD_ATTR':
      value = pop(instruction)
      if isinstance(value, tuple):
        stack.append(extend(value, ('attr', argument)))
      elif value is _ARGUMENT:
        stack.append(_ARGUMENT)
      elif argument in _PLAIN_ATTRIBUTES:
        stack.append(_OTHER)
      else:
        raise _does_more(instruction)
    elif name == 'BINARY_SUBSCR':
      index, value = pop(instruction), pop(instruction)
      if value is _ARGUMENT:
        stack.append(_ARGUMENT)
      else:
        stack.append(
            extend(value, (
                'item',
                index.value)) if isinstance(index, _Constant) else _OTHER)
    elif name in ('COPY', 'SWAP'):
      _copy_or_swap(stack, instruction)
    elif name == 'UNPACK_SEQUENCE':
      pop(instruction)
      stack.extend([_OTHER] * argument)
    elif name in _PROLOGUE_EFFECTS:
      count, pushes = _PROLOGUE_EFFECTS[name]
      for _ in range(count(instruction.arg or 0)):
        pop(instruction)
      stack.extend([_OTHER] * pushes)
    else:
      raise _does_more(instruction)
  # What a path's prefix reads matters only through what the path reads.
  return tuple(
      path for path in paths
      if not any(other.steps[:len(path.steps)] == path.steps and other != path
                 for other in paths))


def _copy_or_swap(stack: List[Any], instruction: Any) -> None:
  """COPY or SWAP `instruction` on an abstract stack."""
  depth = instruction.argval
  if len(stack) < depth:
    raise _does_more(instruction)
  if instruction.opname == 'COPY':
    stack.append(stack[-depth])
  else:
    stack[-1], stack[-depth] = stack[-depth], stack[-1]


def _does_more(instruction: Any) -> PlanError:
  return PlanError(f'the captured code does more than call the graph '
                   f'({instruction.opname} {instruction.argval!r} at offset '
                   f'{instruction.offset})')


# [Note: Global state the captured code sets back]
# A forward may set module-level state and put it back before it returns
# (transformers' output capturing and kernels' active functions, set for the
# forward's duration). dynamo replays the last value of each such attribute
# after the graph: the captured code ends with stores of constants, and of
# values read from the same globals, into attributes of globals. Skipping
# them changes nothing when they write what is there already. So the fast
# path stands in for such code when
#   * before the graph's outputs are stored, the code is plain (see [Note:
#     Captured code the fast path can stand in for]), and after it, it only
#     loads globals, their attributes and constants, moves them on the stack
#     and stores them into attributes of globals (GlobalPath), with no call;
#   * the full call it learns from leaves every attribute those stores read
#     or write, and the objects they write into, as it found them (the same
#     objects); and
#   * at each fast call they are still those objects.
# Then the stores the full path would make write the values found at
# learning, which were the values already there: skipping them leaves the
# state as the full path would. A call that finds one changed takes the full
# path (COUNTER_FALLBACK_GLOBAL_STATE).


@dataclasses.dataclass(frozen=True)
class GlobalPath:
  """A global of the captured code and the attributes read from it in
  turn: ('__import_transformers_dot_utils', '_active_collector')."""
  names: Tuple[str, ...]

  def attribute(self, name: str) -> 'GlobalPath':
    return GlobalPath(self.names + (name,))

  def value(self, globals_: Dict[str, Any]) -> Any:
    """What the path reads now; raises KeyError or AttributeError when a
    part of it is gone."""
    first = self.names[0]
    # LOAD_GLOBAL falls back to the builtins (`type`).
    value = globals_[first] if first in globals_ else getattr(builtins, first)
    for name in self.names[1:]:
      value = getattr(value, name)
    return value

  def describe(self) -> str:
    return '.'.join(self.names)


@dataclasses.dataclass(frozen=True)
class SetBackState:
  """The global state a fast call must find as the full call it was learned
  from found it (see [Note: Global state the captured code sets back]).

  Args:
    paths: what check_captured_code returned.
    globals_: the globals the captured code runs with.
  """
  paths: Tuple[GlobalPath, ...]
  globals_: Dict[str, Any]

  def values(self) -> Optional[Tuple[Any, ...]]:
    """What the paths read now; None when a part of one is gone."""
    try:
      return tuple(path.value(self.globals_) for path in self.paths)
    except (KeyError, AttributeError):
      return None

  def unchanged_since(self, values: Optional[Tuple[Any, ...]]) -> bool:
    """Whether each path reads the same object as it read into `values`."""
    now = self.values()
    return (now is not None and values is not None and
            all(a is b for a, b in zip(now, values)))

  def describe_changes(self, values: Optional[Tuple[Any, ...]]) -> str:
    now = self.values()
    if now is None or values is None:
      return 'a global it sets back is gone'
    return ', '.join(path.describe()
                     for path, a, b in zip(self.paths, values, now)
                     if a is not b)


# An abstract stack value of an epilogue that is neither a constant nor a
# global path: the graph's outputs, the call's arguments, the result.
_OTHER = object()
# An abstract stack value of a prologue read from the call's arguments: the
# arguments, their items and attributes (see [Note: Captured code the fast
# path can stand in for]).
_ARGUMENT = object()


@dataclasses.dataclass(frozen=True)
class _Constant:
  value: Any


# What LOAD_GLOBAL and PUSH_NULL push below a callable.
_NULL = object()


def _set_back_paths(
    epilogue: Sequence[Any]
) -> Tuple[Tuple[GlobalPath, ...], Tuple[GlobalPath, ...]]:
  """(every GlobalPath the epilogue reads, writes or writes into, the
  classes it builds result objects of), if it only sets global state from
  constants and globals (see [Note: Global state the captured code sets
  back]) and builds its result as [Note: Results the captured code builds]
  in captured_results.py says; raises PlanError otherwise."""
  stack: List[Any] = []
  local_values: Dict[str, Any] = {}
  paths: Dict[GlobalPath, None] = {}
  classes: Dict[GlobalPath, None] = {}
  made = itertools.count()

  def pop(instruction):
    if not stack:
      raise _does_more(instruction)
    return stack.pop()

  def call(instruction, function: Any, args: List[Any]) -> Any:
    """The abstract result of a call the epilogue may make."""
    made_args = args and isinstance(args[0], Made)
    if isinstance(function, GlobalPath):
      owner = GlobalPath(function.names[:-1])
      if (function.names[-1] == '__new__' and len(function.names) > 1 and
          args == [owner]):
        paths[owner] = None
        classes[owner] = None
        return Made(next(made))
      if (function.names == (BUILTINS, 'object', '__setattr__') and
          len(args) == 3 and made_args and isinstance(args[1], _Constant)):
        paths[owner] = None
        return _OTHER
      if function.names == ('type',) and len(args) == 1 and made_args:
        paths[function] = None
        return TYPE_OF_MADE
    if (isinstance(function, MroEntry) and
        function.attribute in ('clear', '__setitem__') and made_args and
        len(args) == (1 if function.attribute == 'clear' else 3)):
      return _OTHER
    if (isinstance(function, MadeMethod) and function.name == 'items' and
        len(args) == 1):
      return ITEMS
    raise _does_more(instruction)

  for instruction in epilogue:
    name, argument = instruction.opname, instruction.argval
    if name in ('RESUME', 'NOP', 'CACHE', 'DELETE_FAST', 'PRECALL', 'KW_NAMES'):
      continue
    if name in ('RETURN_VALUE', 'RETURN_CONST'):
      break
    if name == 'LOAD_GLOBAL':
      if instruction.arg & 1:
        stack.append(_NULL)
      stack.append(GlobalPath((argument,)))
    elif name == 'PUSH_NULL':
      stack.append(_NULL)
    elif name == 'LOAD_ATTR' and not (_METHODS_IN_LOAD_ATTR and
                                      instruction.arg & 1):
      value = pop(instruction)
      if isinstance(value, GlobalPath):
        stack.append(value.attribute(argument))
      elif value is TYPE_OF_MADE and argument == '__mro__':
        stack.append(TYPE_OF_MADE)
      elif argument in _PLAIN_ATTRIBUTES and not isinstance(value, Made):
        stack.append(_OTHER)
      else:
        raise _does_more(instruction)
    elif name in ('LOAD_METHOD', 'LOAD_ATTR'):
      value = pop(instruction)
      if isinstance(value, GlobalPath):
        stack.extend([_NULL, value.attribute(argument)])
      elif isinstance(value, MroEntry) and value.attribute is None:
        stack.extend([_NULL, MroEntry(argument)])
      elif isinstance(value, Made):
        stack.extend([MadeMethod(argument), value])
      else:
        raise _does_more(instruction)
    elif name == 'CALL':
      args = [pop(instruction) for _ in range(argument)][::-1]
      second, first = pop(instruction), pop(instruction)
      if first is _NULL:
        function = second
      else:
        function, args = first, [second] + args
      stack.append(call(instruction, function, args))
    elif name == 'GET_ITER':
      if pop(instruction) is not ITEMS:
        raise _does_more(instruction)
      stack.append(ITEMS)
    elif name == 'FOR_ITER':
      # The loop's body runs on each item; the stack is the same at its
      # end (JUMP_BACKWARD), where the exhausted iterator is popped.
      if not stack or stack[-1] is not ITEMS:
        raise _does_more(instruction)
      stack.append(_OTHER)
    elif name == 'JUMP_BACKWARD':
      if pop(instruction) is not ITEMS:
        raise _does_more(instruction)
    elif name == 'END_FOR' and _METHODS_IN_LOAD_ATTR:
      # Where the exhausted loop goes; JUMP_BACKWARD popped its iterator.
      continue
    elif name == 'UNPACK_SEQUENCE':
      pop(instruction)
      stack.extend([_OTHER] * argument)
    elif name == 'LOAD_CONST':
      stack.append(_Constant(argument))
    elif name == 'LOAD_FAST':
      stack.append(local_values.get(argument, _OTHER))
    elif name == 'STORE_FAST':
      local_values[argument] = pop(instruction)
    elif name in ('COPY', 'SWAP'):
      _copy_or_swap(stack, instruction)
    elif name == 'POP_TOP':
      pop(instruction)
    elif name == 'STORE_ATTR':
      target, value = pop(instruction), pop(instruction)
      if isinstance(target, Made) and value is not _NULL:
        # A field of a result object it made (a plain dataclass).
        continue
      if not isinstance(target, GlobalPath) or not isinstance(
          value, (GlobalPath, _Constant)):
        raise _does_more(instruction)
      paths[target] = None
      paths[target.attribute(argument)] = None
      if isinstance(value, GlobalPath):
        paths[value] = None
    elif name == 'BINARY_SUBSCR':
      index, value = pop(instruction), pop(instruction)
      stack.append(MroEntry() if value is TYPE_OF_MADE else _OTHER)
    elif name in RESULT_OPCODES:
      count, pushes = RESULT_OPCODES[name]
      for _ in range(count(argument or 0)):
        pop(instruction)
      if pushes:
        stack.append(Made(next(made)))
    else:
      raise _does_more(instruction)
  return tuple(paths), tuple(classes)


@dataclasses.dataclass(frozen=True)
class ArgumentPlan:
  """Where each graph argument of a served call comes from.

  User arguments are the call's leaves (see [Note: Served call structure]),
  by index.

  Args:
    bound: the graph arguments that are parameters and buffers of the model,
      by identity, and ints the graph was traced for, at their positions;
      None at the others.
    user_positions: (graph position, leaf index) of each graph argument that
      is a tensor leaf of the call.
    size_positions: (graph position, leaf index, dim) of each graph argument
      that is a size of a tensor leaf.
  """
  bound: Tuple[Any, ...]
  user_positions: Tuple[Tuple[int, int], ...]
  size_positions: Tuple[Tuple[int, int, int], ...]

  def graph_args(self, user_args: Sequence[Any]) -> List[Any]:
    args = list(self.bound)
    for position, index in self.user_positions:
      args[position] = user_args[index]
    for position, index, dim in self.size_positions:
      args[position] = user_args[index].shape[dim]
    return args

  @property
  def free_index(self) -> Dict[int, int]:
    """Graph position -> user argument index, for the bridge's
    bound_program."""
    return dict(self.user_positions)

  @classmethod
  def of_call(
      cls,
      model: torch.nn.Module,
      user_args: Sequence[Any],
      graph_args: Sequence[Any],
      placeholder_values: Sequence[Any],
      attribute_tensors: Sequence[torch.Tensor] = ()
  ) -> 'ArgumentPlan':
    """The plan of a full call that handed the graph `graph_args`; checked
    against them. `attribute_tensors`: tensors the captured code read
    through plain attributes of the model (ModulePath), which each fast
    call checks, bound as parameters are. Raises PlanError naming the
    argument it cannot place."""
    user_index = _tensor_index(user_args)
    state = {
        id(tensor) for tensor in list(model.parameters()) +
        list(model.buffers()) + list(attribute_tensors)
    }
    if len(placeholder_values) != len(graph_args):
      placeholder_values = [None] * len(graph_args)
    # Size symbol -> (graph position, dim) of its first tensor.
    symbol_source: Dict[str, Tuple[int, int]] = {}
    for position, value in enumerate(placeholder_values):
      if isinstance(value, torch.Tensor):
        for dim, size in enumerate(value.shape):
          if isinstance(size, torch.SymInt):
            symbol_source.setdefault(str(size.node.expr), (position, dim))
    bound: List[Optional[torch.Tensor]] = [None] * len(graph_args)
    user_positions = []
    size_positions = []
    for position, arg in enumerate(graph_args):
      if isinstance(arg, torch.Tensor):
        if id(arg) in user_index:
          user_positions.append((position, user_index[id(arg)]))
        elif id(arg) in state:
          bound[position] = arg
        else:
          raise PlanError(
              f'graph argument {position} is a tensor '
              f'({TensorSpec.of(arg).describe()}) that is neither a '
              'call argument (or a tensor of an object argument) nor a '
              'parameter or buffer of the model: a tensor made before the '
              'graph, such as a cache initialized lazily by its first call. '
              'Make it ahead (a StaticCache: `cache.early_initialization'
              '(...)`) and pass it, or hold it in the model, and such calls '
              'take the fast path')
        continue
      value = placeholder_values[position]
      if type(arg) is int and _traced_for(value) == arg:
        # An int the graph was traced for (its symbol specialized, such as
        # transformers' `logits_to_keep=1`): bound as it is. dynamo guards
        # its source's value, which the call key holds where it is an
        # argument.
        bound[position] = arg
        continue
      if isinstance(arg, int) and isinstance(value, torch.SymInt):
        source = symbol_source.get(str(value.node.expr))
        if source is not None and isinstance(graph_args[source[0]],
                                             torch.Tensor):
          tensor = graph_args[source[0]]
          if id(tensor) in user_index:
            size_positions.append((position, user_index[id(tensor)], source[1]))
            continue
      raise PlanError(f'graph argument {position} ({type(arg).__name__}) is '
                      'not a size of a call argument')
    plan = cls(bound=tuple(bound),
               user_positions=tuple(user_positions),
               size_positions=tuple(size_positions))
    plan.check(user_args, graph_args)
    return plan

  def check(self, user_args: Sequence[Any], graph_args: Sequence[Any]) -> None:
    """Raises PlanError unless the plan gives a full call's `graph_args`
    from its leaves `user_args`."""
    if len(graph_args) != len(self.bound):
      raise PlanError(f'the graph took {len(graph_args)} arguments, the plan '
                      f'gives {len(self.bound)}')
    try:
      rebuilt = self.graph_args(user_args)
    except (IndexError, AttributeError):
      raise PlanError('the call\'s arguments have another structure than '
                      'the plan\'s') from None
    for position, (ours, theirs) in enumerate(zip(rebuilt, graph_args)):
      same = (ours is theirs if isinstance(theirs, torch.Tensor) else
              type(ours) is type(theirs) and ours == theirs)
      if not same:
        raise PlanError(f'the plan gives graph argument {position} '
                        f'{ours!r}, the full path {theirs!r}')


def _traced_for(value: Any) -> Optional[int]:
  """The int a graph placeholder's value was specialized to, if it was."""
  if type(value) is int:
    return value
  if isinstance(value, torch.SymInt) and value.node.expr.is_number:
    return int(value.node.expr)
  return None


def _tensor_index(leaves: Sequence[Any]) -> Dict[int, int]:
  """id -> leaf index of the call's tensors (call_key has refused a call
  that passes one tensor twice)."""
  return {
      id(leaf): index
      for index, leaf in enumerate(leaves)
      if isinstance(leaf, torch.Tensor)
  }


class BoundTensorChanged(RuntimeError):
  """A parameter or buffer a served program binds changed dtype, shape or
  strides behind its Python object (see ServedCalls)."""


def _metadata(tensors: Sequence[torch.Tensor]) -> List[tuple]:
  return [(t.dtype, t.device, t.shape, t.stride()) for t in tensors]


class BoundTensorCheck:
  """Whether the tensors a plan binds (parameters and buffers) keep the
  dtype, device, shape and strides they had: `.data` and `swap_tensors`
  change them behind the same objects, where no hook sees it. Called on
  every fast call: one C++ call, the native module's metadata where it is
  loaded, else dynamo's tensor guards."""

  def __init__(self, tensors: Sequence[torch.Tensor]):
    self._tensors = list(tensors)
    self._metadata = _metadata(self._tensors)
    helpers = native.loaded()
    self._native_matches = helpers.metadata_matches if helpers else None
    self._packed = helpers.metadata(self._tensors) if helpers else None
    self._check = (torch_internals.tensor_metadata_check(self._tensors)
                   if self._tensors and not helpers else None)
    # The same answer as calling the check, as one C call where the native
    # module is loaded: a served call makes it every time.
    self.matches: Callable[[], bool] = self.__call__
    if self._native_matches is not None:
      self.matches = functools.partial(self._native_matches, self._tensors,
                                       self._packed)

  def __call__(self) -> bool:
    if self._native_matches is not None:
      return self._native_matches(self._tensors, self._packed)
    # The C++ check also compares dispatch keys, which depend on the
    # calling thread's mode (inference_mode excludes autograd's): where it
    # refuses, the metadata itself decides.
    return (self._check is None or self._check(*self._tensors) or
            self.unchanged())

  def unchanged(self) -> bool:
    return _metadata(self._tensors) == self._metadata

  def describe(self, model: torch.nn.Module) -> str:
    """The first changed tensor, by name, then and now."""
    names = {
        id(t): name for name, t in list(model.named_parameters()) +
        list(model.named_buffers())
    }
    for tensor, then in zip(self._tensors, self._metadata):
      if _metadata([tensor])[0] != then:
        return (f'{names.get(id(tensor), "a bound tensor")} (compiled as '
                f'{TensorSpec(tuple(then[2]), then[0]).describe()}, now '
                f'{TensorSpec.of(tensor).describe()})')
    return 'a bound tensor'
