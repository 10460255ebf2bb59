"""The fast path of a served call: past dynamo's frame, guards and wrappers.

[Note: Served fast path]
A served call (ServedModel) normally goes through the code dynamo
captured: its guards, then bytecode that reads every parameter of the model
and calls the compiled graph, then the bridge's per-call key. The fast path
does the same work from what it learned on an earlier call:
  * A call_plan.ArgumentPlan, built from one call of the full path: where
    each graph argument comes from (a tensor of the call, in its arguments
    or their objects' attributes; a parameter or buffer of the model, or a
    tensor read through a plain attribute of it; a size of a call's tensor;
    an int the graph was traced for), checked once against the arguments
    the full path handed the graph.
  * Per call key (the call's structure, each tensor's type, shape, dtype,
    device and requires_grad, each other argument's value: see [Note: Served
    call structure]), the bridge's BoundProgram of that signature (see
    [Note: Bound programs]) and how the user's result is built from the
    graph's outputs. A key is added only after the full path served it, so
    dynamo's guards have accepted those arguments.
  * What the captured code does besides calling the graph, where the fast
    path can stand in for it (see call_plan.check_captured_code): reading
    graph arguments through plain attributes of the model (ModulePath,
    checked per call) and through items and attributes of the call's
    arguments (a cache object: covered by the call key, see [Note: Objects
    in a call] in call_spec.py); setting back global state transformers
    sets for a forward's duration (skipped while every global it touches
    is the object the learned call found); building the result's objects
    (a ModelOutput, a dataclass: made as the captured code makes them, from
    this call's outputs and arguments, see [Note: Results the captured code
    builds] in captured_results.py). Captured code that does anything else
    (a counter the forward increments, a call of another function) gets no
    fast path: every call takes the full path.
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
  * every tensor the plan binds has the dtype, device, sizes and strides it
    had (one C++ call: the native module's metadata_matches, compared in
    place, else dynamo's tensor guards): a `.data` assignment or
    `torch.utils.swap_tensors` changes the tensor behind the same object
    without any hook;
  * the global state the captured code sets back, and the globals its
    result is built with (the result's class, `object`, `type`), are the
    objects the learned call found (a few attribute reads);
  * every ModulePath still reads the object the plan binds;
  * the user-argument key (shardings included under SPMD; an object
    argument's class, attribute names, tensors and constants) is one the
    full path served.
Costs per call (docs/fast-path.md, "What the fast path checks"): global
state 0.6 us, modes and hooks 0.2 us, module generation 0.05 us, the key
0.7 us per tensor argument, bound tensors one C++ call of about 0.03 us
per tensor with the tensors in the CPU caches and 0.09 us after a run has
evicted them (4 and 11 us for 128).
Anything else takes the full path, counted per reason (COUNTER_FALLBACK_*);
a full call whose guards fail goes to the capture whose guards accept it,
else a new capture (COUNTER_CAPTURED_AGAIN), else a re-trace
(COUNTER_RETRACE). The
fast path is only built for captured code it can stand in for (above).
What stays unchecked is listed in docs/fast-path.md ("Not checked per
call"); `config.serve_verify` runs dynamo's guards on every fast call to
find such a change.
"""
import dataclasses
import itertools
import logging
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch_xla

from torch_xla_patches import call_plan
from torch_xla_patches import call_spec
from torch_xla_patches import captured_results
from torch_xla_patches import config
from torch_xla_patches import execution
from torch_xla_patches import native
from torch_xla_patches import serialization
from torch_xla_patches import torch_internals
from torch_xla_patches.counters import increment_counter

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
# A full call every capture's guards refused, served by a capture of its own
# (see [Note: One capture per guard set] in serving.py).
COUNTER_CAPTURED_AGAIN = 'ServeCapturedAgain'
# config.serve_verify: a fast call that dynamo's guards refused.
COUNTER_VERIFY_MISMATCH = 'ServeVerifyMismatch'


class ModuleWatch:
  """A generation number that changes whenever a watched module may have
  changed in a way dynamo's guards would see (see [Note: Served fast
  path]). One per process: `module_watch`."""

  def __init__(self):
    # Each change takes the next number: a bump is one atomic step, so two
    # threads' changes cannot leave a number a plan was stamped with.
    self._numbers = itertools.count(1)
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
      self.generation = next(self._numbers)

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
      self.generation = next(self._numbers)

    return undo


module_watch = ModuleWatch()


class ServedCalls:
  """Every call of one served model, from its key to its result.

  [Note: One served call]
  A call reads top to bottom in ServedModel.__call__, then `call`:
    1. its key and leaves (call_spec.call_key), computed once, before
       anything runs (a run marks an unsharded SPMD input replicated), and
       the capture its key was routed to (see [Note: One capture per guard
       set] in serving.py);
    2. the fast path, if what dynamo's guards protect is known unchanged
       (see [Note: Served fast path]) and the key has a learned run: the
       run, on the signature's BoundProgram where the program can be bound,
       else through the bridge's callable. A BoundProgram that cannot start
       (execution.RefusedBeforeRun: nothing of the call happened) sends
       the call through the bridge's callable, which recovers, and forgets
       the key;
    3. otherwise the full path: dynamo's guards, then the captured code
       with the graph calls this thread makes observed; where the guards
       refuse the call, a re-trace with torch.compile (nothing learned);
    4. learning from the full call: one transaction under the bridge's
       execution_lock, against the module generation and the global state
       read before the guards ran. If a module changed since (another
       thread swapped a parameter while this call ran), nothing is learned:
       the plan could hold the tensors of either side of the change.
  Learned runs are bounded by config.max_signatures_per_graph (the oldest
  goes first) and dropped as soon as a call sees a changed module or a
  changed bound tensor, so the tensors they hold are let go with them.
  Reads of the learned state take no lock: it is replaced, never edited, by
  writers holding execution_lock, and a run holds that lock itself (see
  [Note: Threads] in execution.py).

  Args:
    compiled: the served CompiledModel (serialization.aot_compile or load).
    model: the served module.
    refused: serves a call whose key and leaves are computed and that
      dynamo's guards refused, given this object first; None: a re-trace.
  """

  def __init__(self,
               compiled: Any,
               model: torch.nn.Module,
               refused: Optional[Callable[..., Any]] = None):
    self.compiled = compiled
    self._model = model
    self._refused = refused
    self._backend = compiled.backend_callable
    self._function_mode_depth = torch_internals.torch_function_mode_depth()
    # Under SPMD a call's key includes each tensor's sharding (see [Note:
    # Served call structure]).
    self.sharding_of = (torch_xla._XLAC._get_xla_sharding_spec
                        if torch_xla.runtime.is_spmd() else None)
    self._global_hooks = torch_internals.global_module_forward_hooks()
    # Loaded where its build step built it (see [Note: Building the native
    # fast path]); learning uses it from then on.
    native.helpers()
    # Why there is no fast path, once known for good (the captured code).
    self.disabled_reason: Optional[str] = None
    captured = call_plan.CapturedCode()
    try:
      captured = call_plan.check_captured_code(compiled.transformed_code)
    except call_plan.PlanError as e:
      self._disable(str(e))
    # What the captured code sets back after the graph, which a fast call
    # must find as it was (see [Note: Global state the captured code sets
    # back] in call_plan.py).
    self._set_back = call_plan.SetBackState(
        captured.set_back,
        compiled.captured_globals if captured.set_back else {})
    # The model's attributes the captured code reads the graph's arguments
    # through, besides its parameters, buffers and submodules (see [Note:
    # Captured code the fast path can stand in for] in call_plan.py).
    self._module_paths = captured.module_paths
    # The classes of the objects the captured code builds its result from
    # (see [Note: Results the captured code builds] in captured_results.py);
    # their paths are checked per call with the state it sets back.
    self._result_classes = captured.result_classes
    self._learned = _Learned.NOTHING
    # Watched from the start: a change during the first full call (the
    # warm-up compiles without running, so learns nothing) must be seen.
    module_watch.watch(model)
    self._retraced: Optional[Callable[..., Any]] = None
    # The bound-tensor check that last failed, until it passes again.
    self._changed_behind: Optional[call_plan.BoundTensorCheck] = None
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

  def learned_keys(self) -> int:
    """How many call keys have a learned run."""
    return len(self._learned.runs)

  def call(self, args: tuple, kwargs: Dict[str, Any], key: Optional[Hashable],
           leaves: Sequence[Any]) -> Any:
    """A call whose key and leaves (call_spec.call_key) are computed."""
    run = self._fast_run(key, args, kwargs)
    if run is not None:
      self.fast_calls += 1
      return run(leaves)
    return self.full_call(args, kwargs, key, leaves)

  # -- the fast path

  def _fast_run(self, key: Optional[Hashable], args: tuple,
                kwargs: Dict[str, Any]) -> Optional['_Run']:
    """The learned run of `key` if the fast path may serve the call, else
    None (counted per reason)."""
    learned = self._learned
    if not learned.runs:
      increment_counter(COUNTER_FALLBACK_NO_PLAN, 1)
      return None
    states = learned.global_states
    if not states[0].check():
      if not states[1].check():
        increment_counter(COUNTER_FALLBACK_GLOBAL_STATE, 1)
        return None
      # The caller switched grad mode: check its mode first from now on.
      learned.global_states = (states[1], states[0])
    if (self._function_mode_depth() or self._global_hooks[0] or
        self._global_hooks[1]):
      increment_counter(COUNTER_FALLBACK_GLOBAL_STATE, 1)
      return None
    if module_watch.generation != learned.generation:
      increment_counter(COUNTER_FALLBACK_MODULE, 1)
      self._forget(learned)
      return None
    if (learned.set_back and
        not self._set_back.unchanged_since(learned.set_back)):
      increment_counter(COUNTER_FALLBACK_GLOBAL_STATE, 1)
      return None
    paths = learned.path_check
    if paths is not _NO_PATHS and not paths.unchanged():
      increment_counter(COUNTER_FALLBACK_MODULE, 1)
      self._forget(learned)
      return None
    if config.serve_check_bound_tensors and not learned.bound_check.matches():
      increment_counter(COUNTER_FALLBACK_MODULE, 1)
      self._changed_behind = learned.bound_check
      self._forget(learned)
      return None
    run = learned.runs.get(key)
    if run is None:
      increment_counter(COUNTER_FALLBACK_ARGUMENTS, 1)
      return None
    if config.serve_verify and not self._verified(args, kwargs):
      return None
    return run

  def _verified(self, args: tuple, kwargs: Dict[str, Any]) -> bool:
    if self.compiled.guard_check(*args, **kwargs):
      return True
    increment_counter(COUNTER_VERIFY_MISMATCH, 1)
    if not self._warned_verify:
      self._warned_verify = True
      logger.warning(
          'torch_xla_patches.serve: XLA_PATCHES_SERVE_VERIFY: dynamo\'s '
          'guards refused a call of %s that the fast path would have served: '
          'something it does not check changed (docs/fast-path.md, "Not '
          'checked per call"). Served by the full path.',
          type(self._model).__name__)
    self._forget(self._learned)
    return False

  def _forget(self, learned: '_Learned') -> None:
    """Drops what was learned (if still current), with the tensors its
    plan and runs hold."""
    with execution.execution_lock:
      if self._learned is learned:
        self._learned = _Learned.NOTHING

  # -- the full path

  def full_call(self, args: tuple, kwargs: Dict[str, Any],
                key: Optional[Hashable], leaves: Sequence[Any]) -> Any:
    # What learning is checked against, read before the guards run.
    generation = module_watch.generation
    global_states = _global_states()
    set_back = self._set_back.values() if self._set_back.paths else ()
    paths = (call_plan.ModulePathCheck(self._module_paths, self._model)
             if self._module_paths else _NO_PATHS)
    compiled = self.compiled
    captured = compiled.captured_arguments(args, kwargs)
    if not compiled.guard_check_captured(*captured):
      if self._refused is not None:
        return self._refused(self, args, kwargs, key, leaves)
      return self.retrace(args, kwargs)
    if self._changed_behind is not None:
      self._refuse_changed_behind()
    with self._backend.observed_calls() as calls:
      result = compiled.call_captured(*captured)
    if (self.disabled_reason is None and len(calls) == 1 and key is not None and
        module_watch.installed):
      self._learn(key, leaves, result, calls[0], generation, global_states,
                  set_back, paths)
    return result

  def _refuse_changed_behind(self) -> None:
    """Raises call_plan.BoundTensorChanged while a parameter or buffer the
    program binds has another dtype, shape or strides behind the same object:
    dynamo's guards accepted the call, and the program would be handed a
    tensor it was not compiled for."""
    check = self._changed_behind
    if check.unchanged():
      self._changed_behind = None
      return
    raise call_plan.BoundTensorChanged(
        f'torch_xla_patches.serve: {check.describe(self._model)} of '
        f'{type(self._model).__name__} changed behind its object (a `.data` '
        'assignment or torch.utils.swap_tensors), which dynamo\'s guards do '
        'not check; the compiled program cannot take it. Assign a new '
        'tensor to the attribute (which serve() traces again) or serve() '
        'the model again.')

  def retrace(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """Serves a call the captured code does not apply to (another dtype, a
    changed module, ...) as torch.compile would: dynamo traces it again."""
    increment_counter(COUNTER_RETRACE, 1)
    with execution.execution_lock:
      if self._retraced is None:
        logger.info(
            'torch_xla_patches.serve: dynamo\'s guards refused a call of %s '
            '(%s); such calls are traced again with torch.compile (said '
            'once)',
            type(self._model).__name__,
            self.compiled.guard_failure(*args, **kwargs))
        # A served forward is traced as such (see [Note: Serving a
        # module's forward] in serialization.py).
        target = (serialization.class_forward(self._model)
                  if self.compiled.forward_call else self._model)
        self._retraced = torch.compile(target, backend='openxla', dynamic=True)
    with torch.no_grad():
      return self._retraced(*args, **kwargs)

  # -- learning

  def _learn(self, key: Hashable, leaves: Sequence[Any], result: Any,
             call: Tuple[tuple, tuple], generation: int,
             global_states: Tuple[Any, Any], set_back: Tuple[Any, ...],
             paths: call_plan.ModulePathCheck) -> None:
    """Learns the run of `key` from a full call, accepted by dynamo's
    guards, that called the graph once as `call` shows; `generation`,
    `global_states`, `set_back` and `paths` were read before the guards
    ran."""
    with execution.execution_lock:
      if module_watch.generation != generation:
        return
      if not paths.unchanged():
        # The call (or another thread) set an attribute the graph's
        # arguments are read through: the plan could hold either side.
        return
      if self._set_back.paths and not self._set_back.unchanged_since(set_back):
        # The call changed global state the captured code sets back: the
        # fast path cannot stand in for it (see [Note: Global state the
        # captured code sets back] in call_plan.py).
        self._say_no_plan('the call changed ' +
                          self._set_back.describe_changes(set_back))
        return
      learned = self._learned
      if learned.generation != generation:
        # Submodules added since the last plan are watched from now on.
        module_watch.watch(self._model)
        learned = _Learned.NOTHING
      if key in learned.runs:
        return
      try:
        plan, bound_check = learned.plan, learned.bound_check
        if plan is None:
          plan = call_plan.ArgumentPlan.of_call(
              self._model, leaves, call[0],
              self._backend.placeholder_values(len(call[0])), paths.tensors())
          bound_check = call_plan.BoundTensorCheck(
              [t for t in plan.bound if isinstance(t, torch.Tensor)])
        else:
          plan.check(leaves, call[0])
        run = self._make_run(plan, leaves, result, call)
      except call_plan.PlanError as e:
        # Learned again from the next full call.
        self._learned = _Learned.NOTHING
        self._say_no_plan(str(e))
        return
      runs = dict(learned.runs)
      runs[key] = run
      cap = config.max_signatures_per_graph
      while cap > 0 and len(runs) > cap:
        del runs[next(iter(runs))]
      if learned.plan is not None:
        # One check per plan: its paths read what the plan binds.
        paths = learned.path_check
      self._learned = _Learned(generation=generation,
                               global_states=global_states,
                               plan=plan,
                               bound_check=bound_check,
                               runs=runs,
                               set_back=set_back,
                               path_check=paths)

  def _say_no_plan(self, reason: str) -> None:
    if reason != self._last_plan_error:
      self._last_plan_error = reason
      logger.info(
          'torch_xla_patches.serve: no fast path for calls of %s like this '
          'one yet: %s',
          type(self._model).__name__, reason)

  def _make_run(self, plan: call_plan.ArgumentPlan, leaves: Sequence[Any],
                result: Any, call: Tuple[tuple, tuple]) -> '_Run':
    graph_args, graph_outputs = call
    try:
      classes = [
          path.value(self._set_back.globals_) for path in self._result_classes
      ]
    except (KeyError, AttributeError):
      raise call_plan.PlanError('a class the result is built from is gone')
    rebuild = captured_results.output_map(result, graph_outputs, leaves,
                                          classes)
    backend = self._backend

    def through_bridge(leaves: Sequence[Any]) -> Any:
      return rebuild(backend(*plan.graph_args(leaves)), leaves)

    cache = backend.signature_cache
    bound = (cache.bound_program(graph_args, plan.free_index)
             if cache is not None else None)
    if bound is None:
      return through_bridge

    output_index = captured_results.bare_output_index(rebuild)

    def bound_run(leaves: Sequence[Any]) -> Any:
      try:
        outputs = bound(leaves)
      except execution.RefusedBeforeRun:
        increment_counter(COUNTER_BRIDGE_RECOVERY, 1)
        self._forget_run(bound_run)
        return through_bridge(leaves)
      if output_index is not None:
        return outputs[output_index]
      return rebuild(outputs, leaves)

    return bound_run

  def _forget_run(self, run: '_Run') -> None:
    with execution.execution_lock:
      learned = self._learned
      runs = {key: r for key, r in learned.runs.items() if r is not run}
      if len(runs) != len(learned.runs):
        self._learned = dataclasses.replace(learned, runs=runs)


# A learned run: the call's leaves -> the user's result.
_Run = Callable[[Sequence[Any]], Any]

# The check of captured code that reads no module path.
_NO_PATHS = call_plan.ModulePathCheck((), None)


@dataclasses.dataclass
class _Learned:
  """What the fast path learned from full calls of one module generation
  (see [Note: One served call]); replaced as a whole, except that a call may
  swap the order of global_states.

  Args:
    generation: the module_watch generation of the full calls.
    global_states: the global state guard of the last full call, and the
      same with the other grad mode: served calls run without autograd in
      either.
    plan: where the graph's arguments come from.
    bound_check: whether the plan's bound tensors keep their metadata.
    runs: call key -> its run, oldest first.
    set_back: what the global state the captured code sets back read
      before the full calls (see [Note: Global state the captured code sets
      back] in call_plan.py); () when it sets nothing back.
    path_check: whether the model's attributes the plan's tensors were
      read through still read them (call_plan.ModulePathCheck).
  """
  generation: int
  global_states: Tuple[Any, ...]
  plan: Optional[call_plan.ArgumentPlan]
  bound_check: 'call_plan.BoundTensorCheck'
  runs: Dict[Hashable, _Run]
  set_back: Tuple[Any, ...] = ()
  path_check: call_plan.ModulePathCheck = _NO_PATHS


_Learned.NOTHING = _Learned(generation=-1,
                            global_states=(),
                            plan=None,
                            bound_check=call_plan.BoundTensorCheck(()),
                            runs={})


def _global_states() -> Tuple[Any, Any]:
  """The global state guard of this thread now, and the same with the other
  grad mode."""
  with torch.set_grad_enabled(not torch.is_grad_enabled()):
    other_grad_mode = torch_internals.global_state_guard()
  return torch_internals.global_state_guard(), other_grad_mode
