"""The fast path of a served call: past dynamo's frame, guards and wrappers.

[Note: Served fast path]
A served call (serving.ServedModel) normally goes through the code dynamo
captured: its guards, then bytecode that reads every parameter of the model
and calls the compiled graph, then the bridge's per-call key. The fast path
does the same work from what it learned on an earlier call:
  * An ArgumentPlan, built from one call of the full path: where each graph
    argument comes from (a user argument, a parameter or buffer of the model,
    a size of a user argument), checked once against the arguments the full
    path handed the graph.
  * Per call key (the call's structure, each tensor's type, shape, dtype,
    device and requires_grad, each other argument's value: see [Note: Served
    call structure]), the bridge's BoundProgram of that signature (see
    [Note: Bound programs]) and how the user's result is built from the
    graph's outputs. A key is added only after the full path served it, so
    dynamo's guards have accepted those arguments.
  * Captured code that does more than call the graph (a side effect dynamo
    replays, such as Hugging Face's context-variable restores, or an object
    it constructs) gets no fast path: its side effects may depend on values
    only dynamo's guards check (a counter the forward increments is stored as
    a constant), so every call takes the full path.
A call takes the fast path only while what dynamo's guards protect is known
unchanged:
  * the global state (autocast, torch-function enablement, default dtype,
    deterministic algorithms, ...) is the one of the last full call: dynamo's
    GlobalStateGuard, one C++ check. Grad mode may differ: served calls run
    without autograd in either. No torch-function mode and no global forward
    hook is active;
  * no module of the served model changed since the plan was built: the
    ModuleWatch generation, bumped by torch's parameter, buffer and submodule
    registration hooks (an assignment or `register_*`), by `train()` /
    `eval()` and by dtype and device conversions (`to`, `half`, ...);
  * the user-argument key is one the full path served.
Anything else takes the full path, counted per reason (COUNTER_FALLBACK_*);
a full call whose guards fail is served by a re-trace (COUNTER_RETRACE). The
fast path is only built when the captured code does nothing but read
arguments, call the graph and build the result from its outputs (no side
effect to replay). What stays unchecked is listed in the README ("What the
fast path checks"); `config.serve_verify` runs dynamo's guards on every fast
call to find such a change.
"""
import dataclasses
import dis
import logging
import operator
import weakref
from numbers import Number
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch_xla

from torch_xla_patches import call_spec
from torch_xla_patches import config
from torch_xla_patches import torch_internals

logger = logging.getLogger('torch_xla_patches.serving')

# A served call that took the full path because...
COUNTER_FALLBACK_GLOBAL_STATE = 'ServeFallbackGlobalState'  # ...of state
COUNTER_FALLBACK_MODULE = 'ServeFallbackModuleChanged'  # ...a module changed
COUNTER_FALLBACK_ARGUMENTS = 'ServeFallbackNewArguments'  # ...a new key
COUNTER_FALLBACK_NO_PLAN = 'ServeFallbackNoPlan'  # ...there is no plan
# A fast call whose program XLA refused (a parameter with pending IR, an
# evicted program), served through the bridge's callable instead.
COUNTER_BRIDGE_RECOVERY = 'ServeBridgeRecovery'
# A full call refused by dynamo's guards, served by a re-trace.
COUNTER_RETRACE = 'ServeRetrace'
# config.serve_verify: a fast call that dynamo's guards refused.
COUNTER_VERIFY_MISMATCH = 'ServeVerifyMismatch'

_increment_counter = torch_xla._XLAC._xla_increment_counter


class ModuleWatch:
  """A generation number that changes whenever a watched module may have
  changed in a way dynamo's guards would see (see [Note: Served fast
  path]). One per process: `module_watch`."""

  def __init__(self):
    self.generation = 0
    self.installed = False
    self._watched: 'weakref.WeakSet[torch.nn.Module]' = weakref.WeakSet()

  def watch(self, model: torch.nn.Module) -> None:
    for module in model.modules():
      self._watched.add(module)

  def changed(self, module: torch.nn.Module) -> None:
    # While dynamo traces a forward that builds modules (Hugging Face's
    # `self.layers[:n]` makes a ModuleList each call), the hooks run inside
    # the trace: reading the watch set there would become a guard on it.
    # Such modules are the trace's own; a change of a watched module is
    # replayed by the captured code at run time, where the hook runs again.
    if not torch.compiler.is_compiling() and module in self._watched:
      self.generation += 1

  def patches(self) -> List[Tuple[Any, str, Callable[..., Any]]]:
    """(owner, name, replacement) of the nn.Module methods to wrap."""
    original_train = torch.nn.Module.train
    owner, name = torch_internals.module_conversion_method()
    original_convert = getattr(owner, name)
    watch = self

    def train(module, mode=True):
      result = original_train(module, mode)
      watch.changed(module)
      return result

    def convert(module, *args, **kwargs):
      result = original_convert(module, *args, **kwargs)
      watch.changed(module)
      return result

    return [(torch.nn.Module, 'train', train), (owner, name, convert)]

  def install_hooks(self) -> Callable[[], None]:
    """Registers torch's global registration hooks; returns the undo, which
    also ends the watch (every fast path falls back from then on)."""
    hooks = torch.nn.modules.module

    def registered(module, name, value):
      self.changed(module)

    handles = [
        hooks.register_module_parameter_registration_hook(registered),
        hooks.register_module_buffer_registration_hook(registered),
        hooks.register_module_module_registration_hook(registered),
    ]
    self.installed = True

    def undo() -> None:
      for handle in handles:
        handle.remove()
      self.installed = False
      self.generation += 1

    return undo


module_watch = ModuleWatch()


class PlanError(Exception):
  """Why a served model's calls cannot take the fast path."""


# [Note: Captured code the fast path can stand in for]
# The fast path replaces the captured code, so it may only do so for code
# that reads the graph's arguments (from the model's _modules, _parameters
# and _buffers and the call's arguments, sizes through dynamo's call_size),
# calls the graph and builds the result from its outputs and the arguments.
# Anything else (a setattr dynamo replays, a global read, a constructor call)
# is a reason for no plan. Python 3.11's opcodes.
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


def check_captured_code(code: Any) -> None:
  """Raises PlanError naming the first instruction of `code` the fast path
  cannot stand in for (see [Note: Captured code the fast path can stand in
  for])."""
  for instruction in dis.get_instructions(code):
    name, argument = instruction.opname, instruction.argval
    if name in _PLAIN_OPCODES:
      continue
    if name == 'LOAD_ATTR' and argument in _PLAIN_ATTRIBUTES:
      continue
    if name == 'LOAD_GLOBAL' and str(argument).startswith(
        _PLAIN_GLOBAL_PREFIXES):
      continue
    raise PlanError(f'the captured code does more than call the graph '
                    f'({name} {argument!r} at offset {instruction.offset})')


@dataclasses.dataclass(frozen=True)
class ArgumentPlan:
  """Where each graph argument of a served call comes from.

  User arguments are the call's leaves (see [Note: Served call structure]),
  by index.

  Args:
    bound: the graph arguments that are parameters and buffers of the model,
      by identity, at their positions; None at the others.
    user_positions: (graph position, leaf index) of each graph argument that
      is a tensor leaf of the call.
    size_positions: (graph position, leaf index, dim) of each graph argument
      that is a size of a tensor leaf.
  """
  bound: Tuple[Optional[torch.Tensor], ...]
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
  def of_call(cls, model: torch.nn.Module, user_args: Sequence[Any],
              graph_args: Sequence[Any],
              placeholder_values: Sequence[Any]) -> 'ArgumentPlan':
    """The plan of a full call that handed the graph `graph_args`; checked
    against them. Raises PlanError naming the argument it cannot place."""
    user_index = _tensor_index(user_args)
    state = {
        id(tensor)
        for tensor in list(model.parameters()) + list(model.buffers())
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
          raise PlanError(f'graph argument {position} is a tensor that is '
                          'neither a call argument nor a parameter or buffer '
                          'of the model')
        continue
      value = placeholder_values[position]
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


OutputMap = Callable[[Sequence[Any], Sequence[Any]], Any]


def output_map(result: Any, graph_outputs: Sequence[Any],
               user_args: Sequence[Any]) -> OutputMap:
  """A function (graph outputs, user arguments) -> the user's result, read
  off one full call whose result was `result`. Raises PlanError for a part
  of the result that is not a graph output, a user argument or None."""
  output_index = {id(out): i for i, out in enumerate(graph_outputs)}
  if isinstance(result, torch.Tensor) and id(result) in output_index:
    return _bare_output(output_index[id(result)])
  user_index = _tensor_index(user_args)
  flatten, unflatten = torch_internals.pytree()
  leaves, spec = flatten(result)
  sources = []  # ('output' | 'arg', index) or (None, None)
  for leaf in leaves:
    if isinstance(leaf, torch.Tensor) and id(leaf) in output_index:
      sources.append(('output', output_index[id(leaf)]))
    elif isinstance(leaf, torch.Tensor) and id(leaf) in user_index:
      sources.append(('arg', user_index[id(leaf)]))
    elif leaf is None:
      sources.append((None, None))
    else:
      raise PlanError(f'the result holds a {type(leaf).__name__} that is '
                      'not a graph output')
  sources = tuple(sources)

  def rebuild(outputs: Sequence[Any], args: Sequence[Any]) -> Any:
    leaves = [
        None if kind is None else
        (outputs[index] if kind == 'output' else args[index])
        for kind, index in sources
    ]
    return unflatten(leaves, spec)

  return rebuild


def _bare_output(index: int) -> OutputMap:
  return lambda outputs, args: outputs[index]


def _tensor_index(leaves: Sequence[Any]) -> Dict[int, int]:
  """id -> leaf index of the call's tensors (call_key has refused a call
  that passes one tensor twice)."""
  return {
      id(leaf): index
      for index, leaf in enumerate(leaves)
      if isinstance(leaf, torch.Tensor)
  }


def count_retrace() -> None:
  _increment_counter(COUNTER_RETRACE, 1)


# Returned by FastPath.run when the call must take the full path.
NOT_RUN = object()


class FastPath:
  """The fast path of one served model (see [Note: Served fast path]).

  Args:
    compiled: the served CompiledModel (serialization.aot_compile or load).
    model: the served module.
  """

  def __init__(self, compiled: Any, model: torch.nn.Module):
    self._compiled = compiled
    self._model = model
    self._backend = compiled.backend_callable
    self._function_mode_depth = torch_internals.torch_function_mode_depth()
    # Under SPMD a call's key includes each tensor's sharding (see [Note:
    # Served call structure]).
    self._sharding_of = (torch_xla._XLAC._get_xla_sharding_spec
                         if torch_xla.runtime.is_spmd() else None)
    self._global_hooks = torch_internals.global_module_forward_hooks()
    # Why there is no fast path, once known for good (the captured code).
    self.disabled_reason: Optional[str] = None
    try:
      check_captured_code(compiled.transformed_code)
    except PlanError as e:
      self._disable(str(e))
    self._generation = -1
    # The global state of the last full call, and the same with the other
    # grad mode: served calls run without autograd in either.
    self._global_states: Tuple[Any, Any] = ()
    self._plan: Optional[ArgumentPlan] = None
    # Call key -> run(the call's leaves).
    self._runs: Dict[Hashable, Callable[[Sequence[Any]], Any]] = {}
    self._warned_verify = False
    self._last_plan_error: Optional[str] = None
    # Calls served by the fast path.
    self.fast_calls = 0

  def _disable(self, reason: str) -> None:
    self.disabled_reason = reason
    logger.info(
        'torch_xla_patches.serve: calls of %s take the full path (dynamo\'s '
        'guards): %s',
        type(self._model).__name__, reason)

  def run(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """The call's result, or NOT_RUN (counted) if it must take the full
    path."""
    if not self._runs:
      _increment_counter(COUNTER_FALLBACK_NO_PLAN, 1)
      return NOT_RUN
    states = self._global_states
    if not states[0].check():
      if not states[1].check():
        _increment_counter(COUNTER_FALLBACK_GLOBAL_STATE, 1)
        return NOT_RUN
      # The caller switched grad mode: check its mode first from now on.
      self._global_states = (states[1], states[0])
    if (self._function_mode_depth() or self._global_hooks[0] or
        self._global_hooks[1]):
      _increment_counter(COUNTER_FALLBACK_GLOBAL_STATE, 1)
      return NOT_RUN
    if module_watch.generation != self._generation:
      _increment_counter(COUNTER_FALLBACK_MODULE, 1)
      return NOT_RUN
    key, leaves = self.key_of(args, kwargs)
    run = self._runs.get(key)
    if run is None:
      _increment_counter(COUNTER_FALLBACK_ARGUMENTS, 1)
      return NOT_RUN
    if config.serve_verify and not self._verified(args, kwargs):
      return NOT_RUN
    self.fast_calls += 1
    return run(leaves)

  def _verified(self, args: tuple, kwargs: Dict[str, Any]) -> bool:
    if self._compiled.guard_check(*args, **kwargs):
      return True
    _increment_counter(COUNTER_VERIFY_MISMATCH, 1)
    if not self._warned_verify:
      self._warned_verify = True
      logger.warning(
          'torch_xla_patches.serve: XLA_PATCHES_SERVE_VERIFY: dynamo\'s '
          'guards refused a call of %s that the fast path would have served: '
          'something it does not check changed (README, "What the fast path '
          'checks"). Served by the full path.',
          type(self._model).__name__)
    self._plan = None
    self._runs.clear()
    return False

  # -- learning from full calls

  def key_of(self, args: tuple,
             kwargs: Dict[str, Any]) -> Tuple[Optional[Hashable], List[Any]]:
    """(key, leaves) of a call (see call_spec.call_key), read before the
    call runs: running it may change what the key reads (an unsharded SPMD
    input comes back marked replicated)."""
    return call_spec.call_key(args, kwargs, self._sharding_of)

  def learn(self, key: Optional[Hashable], leaves: Sequence[Any], result: Any,
            calls: Sequence[Tuple[tuple, tuple]]) -> None:
    """Updates the fast path from a full call of `key` (see key_of),
    accepted by dynamo's guards, that called the graph as `calls` show."""
    if self.disabled_reason is not None or len(calls) != 1:
      return
    if not module_watch.installed or key is None:
      return
    with torch.set_grad_enabled(not torch.is_grad_enabled()):
      other_grad_mode = torch_internals.global_state_guard()
    self._global_states = (torch_internals.global_state_guard(),
                           other_grad_mode)
    if self._generation != module_watch.generation:
      self._runs.clear()
      self._plan = None
      # Submodules added since the last plan are watched from now on.
      module_watch.watch(self._model)
      self._generation = module_watch.generation
    if key in self._runs:
      return
    try:
      self._runs[key] = self._bound_run(key, leaves, result, calls[0])
    except PlanError as e:
      # Learned again from the next full call.
      self._plan = None
      if str(e) != self._last_plan_error:
        self._last_plan_error = str(e)
        logger.info(
            'torch_xla_patches.serve: no fast path for calls of %s like this '
            'one yet: %s',
            type(self._model).__name__, e)

  def _bound_run(self, key: Hashable, leaves: Sequence[Any], result: Any,
                 call: Tuple[tuple, tuple]) -> Callable[[Sequence[Any]], Any]:
    graph_args, graph_outputs = call
    if self._plan is None:
      self._plan = ArgumentPlan.of_call(
          self._model, leaves, graph_args,
          self._backend.placeholder_values(len(graph_args)))
    else:
      self._plan.check(leaves, graph_args)
    rebuild = output_map(result, graph_outputs, leaves)
    plan = self._plan
    backend = self._backend

    def through_bridge(leaves: Sequence[Any]) -> Any:
      return rebuild(backend(*plan.graph_args(leaves)), leaves)

    cache = backend.signature_cache
    bound = (cache.bound_program(graph_args, plan.free_index)
             if cache is not None else None)
    if bound is None:
      return through_bridge

    def direct(leaves: Sequence[Any]) -> Any:
      try:
        outputs = bound(leaves)
      except RuntimeError:
        # Refused before running (see [Note: Bound programs]): the bridge
        # syncs pending inputs or re-traces an evicted program; the next call
        # of this key learns its program again from a full call.
        _increment_counter(COUNTER_BRIDGE_RECOVERY, 1)
        self._runs.pop(key, None)
        return through_bridge(leaves)
      return rebuild(outputs, leaves)

    return direct
