"""Save a compiled model to a file; load it in a new process without dynamo.

  compiled = torch_xla_patches.serialization.aot_compile(model, (x,))
  compiled(x2)                      # serves, and records x2's signature
  torch_xla_patches.save(compiled, 'model.xla_aot')
  ...                               # a new process:
  loaded = torch_xla_patches.load('model.xla_aot', model=model)
  loaded(x3)                        # no dynamo trace, torch's guards checked

`aot_compile` captures a model with torch's aot_compile and the
`openxla_serializable` backend (serializable_backend.py); `save` writes the
artifact file (artifact.py) with a digest of the model's source
(source_digest.py); `load` checks both before it unpickles the payload, and
the loading process compiles the recorded signatures before the first
request (see [Note: Precompile on load]) and any new one on demand.

Limits, on purpose:
  * Inference only. The graph is dynamo's (torch-level ops, before
    AOTAutograd) and the bridge traces it directly, so there is no backward;
    every call runs under torch.no_grad().
  * No XLA executable is saved: torch_xla cannot load serialized executables
    (see config.persistent_executables), so each signature is compiled again
    in the new process. What the artifact saves is dynamo's trace and guards
    (most of a cold first call) and the list of signatures.
  * `fullgraph=True` only (a torch aot_compile restriction), and the model's
    classes must be defined at a module's top level: torch cannot save a type
    guard on a class defined in a function ("defined in local scope").
  * A graph the bridge partitions around CPU fallback ops runs and saves,
    but records no signatures: each XLA part compiles on demand.
  * torch 2.9 or later (versions.require_torch_aot_compile).
"""
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

import torch

from torch_xla_patches import artifact
from torch_xla_patches import call_spec
from torch_xla_patches import config
from torch_xla_patches import execution
from torch_xla_patches import io_utils
from torch_xla_patches import record
from torch_xla_patches import serializable_backend
from torch_xla_patches import source_digest
from torch_xla_patches import torch_internals
from torch_xla_patches.artifact import (ArtifactCorruptError, ArtifactError,
                                        ArtifactHeader, ArtifactMismatchError,
                                        read_header)
from torch_xla_patches.serializable_backend import (BACKEND_NAME,
                                                    XlaSerializableCallable,
                                                    openxla_serializable,
                                                    register_backend,
                                                    unregister_backend)
from torch_xla_patches.serve_key import ServeKey
from torch_xla_patches.versions import require_torch_aot_compile

logger = logging.getLogger('torch_xla_patches.serialization')

__all__ = [
    'ArtifactCorruptError', 'ArtifactError', 'ArtifactMismatchError',
    'BACKEND_NAME', 'CompiledModel', 'Loaded', 'ServeKeyMismatchError',
    'XlaSerializableCallable', 'aot_compile', 'capture_loaders', 'load',
    'load_captures', 'openxla_serializable', 'read_header', 'register_backend',
    'save', 'save_captures', 'try_load', 'unregister_backend'
]


def _arg_specs(args: Sequence[Any]) -> Optional[List[Any]]:
  """Input specs of positional call arguments; None if one is not a tensor
  or a number (then nothing is warmed up at load)."""
  if not all(isinstance(a, (torch.Tensor, bool, int, float)) for a in args):
    return None
  return [io_utils.arg_spec(arg) for arg in args]


def call_module(module: torch.nn.Module, args: tuple, kwargs: Dict[str,
                                                                   Any]) -> Any:
  """What aot_compile captures for a module: its call, with the arguments as
  one tuple and one dict.

  [Note: Capturing a module's call]
  torch 2.9's aot_compile binds the example call to
  `inspect.signature(function)`, which follows `__wrapped__`: for a forward
  under a `functools.wraps` decorator of the form `wrapper(self, *args,
  **kwargs)` (Hugging Face's) it binds the inner forward's parameter names,
  and the wrapper's code then reads locals that were never set ("undefined
  local variable args"). This function's signature is its code's, whatever
  the model's forward looks like: keyword-only parameters, defaults,
  decorators and hooks are dynamo's to trace inside `module(...)`, as
  torch.compile of the module would. It reads no global, so the saved
  bytecode needs none of this module's names after a restart.
  """
  return module(*args, **kwargs)


def call_forward(module: torch.nn.Module, args: tuple,
                 kwargs: Dict[str, Any]) -> Any:
  """What aot_compile captures for a module's bound forward: the forward the
  module's class defines, called without the module's hooks, as
  `torch.compile(model.forward)` calls it.

  [Note: Serving a module's forward]
  transformers' generate() calls `model(...)`, which calls `model.forward`:
  a decode loop is served by replacing `model.forward` with
  `serve(model.forward, ...)`, as the transformers docs do with
  torch.compile. Such a capture must not read the module's `forward`
  attribute: dynamo would guard that the module has none of its own (every
  call refused once it has), and a capture on a later call would trace the
  served forward itself. So it calls the class's forward, and its keyword
  binding and re-traces take that forward too (`forward_owner`).
  """
  return type(module).forward(module, *args, **kwargs)


def forward_owner(model: Any) -> Optional[torch.nn.Module]:
  """The module when `model` is its bound forward, the one its class
  defines (see [Note: Serving a module's forward]); else None."""
  owner = getattr(model, '__self__', None)
  if (isinstance(owner, torch.nn.Module) and getattr(model, '__func__', None)
      is getattr(type(owner), 'forward', None)):
    return owner
  return None


def class_forward(module: torch.nn.Module) -> Any:
  """`module`'s forward as its class defines it, bound to it, whatever
  `module.forward` is now (see [Note: Serving a module's forward])."""
  return type(module).forward.__get__(module)


class CompiledModel:
  """A model or function compiled with torch's aot_compile and our backend.

  Call it like the model. `torch_xla_patches.save` writes it to a file.

  Args:
    aot_fn: the AOTCompiledFunction.
    model: the nn.Module whose call was captured (see [Note: Capturing a
      module's call]), or the function.
    module_call: whether aot_fn captured call_module, called as
      aot_fn(model, args, kwargs) with the call bound to the forward's
      parameter names (call_spec.KeywordBinding), as it was captured; else
      aot_fn is the function itself.
    example_args: input specs of an example call (see _arg_specs), used by
      load to warm up; None if the call cannot be rebuilt from specs.
    forward_call: whether aot_fn captured call_forward (the module's bound
      forward was given, see [Note: Serving a module's forward]).
  """

  def __init__(self,
               aot_fn,
               model: Any,
               module_call: bool,
               example_args: Optional[List[Any]],
               forward_call: bool = False):
    self.aot_fn = aot_fn
    self.model = model
    self.module_call = module_call
    self.example_args = example_args
    self.forward_call = forward_call
    forward = class_forward(model) if forward_call else getattr(
        model, 'forward', None)
    self._bind = call_spec.KeywordBinding(forward) if module_call else None

  def captured_arguments(
      self, args: tuple, kwargs: Dict[str,
                                      Any]) -> Tuple[tuple, Dict[str, Any]]:
    """The (args, kwargs) of the captured function for a call of the model
    with `args`, `kwargs` (see [Note: Capturing a module's call])."""
    if self._bind is None:
      return args, kwargs
    return (self.model,) + self._bind(args, kwargs), {}

  def __call__(self, *args, **kwargs):
    # Inference only: the graph is dynamo's, with no AOTAutograd (see the
    # module docstring).
    args, kwargs = self.captured_arguments(args, kwargs)
    with torch.no_grad():
      return self.aot_fn(*args, **kwargs)

  def precompile_pending(self) -> int:
    """Compiles the recorded signatures not compiled yet (see [Note:
    Precompile on load]); returns how many. Call it after the first request
    to serve that one first."""
    return self.backend_callable.precompile_pending()

  @property
  def backend_callable(self) -> XlaSerializableCallable:
    return torch_internals.aot_artifacts(self.aot_fn).compiled_fn

  def guard_check(self, *args, **kwargs) -> bool:
    """Whether dynamo's guards accept a call with `args`, `kwargs`: False
    means the captured code does not apply and calling would raise. Checked
    under no_grad, as calls run, and under execution_lock (see [Note: What
    reads the model's tensors])."""
    return self.guard_check_captured(*self.captured_arguments(args, kwargs))

  def guard_check_captured(self, args: tuple, kwargs: Dict[str, Any]) -> bool:
    """guard_check of the captured function's arguments
    (captured_arguments): a caller that goes on to call_captured binds the
    call once."""
    with execution.execution_lock, torch.no_grad():
      return self.aot_fn.guard_check(*args, **kwargs)

  def guard_failure(self, *args, **kwargs) -> str:
    """Why dynamo's guards refuse a call (the first failing guard)."""
    args, kwargs = self.captured_arguments(args, kwargs)
    with execution.execution_lock, torch.no_grad():
      return torch_internals.aot_guard_failure(self.aot_fn, *args, **kwargs)

  def call_checked(self, *args, **kwargs) -> Any:
    """Calls the model for arguments that guard_check accepted, without
    checking the guards a second time."""
    return self.call_captured(*self.captured_arguments(args, kwargs))

  def call_captured(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """call_checked of the captured function's arguments
    (captured_arguments)."""
    function = torch_internals.aot_captured_function(self.aot_fn)
    with torch.no_grad():
      return function(*args, **kwargs)

  @property
  def captured_globals(self) -> Dict[str, Any]:
    """The globals the captured code runs with."""
    return torch_internals.aot_captured_function(self.aot_fn).__globals__

  @property
  def transformed_code(self) -> Any:
    """The code object dynamo made of the captured function: it reads the
    graph's arguments, calls the compiled graph and builds the result."""
    return torch_internals.aot_artifacts(self.aot_fn).bytecode


def aot_compile(model: Any,
                args: Sequence[Any],
                kwargs: Optional[Dict[str, Any]] = None,
                dynamic: bool = True,
                size_oblivious: bool = True) -> CompiledModel:
  """Captures `model` (an nn.Module or a function) with dynamo once, with
  torch's aot_compile and the `openxla_serializable` backend.

  The XLA programs are compiled on calls, one per shape signature.

  Args:
    model: an nn.Module (its forward is captured, its parameters and buffers
      are graph inputs), a module's bound forward (captured without the
      module's hooks, see [Note: Serving a module's forward]) or a function;
      a torch.compile'd module is unwrapped.
    args, kwargs: an example call. Give dynamic sizes of 2 or more: a size
      of 1 is specialized by dynamo.
    dynamic: capture every size symbolically (torch.compile's dynamic=True).
    size_oblivious: dynamo guards a symbolic size with `2 <= size` (its 0/1
      specialization); an artifact cannot re-trace, so batch 1 would be
      refused. True captures with torch's `backed_size_oblivious`, which
      guards `0 <= size` instead. The bridge traces each signature on real
      tensors, so a size of 1 is still computed as eager does.
  """
  require_torch_aot_compile('torch_xla_patches.serialization.aot_compile')
  model = torch_internals.unwrapped_module(model)
  owner = forward_owner(model)
  forward_call = owner is not None
  if forward_call:
    model = owner
  module_call = isinstance(model, torch.nn.Module)
  kwargs = dict(kwargs or {})
  if module_call:
    forward = class_forward(model) if forward_call else model.forward
    bound = call_spec.KeywordBinding(forward)(tuple(args), kwargs)
    target = call_forward if forward_call else call_module
    example = ((model,) + bound, {})
  else:
    target, example = model, (tuple(args), kwargs)
  # aot_compile captures outside torch.compile's own context, which is where
  # dynamic=True would turn static-by-default shapes off; do it here.
  # [Note: What reads the model's tensors]
  # A donating run leaves the tensors it updates in place (a KV cache the
  # model holds) without device data until it has run, under
  # execution_lock. dynamo's guards and a capture's fake tensors read those
  # tensors (their sizes and strides, and so their data handle) outside
  # dynamo's frame, where no lock of the bridge is held: on another thread
  # than the run's they raise "Check failed: data()->tensor_data" or find
  # the buffer deleted. Both hold execution_lock; a capture then takes
  # dynamo's compile lock inside it, the order a trace's restore takes them
  # in (see [Note: Restores and dynamo's compiles] in tracing.py).
  with execution.execution_lock, torch_internals.capture_settings(
      dynamic, size_oblivious), torch.no_grad(), _static_addresses_hidden(
          call_spec.argument_tensors((args, kwargs))):
    aot_fn = torch.compile(target,
                           backend=openxla_serializable,
                           fullgraph=True,
                           dynamic=dynamic,
                           options={
                               'guard_filter_fn':
                                   torch_internals.serializable_guards
                           }).aot_compile(example)
  if not isinstance(
      torch_internals.aot_artifacts(aot_fn).compiled_fn,
      XlaSerializableCallable):
    raise TypeError('torch_xla_patches: aot_compile did not use the '
                    f'{BACKEND_NAME} backend')
  return CompiledModel(aot_fn, model, module_call,
                       _arg_specs(args) if not kwargs else None, forward_call)


@contextlib.contextmanager
def _static_addresses_hidden(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
  """The capture sees the call's tensors as arguments, whatever
  `torch._dynamo.mark_static_address` said of them.

  [Note: Arguments marked static]
  transformers marks a StaticCache's tensors static
  (`mark_static_address`, when the cache is initialized outside a
  compile), and dynamo makes a tensor so marked a constant of the graph
  with a guard on its identity. That guard does not survive saving (see
  torch_internals.serializable_guards), and a graph reading one cache's
  tensors as constants would read them for every cache passed later. So
  the capture sees no such mark on the call's arguments: each is a graph
  input, read from the call. The marks are put back after the capture.
  """
  hidden = [(tensor, tensor._dynamo_static_input_type)
            for tensor in tensors
            if hasattr(tensor, '_dynamo_static_input_type')]
  for tensor, _ in hidden:
    del tensor._dynamo_static_input_type
  try:
    yield
  finally:
    for tensor, kind in hidden:
      tensor._dynamo_static_input_type = kind


def save(compiled: Any,
         path: str,
         example_inputs: Optional[Sequence[Any]] = None,
         serve_key: Optional[ServeKey] = None) -> str:
  """Writes `compiled` to `path` atomically; returns the path.

  Args:
    compiled: a CompiledModel (from aot_compile or load), or a model /
      function / torch.compile'd module, which is then captured with
      aot_compile on `example_inputs` (positional arguments).
    serve_key: serve()'s key, whose parts the header keeps (see [Note:
      Serve key]).
  """
  require_torch_aot_compile('torch_xla_patches.save')
  if not isinstance(compiled, CompiledModel):
    if example_inputs is None:
      raise TypeError('torch_xla_patches.save: pass a CompiledModel, or a '
                      'model with example_inputs to capture it with')
    compiled = aot_compile(compiled, tuple(example_inputs))
  return save_captures([compiled], path, serve_key)


def save_captures(captures: Sequence[CompiledModel],
                  path: str,
                  serve_key: Optional[ServeKey] = None) -> str:
  """Writes the captures of one model (see [Note: One capture per guard set]
  in serving.py) to `path` atomically, as one artifact; returns the path."""
  require_torch_aot_compile('torch_xla_patches.save')
  if not captures:
    raise ValueError('torch_xla_patches.save: no capture to save')
  first = captures[0]
  payloads = [serializable_backend.serialize_aot(c.aot_fn) for c in captures]
  payload = payloads[0] if len(payloads) == 1 else pickle.dumps(payloads)
  parts = source_digest.source_parts(first.model)
  key_parts = serve_key.parts() if serve_key is not None else None
  header = ArtifactHeader(format_version=artifact.FORMAT_VERSION,
                          **artifact.version_fields(),
                          model_name=source_digest.model_name(first.model),
                          model_source_digest=source_digest.digest(parts),
                          model_source_parts=parts,
                          module_call=first.module_call,
                          example_args=first.example_args,
                          payload_sha256=hashlib.sha256(payload).hexdigest(),
                          payload_size=len(payload),
                          serve_key=key_parts,
                          captures=len(payloads))
  path = os.fspath(path)
  artifact.write(path, header, payload)
  return path


def _check_source(header: ArtifactHeader,
                  model: Any,
                  parts: Optional[Dict[str, str]] = None) -> None:
  """Raises unless `model`'s source is the one the artifact was saved for;
  `parts`: its source_parts, where the caller has them (a ServeKey's)."""
  if parts is None:
    parts = source_digest.source_parts(model)
  if source_digest.digest(parts) == header.model_source_digest:
    return
  expected = header.model_source_parts
  changed = sorted(name for name in set(parts) | set(expected)
                   if parts.get(name) != expected.get(name))
  details = '; '.join(f'{name}: expected {expected.get(name, "absent")[:12]}, '
                      f'found {parts.get(name, "absent")[:12]}'
                      for name in changed)
  raise ArtifactMismatchError(
      f'torch_xla_patches: the model source differs from the one the artifact '
      f'was saved for ({header.model_name}, digest '
      f'{header.model_source_digest[:12]}; found {source_digest.digest(parts)[:12]}). '
      f'Differing: {details}. Save the artifact again from this source.')


def _read_checked(
    path: str,
    model: Any,
    source_parts: Optional[Dict[str,
                                str]] = None) -> Tuple[ArtifactHeader, bytes]:
  header, payload = read_header(path)
  header.check_runtime()
  _check_source(header, model, source_parts)
  if header.module_call != isinstance(model, torch.nn.Module):
    raise ArtifactMismatchError(
        f'torch_xla_patches: the artifact was saved for '
        f'{"a module" if header.module_call else "a function"}, load got '
        f'{type(model).__name__}')
  return header, payload


class ServeKeyMismatchError(ArtifactMismatchError):
  """An artifact saved for another ServeKey (the message names the parts
  that differ)."""


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What try_load found."""
  # The loaded captures, in the order they were made; () when the file does
  # not load.
  captures: Tuple[CompiledModel, ...]
  # Why it does not load, naming the file; '' when it loads.
  reason: str
  # The artifact's later captures, not loaded yet (try_load's first_only):
  # each function loads one, in the order they were made, and raises
  # ArtifactCorruptError where its capture does not load.
  pending: Tuple[Callable[[], CompiledModel], ...] = ()


def load(path: str,
         model: Any = None,
         precompile: bool = True,
         serve_key: Optional[ServeKey] = None) -> CompiledModel:
  """Loads an artifact written by `save`; see [Note: Artifact safety].

  Args:
    path: the artifact.
    model: the nn.Module to run (its parameters and buffers are graph inputs
      taken at call time), or the function that was saved.
    precompile: warm up now: one call on zeros of the saved example shape,
      which compiles every recorded signature (see [Note: Precompile on
      load]). Otherwise the first call does it.
    serve_key: the ServeKey the artifact must have been saved with (see
      [Note: Serve key]), compared before anything is unpickled.
  Raises:
    ArtifactCorruptError, ArtifactMismatchError (ServeKeyMismatchError for
    another serve_key; also for an artifact of serve() that holds several
    captures, which only serve() loads).
  """
  captures = load_captures(path, model, serve_key)
  if len(captures) != 1:
    raise ArtifactMismatchError(
        f'torch_xla_patches: {path} holds {len(captures)} captures of the '
        'model, one per set of guards its buckets needed (see [Note: One '
        'capture per guard set]); serve() loads it')
  (compiled,) = captures
  if precompile and compiled.example_args is not None:
    _warm_up(compiled, compiled.example_args, os.fspath(path))
  return compiled


# What a damaged payload raises as it unpickles.
_UNPICKLING_ERRORS = (pickle.UnpicklingError, EOFError, AttributeError,
                      ImportError)


def load_captures(
    path: str,
    model: Any = None,
    serve_key: Optional[ServeKey] = None) -> Tuple[CompiledModel, ...]:
  """Every capture an artifact holds (see [Note: One capture per guard set]
  in serving.py), without precompiling; raises as `load` does."""
  return tuple(load() for load in capture_loaders(path, model, serve_key))


def capture_loaders(
    path: str,
    model: Any = None,
    serve_key: Optional[ServeKey] = None
) -> Tuple[Callable[[], CompiledModel], ...]:
  """Checks an artifact as `load` does (header, runtime, source, serve key)
  and returns a function per capture it holds, in the order they were made,
  that loads that capture (see [Note: A restart's captures, one at a time]
  in serving.py); raises as `load` does."""
  require_torch_aot_compile('torch_xla_patches.load')
  if model is None:
    raise TypeError('torch_xla_patches.load needs model=: the saved graph '
                    'takes the parameters, or the function, from it')
  owner = forward_owner(model)
  if owner is not None:
    model = owner
  path = os.fspath(path)
  # A ServeKey's source parts are this model's (ServeKey.of), taken once.
  header, payload = _read_checked(
      path, model, serve_key.source if serve_key is not None else None)
  if serve_key is not None:
    differences = serve_key.differences(header.serve_key)
    if differences:
      raise ServeKeyMismatchError(f'{path} differs in ' +
                                  ' | '.join(differences))
  try:
    payloads = [payload] if header.captures == 1 else pickle.loads(payload)
    if (not isinstance(payloads, list) or len(payloads) != header.captures or
        not all(isinstance(p, bytes) for p in payloads)):
      raise pickle.UnpicklingError(
          f'expected {header.captures} captures, found '
          f'{type(payloads).__name__}')
  except _UNPICKLING_ERRORS as e:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} does not unpickle: {e}') from None

  def load_one(index: int) -> CompiledModel:
    try:
      aot_fn = serializable_backend.deserialize_aot(payloads[index])
    except _UNPICKLING_ERRORS as e:
      raise ArtifactCorruptError(
          f'torch_xla_patches: artifact {path} does not unpickle: capture '
          f'{index}: {e}') from None
    compiled = CompiledModel(aot_fn, model, header.module_call,
                             header.example_args, owner is not None)
    compiled.backend_callable.name_source(path)
    compiled.backend_callable.rebind_lifted(model)
    return compiled

  return tuple(
      functools.partial(load_one, index) for index in range(len(payloads)))


def try_load(path: str,
             model: Any,
             serve_key: ServeKey,
             first_only: bool = False) -> Loaded:
  """`load_captures` as a value: the loaded captures, or why the file does
  not load. It never raises: serve() traces for a reason (see [Note:
  Serving restarts]). With `first_only`, only the first capture is loaded
  and the others are left `pending`."""
  try:
    loaders = capture_loaders(path, model=model, serve_key=serve_key)
    now = 1 if first_only else len(loaders)
    return Loaded(tuple(load() for load in loaders[:now]),
                  '',
                  pending=loaders[now:])
  except ServeKeyMismatchError as e:
    return Loaded((), str(e))
  except Exception as e:  # pylint: disable=broad-except
    # Whatever the file holds, it is a reason to trace, never a failure of
    # serve().
    return Loaded((), f'{path} does not load: {type(e).__name__}: {e}')


def _warm_up(compiled: CompiledModel, example_args: Any, path: str) -> None:
  """Calls `compiled` on zeros of the saved example shapes, which compiles
  the recorded signatures (see [Note: Precompile on load]). A damaged
  example call is skipped with a warning: the first real call then does the
  same work."""
  import torch_xla
  params = list(compiled.model.parameters()) if isinstance(
      compiled.model, torch.nn.Module) else []
  try:
    args = record.rebuild_call(example_args, params, torch_xla.device())
  except record.RecordError as e:
    logger.warning(
        'torch_xla_patches: not warming up %s: its example call is unusable '
        '(%s); the first call compiles instead.', path, e)
    return
  try:
    # Compiles without running (see [Note: Compile-only calls]); returns
    # once those compiles are done.
    with execution.compile_only() as compiles:
      try:
        compiled(*args)
      except execution.CompiledNotRun:
        pass
    for future in compiles:
      if not future.cancelled():
        future.result()
  except Exception as e:  # pylint: disable=broad-except
    # Not a damaged file (checked above, and recorded signatures are checked
    # as they replay): a failure of the warm-up itself, see
    # config.strict_replay.
    if config.strict_replay:
      raise
    logger.warning(
        'torch_xla_patches: warming up %s failed (%s: %s); the first call '
        'compiles instead.', path,
        type(e).__name__, e)
