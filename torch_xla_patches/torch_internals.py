"""The private torch APIs the package uses, each reached through one function.

[Note: Private torch APIs]
Every private torch API the package uses goes through this module: any name
under `torch` with a leading underscore (`torch._dynamo`, `torch._C`,
`torch._decomp`, an OpOverload's `_op_dk` and `_dispatch_cache`), and the
internals around them that torch documents nowhere (the Python dispatcher's
per-op kernels `py_kernels` and `py_impl`, dynamo's config flags, FX's
ShapeEnv). The exceptions are dynamo_bridge.py, which keeps upstream's own
uses, spelled as upstream spells them, so the upstream diff stays small, and
donation.py and fallback_probe.py, whose uses go into the rendered pull
request with them (this module does not). test_torch_internals.py fails on a `torch._` use in any other module.

A function that needs a torch module imports it when called and, if torch
does not have the name, raises `TorchInternalsError` naming it and the torch
version found; the torch releases that have each of them are listed in
versions.py ([Note: Supported releases]). The module imports nothing from the
package but `versions`.
"""
import contextlib
import functools
import importlib
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

from torch_xla_patches import versions


class TorchInternalsError(RuntimeError):
  """A private torch API this package needs is missing."""


def _missing(what: str) -> TorchInternalsError:
  return TorchInternalsError(
      f'torch_xla_patches: {what} is missing from torch '
      f'{versions.runtime_versions().torch}; torch_xla_patches needs the torch '
      'releases listed in torch_xla_patches/versions.py.')


def _attribute(module_name: str, name: str) -> Any:
  try:
    module = importlib.import_module(module_name)
    return getattr(module, name)
  except (ImportError, AttributeError):
    raise _missing(f'{module_name}.{name}') from None


def _config(module_name: str, flags: Sequence[str]) -> Any:
  """The config module `module_name`, which must have every flag in `flags`."""
  module = importlib.import_module(module_name)
  for flag in flags:
    if not hasattr(module, flag):
      raise _missing(f'the config flag {module_name}.{flag}')
  return module


def serializable_callable_base() -> Type:
  """torch's SerializableCallable, or `object` where torch has none (then
  aot_compile, save and load refuse through versions.require_*)."""
  try:
    return _attribute('torch._dynamo.aot_compile', 'SerializableCallable')
  except TorchInternalsError:
    return object


def aot_compiled_function_types() -> Tuple[Type, Type]:
  """(AOTCompiledFunction, CompileArtifacts)."""
  return (_attribute('torch._dynamo.aot_compile', 'AOTCompiledFunction'),
          _attribute('torch._dynamo.aot_compile', 'CompileArtifacts'))


def serialized_code() -> Type:
  """torch._dynamo.package.SerializedCode: code objects to and from a
  picklable form."""
  return _attribute('torch._dynamo.package', 'SerializedCode')


def aot_artifacts(aot_fn: Any) -> Any:
  """The CompileArtifacts an AOTCompiledFunction holds."""
  artifacts = getattr(aot_fn, '_artifacts', None)
  if artifacts is None:
    raise TorchInternalsError(
        f'torch_xla_patches: {type(aot_fn).__name__} has no _artifacts; '
        'this torch release stores aot_compile results differently.')
  return artifacts


def aot_captured_function(aot_fn: Any) -> Callable[..., Any]:
  """The function an AOTCompiledFunction runs once its guards passed (the
  captured bytecode), called without checking them again."""
  function = getattr(aot_fn, 'fn', None)
  if not callable(function):
    raise TorchInternalsError(
        f'torch_xla_patches: {type(aot_fn).__name__} has no fn; this torch '
        'release runs aot_compile results differently.')
  return function


def serializable_guards(entries: Sequence[Any]) -> List[bool]:
  """aot_compile's guard filter: keeps every guard that can be saved and
  compared again after a restart, global ones included.

  [Note: Guards kept by aot_compile]
  Given no filter, torch 2.9's aot_compile drops every global guard
  (a module-level flag or constant the forward reads) with the guard types
  it cannot serialize. This filter drops only the latter: ID_MATCH,
  FUNCTION_MATCH, CLOSURE_MATCH, DICT_VERSION, NN_MODULE and WEAKREF_ALIVE
  (object identities, meaningless in another process: the modules and
  functions the forward calls), alone or as a guard's derived type, and a
  TYPE_MATCH on a class defined inside a function (it cannot be pickled by
  name; transformers' `kernels` dependency makes such modules). Value guards
  on globals (CONSTANT_MATCH, EQUALS_MATCH: `FLAG`, `SCALE`), type guards on
  importable classes, tensor, shape and global-state guards are kept and
  checked by value after a restart."""
  manager = _attribute('torch._dynamo.guards', 'CheckFunctionManager')
  unsupported = frozenset(manager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
  kept = []
  for entry in entries:
    keep = (entry.guard_type not in unsupported and
            unsupported.isdisjoint(entry.derived_guard_types))
    if (entry.guard_type in ('TYPE_MATCH', 'BUILTIN_MATCH') and
        getattr(entry.orig_guard, '_unserializable', False)):
      keep = False
    kept.append(keep)
  return kept


def aot_guard_failure(aot_fn: Any, *args, **kwargs) -> str:
  """The first guard of an AOTCompiledFunction that refuses this call."""
  artifacts = aot_artifacts(aot_fn)
  bind_locals = _attribute('torch._dynamo.aot_compile', 'bind_locals')
  f_locals = bind_locals(artifacts.signature, *args, **kwargs)
  return str(artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)


def dynamo_eval_frame_module() -> Any:
  """torch._dynamo.eval_frame, whose make_set_enable_dynamic gives each
  torch.compile(dynamic=...) the change of dynamo's config its calls make."""
  return _module_defining('torch._dynamo.eval_frame', 'make_set_enable_dynamic')


# [Note: dynamo's config from many threads]
# torch.compile(dynamic=True) sets dynamo's process-wide config
# (assume_static_by_default=False) on every call and puts back what it found
# when the call returns. Calls on several threads interleave those steps: a
# call that started while another's change was in place puts that change
# back last, and it stays for the rest of the process (measured: 8 threads
# over a dynamic=True model leave assume_static_by_default False, so every
# later torch.compile of the process starts dynamic). Under apply() the
# change is shared instead: the first call in flight saves the config, every
# call makes its change, and the last one to return restores what the first
# change of each kind (dynamic True or False) found, the later kind first.
# At most two restores are held, however long calls keep overlapping. While
# calls of dynamic=True and dynamic=False models overlap the config is the
# latest call's, as it is for nested calls on one thread.
_shared_config_lock = threading.Lock()
_shared_config_calls = 0
# enable -> the restore of its first change while calls are in flight, in
# the order made.
_shared_config_restore: Dict[bool, Callable[[], None]] = {}


def _leave_shared_config() -> None:
  """The end of a call's change of dynamo's config (see [Note: dynamo's
  config from many threads]): the last call in flight restores."""
  global _shared_config_calls
  with _shared_config_lock:
    _shared_config_calls -= 1
    if not _shared_config_calls:
      for restore in reversed(_shared_config_restore.values()):
        restore()
      _shared_config_restore.clear()


def shared_dynamic_config(
    make_set_enable_dynamic: Callable[[bool], Callable[[], Callable[[], None]]]
) -> Callable[[bool], Callable[[], Callable[[], None]]]:
  """Wraps torch's make_set_enable_dynamic so that calls on many threads
  leave dynamo's config as they found it (see [Note: dynamo's config from
  many threads])."""

  def make_shared(enable: bool) -> Callable[[], Callable[[], None]]:
    change = make_set_enable_dynamic(enable)

    def enter() -> Callable[[], None]:
      # Every compiled call runs this and _leave_shared_config: one lock
      # each, no object made per call.
      global _shared_config_calls
      with _shared_config_lock:
        revert = change()
        if enable not in _shared_config_restore:
          _shared_config_restore[enable] = revert
        _shared_config_calls += 1
      return _leave_shared_config

    return enter

  return make_shared


def fx_tracing_flag_users() -> Tuple[Type, Any, str]:
  """(Tracer, module, name): FX's Tracer, whose `trace` sets FX's process-wide
  "FX is tracing" flag, and `module.name`, the function dynamo's frame entry
  reads that flag through: torch.fx._symbolic_trace.is_fx_symbolic_tracing,
  or is_fx_tracing on torch 2.8, which has no is_fx_symbolic_tracing (see
  [Note: FX tracing seen per thread])."""
  module = importlib.import_module('torch.fx._symbolic_trace')
  tracer = getattr(module, 'Tracer', None)
  if not callable(getattr(tracer, 'trace', None)):
    raise _missing('torch.fx._symbolic_trace.Tracer.trace')
  for name in ('is_fx_symbolic_tracing', 'is_fx_tracing'):
    if callable(getattr(module, name, None)):
      return tracer, module, name
  raise _missing('torch.fx._symbolic_trace.is_fx_tracing')


# [Note: FX tracing seen per thread]
# FX keeps "FX is tracing" in one module-level flag, `_is_fx_tracing_flag`,
# which Tracer.trace sets for the length of a trace; make_fx traces through
# it, so AOTAutograd does in every dynamo compile of the openxla backend.
# Every torch.compile'd function and module checks the flag when called (in
# the wrapper _TorchDynamoContext.__call__ makes) and refuses to run inside
# an FX trace ("Detected that you are using FX to symbolically trace a
# dynamo-optimized function"). The flag is the process's: while one thread
# compiles, every compiled call of every other thread raises that error.
# (Tracer.trace also puts its own nn.Module.__call__ in place for every
# thread; make_fx's tracer passes a module call through unchanged, so
# another thread's call reaches its own model as before, and only the check
# stops it.)
#
# Under apply() the check dynamo makes answers "is FX tracing on this
# thread": torch's own answer (the flag is set), and this thread is inside
# Tracer.trace, which a wrapper counts per thread. On one thread the answer
# is torch's: only Tracer.trace sets the flag, so a set flag means this
# thread traces. A compiled function called inside an FX trace of its own
# thread is still refused, and one called where a higher-order op cleared
# the flag to compile inside a trace (cond, while_loop) still runs. dynamo
# binds the check when torch.compile wraps a function or module: what was
# compiled before apply() keeps torch's check, and a check bound under
# apply() answers as torch's once revert() has removed the counting
# wrapper. The flag itself stays the process's for its other readers, and
# FX traces on two threads at once stay unsupported (both replace
# nn.Module.__call__); dynamo compiles one frame at a time (its compile
# lock), so torch.compile calls never make two.
_fx_traces = threading.local()
# Set on the wrapper of Tracer.trace: while it is in place, the count of
# each thread's traces is kept.
_COUNTS_FX_TRACES = 'torch_xla_patches_counts_fx_traces'


def _fx_traces_on_this_thread() -> int:
  return getattr(_fx_traces, 'depth', 0)


def counting_fx_traces(trace: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps Tracer.trace to count the traces in flight on each thread (see
  [Note: FX tracing seen per thread])."""

  @functools.wraps(trace)
  def counted_trace(self, *args: Any, **kwargs: Any) -> Any:
    _fx_traces.depth = _fx_traces_on_this_thread() + 1
    try:
      return trace(self, *args, **kwargs)
    finally:
      _fx_traces.depth -= 1

  setattr(counted_trace, _COUNTS_FX_TRACES, True)
  return counted_trace


def fx_tracing_on_this_thread(check: Callable[[], bool],
                              tracer: Type) -> Callable[[], bool]:
  """Wraps `check`, FX's "is FX tracing" function dynamo reads, to answer for
  the calling thread (see [Note: FX tracing seen per thread]). `tracer` is
  FX's Tracer, whose `trace` counting_fx_traces wraps."""

  @functools.wraps(check)
  def on_this_thread() -> bool:
    if not check():
      return False
    return (_fx_traces_on_this_thread() > 0 or
            not getattr(tracer.trace, _COUNTS_FX_TRACES, False))

  return on_this_thread


def xla_backend_module() -> Any:
  """torch._dynamo.backends.torchxla, whose xla_backend_helper the openxla
  backends call with each compiled graph."""
  return _module_defining('torch._dynamo.backends.torchxla',
                          'xla_backend_helper')


def _module_defining(module_name: str, function: str) -> Any:
  """The module, checked to define `function` (the registry patches it
  there)."""
  module = importlib.import_module(module_name)
  if not callable(getattr(module, function, None)):
    raise _missing(f'{module_name}.{function}')
  return module


def openxla_backend() -> Any:
  """The `openxla` backend as dynamo's registry holds it: an AotAutograd
  compiler object, whose `kwargs` go to aot_module_simplified."""
  xla_backend_module()  # registers it
  backend = backend_registry().get('openxla')
  if not isinstance(getattr(backend, 'kwargs', None), dict):
    raise _missing('the openxla backend (an AotAutograd with kwargs)')
  return backend


def aot_autograd_backend(**kwargs: Any) -> Any:
  """A dynamo backend compiling through AOTAutograd with `kwargs`."""
  return _attribute('torch._dynamo.backends.common', 'aot_autograd')(**kwargs)


class InferenceUpdatesInGraph:
  """The openxla backend, where AOTAutograd keeps an inference graph's
  in-place updates of inputs in the graph (see [Note: Donating in-place
  updates] in donation.py).

  By default AOTAutograd turns an in-place update of a graph input into a
  graph output and a `copy_` into the input after the graph. That `copy_`
  leaves the input read at every call, so each donating run first syncs the
  device's pending IR; under SPMD it is a copy of the whole input, computed
  by the next sync, at every call. Kept in the graph, the update is an
  in-place op the bridge's trace sees: donated, and taken over as serve()'s
  updates are. A graph that needs autograd compiles as before: kept there,
  a buffer update (BatchNorm's running statistics in training) breaks the
  forward's outputs for torch_xla's bridges, upstream's included.

  Args:
    openxla: the openxla backend (an AotAutograd compiler object).
  """

  def __init__(self, openxla: Any):
    self.openxla = openxla
    self._inference = aot_autograd_backend(
        **dict(openxla.kwargs, keep_inference_input_mutations=True))

  def __call__(self, graph_module: Any, example_inputs: Sequence[Any],
               **kwargs: Any) -> Any:
    import torch
    # AOTAutograd's own test for a graph that needs autograd.
    needs_autograd = torch.is_grad_enabled() and any(
        isinstance(leaf, torch.Tensor) and leaf.requires_grad
        for leaf in torch.utils._pytree.tree_leaves(list(example_inputs)))
    backend = self.openxla if needs_autograd else self._inference
    return backend(graph_module, example_inputs, **kwargs)


def backend_registry() -> Dict[str, Any]:
  """dynamo's {backend name: compiler function} dict."""
  return _attribute('torch._dynamo.backends.registry', '_COMPILER_FNS')


def graph_pickler() -> Tuple[Type, Type]:
  """(GraphPickler, Options) of torch.fx._graph_pickler."""
  return (_attribute('torch.fx._graph_pickler', 'GraphPickler'),
          _attribute('torch.fx._graph_pickler', 'Options'))


def capture_settings(dynamic: bool, size_oblivious: bool):
  """A context manager with the dynamo and FX settings aot_compile captures
  under: aot_compile enabled, every size symbolic (`dynamic`) with a symbol
  of its own (no duck sizing: a size of the example equal to another, such
  as a batch of 16 into Linear(16, ...), would share its symbol and be
  specialized with it), and symbolic sizes guarded as `0 <= size` rather
  than `2 <= size` (`size_oblivious`)."""
  dynamo_config = _config('torch._dynamo.config', ('enable_aot_compile',))
  fx_config = _config('torch.fx.experimental._config',
                      ('backed_size_oblivious', 'use_duck_shape'))
  dynamo_settings = {'enable_aot_compile': True}
  fx_settings = {'backed_size_oblivious': size_oblivious}
  if dynamic:
    dynamo_settings['assume_static_by_default'] = False
    fx_settings['use_duck_shape'] = False
  stack = contextlib.ExitStack()
  stack.enter_context(dynamo_config.patch(**dynamo_settings))
  stack.enter_context(fx_config.patch(**fx_settings))
  stack.enter_context(_fresh_global_state())
  return stack


@contextlib.contextmanager
def _fresh_global_state():
  """torch 2.9's aot_compile does not reset dynamo's
  `convert_frame.initial_global_state`, which the last torch.compile'd frame
  set: a capture under another grad mode than that frame's then fails its own
  guard check ("GLOBAL_STATE changed: grad_mode"). None makes dynamo read the
  state at capture time; the previous value is put back after."""
  convert_frame = importlib.import_module('torch._dynamo.convert_frame')
  if not hasattr(convert_frame, 'initial_global_state'):
    raise TorchInternalsError(
        'torch_xla_patches: torch._dynamo.convert_frame.initial_global_state '
        f'is missing from torch {versions.runtime_versions().torch}.')
  saved = convert_frame.initial_global_state
  convert_frame.initial_global_state = None
  try:
    yield
  finally:
    convert_frame.initial_global_state = saved


def unwrapped_module(model: Any) -> Any:
  """The module torch.compile wrapped, if `model` is dynamo's
  OptimizedModule; else `model` itself."""
  optimized_module = _attribute('torch._dynamo.eval_frame', 'OptimizedModule')
  if isinstance(model, optimized_module):
    return model._orig_mod
  return model


def graph_loading_fake_mode() -> Any:
  """A FakeTensorMode with a ShapeEnv of its own, to rebuild the fake values
  (and their symbolic sizes) of a pickled FX graph in."""
  fake_tensor_mode = _attribute('torch._subclasses.fake_tensor',
                                'FakeTensorMode')
  shape_env = _attribute('torch.fx.experimental.symbolic_shapes', 'ShapeEnv')
  return fake_tensor_mode(shape_env=shape_env())


def mark_static_address(tensor: Any) -> None:
  """Marks `tensor` as torch._dynamo.mark_static_address does (transformers
  marks a StaticCache's tensors so): dynamo makes it an attribute of the
  graph rather than an input."""
  _attribute('torch._dynamo', 'mark_static_address')(tensor)


def dynamo_unique_graphs() -> int:
  """How many graphs dynamo has compiled in this process (its
  counters['stats']['unique_graphs'])."""
  counters = _attribute('torch._dynamo.utils', 'counters')
  return int(counters['stats']['unique_graphs'])


def dynamo_config(*flags: str) -> Any:
  """torch._dynamo.config, which apply() sets `flags` on; refuses, naming the
  flag, if one is missing."""
  return _config('torch._dynamo.config', flags)


# The Python dispatcher: see [Note: Scoping the decompositions to symbolic
# inputs] in decompositions.py.


def autograd_xla_key() -> Any:
  """The dispatch key torch_xla registers its autograd kernels under."""
  return _attribute('torch._C', 'DispatchKey').AutogradXLA


def has_cpp_kernel(op: Any, key: Any) -> bool:
  """Whether the C++ dispatch table has a kernel of `op` (an OpOverload) for
  `key`."""
  has_kernel = _attribute('torch._C', '_dispatch_has_kernel_for_dispatch_key')
  return has_kernel(op.name(), key)


def cpp_kernel(op: Any, key: Any) -> Callable[..., Any]:
  """Calls `op`'s C++ kernel for `key`, bypassing any Python kernel."""
  return functools.partial(op._op_dk, key)


def python_kernel(op: Any, key: Any) -> Optional[Callable[..., Any]]:
  """The Python-dispatcher kernel of `op` for `key`, or None."""
  return op.py_kernels.get(key)


def set_python_kernel(op: Any, key: Any, kernel: Callable[..., Any]) -> None:
  """Makes `kernel` the Python-dispatcher kernel of `op` for `key`."""
  # py_impl also clears the op's dispatch cache.
  op.py_impl(key)(kernel)


def remove_python_kernel(op: Any, key: Any, kernel: Callable[..., Any]) -> None:
  """Removes `kernel` if it is `op`'s Python-dispatcher kernel for `key`, and
  clears the op's dispatch cache, whose decisions may still point at it."""
  if op.py_kernels.get(key) is kernel:
    del op.py_kernels[key]
  op._dispatch_cache.clear()


def decomposition(op: Any) -> Callable[..., Any]:
  """torch's registered decomposition of `op` into other aten ops."""
  return _attribute('torch._decomp', 'decomposition_table')[op]


def has_symbolic_sizes_strides(tensor: Any) -> bool:
  """Whether a size or stride of `tensor` is symbolic (a SymInt)."""
  return tensor._has_symbolic_sizes_strides


# Serving's fast path: see [Note: Served fast path] in fast_dispatch.py.


def global_state_guard() -> Any:
  """dynamo's check of the global state a graph was captured under (grad
  mode, autocast, torch-function enablement, default dtype, deterministic
  algorithms, ...): the object made now has `check()`, True while that state
  is unchanged."""
  return _attribute('torch._C._dynamo.guards', 'GlobalStateGuard')()


def tensor_metadata_check(tensors: Sequence[Any]) -> Callable[..., bool]:
  """A function of tensors, True while each still has the dtype, device,
  sizes, strides, dispatch keys and requires_grad `tensors` have now (what
  dynamo's tensor guards check), in one C++ call: `check(*tensors)`. A
  `.data` assignment or `torch.utils.swap_tensors` changes the tensor behind
  the same Python object without any hook seeing it."""
  guards = _attribute('torch._C._dynamo.guards', 'TensorGuards')(
      *tensors,
      dynamic_dims_sizes=[list(t.shape) for t in tensors],
      dynamic_dims_strides=[list(t.stride()) for t in tensors])
  return guards.check


def torch_function_mode_depth() -> Callable[[], int]:
  """The function telling how many torch-function modes are active."""
  return _attribute('torch._C', '_len_torch_function_stack')


def global_module_forward_hooks() -> Tuple[Dict[int, Any], ...]:
  """The dicts of forward hooks registered for every nn.Module at once
  (`register_module_forward_hook` and `..._pre_hook`); torch mutates them
  in place, so the dicts returned stay current."""
  return (_attribute('torch.nn.modules.module', '_global_forward_hooks'),
          _attribute('torch.nn.modules.module', '_global_forward_pre_hooks'))


def module_conversion_method() -> Tuple[Any, str]:
  """(nn.Module, name) of the method every dtype and device conversion of a
  module goes through (`to`, `half`, `float`, `cpu`, ...): it may replace a
  parameter's data without any registration hook seeing it."""
  import torch
  if not callable(getattr(torch.nn.Module, '_apply', None)):
    raise _missing('torch.nn.Module._apply')
  return torch.nn.Module, '_apply'


def pytree() -> Tuple[Callable[[Any], Tuple[List[Any], Any]], Callable[
    [List[Any], Any], Any]]:
  """torch's pytree (tree_flatten, tree_unflatten), which knows the output
  containers torch and its libraries register (dicts, named tuples,
  Hugging Face's ModelOutput)."""
  return (_attribute('torch.utils._pytree', 'tree_flatten'),
          _attribute('torch.utils._pytree', 'tree_unflatten'))
