"""serve(): a model compiled for its serving buckets, kept across restarts.

  served = torch_xla_patches.serve(model, buckets, cache_dir='/var/cache/xla')
  served(tokens, attention_mask=mask)   # returns what model(...) returns

A bucket is a CallSpec (positional and keyword arguments, nested lists,
tuples and dicts of TensorSpec, scalars and None; see [Note: Served call
structure]) or, for positional tensors, a tuple of TensorSpec.

[Note: Serving restarts]
With a cache directory, serve() keeps one artifact per ServeKey (see [Note:
Serve key]) in <cache_dir>/serve/, named <model>-<key digest>.xla_aot, with
the key's parts in its header. A process that finds the artifact of its key
loads it (no dynamo frame), checks that the guards of one of its captures
accept each bucket (see [Note: One capture per guard set]), compiles the
buckets, and the signatures recorded in the artifact and the signature
index wait in the graph's backlog as any restart's do (see [Note: Replaying
recorded signatures]). A process that does not (first
start, another configuration, edited source, other versions, a damaged
file, an artifact whose guards refuse its own buckets) logs one line with
the reason (for a missing key, the parts the closest artifact of the model
differs in), captures the model's call with dynamo once (aot_compile: no
AOTAutograd, see [Note: Capturing a module's call]), compiles the buckets
and writes the artifact atomically, so processes sharing the directory see
the old file or the new one, never a part. Two configurations of one model
keep one artifact each. Nothing in the directory can fail a call: a file
that does not load is a reason to trace, and a failed write is a warning.

[Note: One capture per guard set]
A capture holds dynamo's guards on what its example call let it assume. A
model can branch on a size: transformers' causal-mask test makes a prompt
of one token take other code than a prompt of several, so a capture on a
prompt of four guards `2 <= input_ids.size()[1]` and refuses a decode step.
Such a call is not another model: the served model captures it again, once,
on that call (ServedModel's `capture`), and every later call that capture's
guards accept is served by it, with a fast path of its own; a call's key
routes it to the capture that accepted it. serve()'s warm-up calls the
buckets, so each guard set its buckets need is captured before the
artifact is written, and the artifact keeps every capture: a restart serves
a decode bucket without dynamo too. Where a call cannot be captured, or
captures keep being made (ServedModel.MAX_CAPTURES), calls no capture
accepts are traced again with torch.compile (COUNTER_RETRACE).

[Note: Ready at once]
serve() returns at once, or once its artifact is loaded (see [Note: The first
capture]): the buckets compile on a daemon thread (warmup.BackgroundWarmUp),
each traced there without running (see [Note: Compile-only calls] in
execution.py) and compiled on the compile pool, in the order given, and the
artifact is written when they are done. Meanwhile a call of a compiled bucket
runs at once; a call of a bucket still queued moves its compile to the front
of the pool and waits for that one compile, and a call of one compiling waits
for it (never a second compile, see [Note: Compiles outside the lock] in
signature_cache.py); other shapes compile on the calling thread, without the
lock. ServedModel.readiness() and wait_ready() tell a health probe how far it
is. With wait=True (or XLA_PATCHES_SERVE_WAIT=1) serve() returns when every
bucket is compiled, as a batch job would want.

Where aot_compile cannot capture the model at all, serve() serves it through
torch.compile instead, saying why in one log line, as on torch 2.8, which has
no aot_compile: serve() compiles through torch.compile and the signature
index, and every restart traces dynamo again (said once in the log).
"""
import functools
import glob
import inspect
import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import artifact
from torch_xla_patches import call_spec
from torch_xla_patches import config
from torch_xla_patches import execution
from torch_xla_patches import serialization
from torch_xla_patches import serializable_backend
from torch_xla_patches import versions
from torch_xla_patches import warmup
from torch_xla_patches.call_spec import CallSpec
from torch_xla_patches.served_model import ServedModel
from torch_xla_patches.serve_key import ServeKey

logger = logging.getLogger('torch_xla_patches.serving')

SERVE_DIR = 'serve'
ARTIFACT_SUFFIX = '.xla_aot'
# How serve() captures (the capture part of the ServeKey).
CAPTURE_SETTINGS = {
    'dynamic': True,
    'size_oblivious': True,
    'module_call': True,
    'guard_filter': 'serializable_guards',
}

_warned_no_aot_compile = False


def _buckets(signatures: Iterable[Any]) -> List[CallSpec]:
  """The buckets, checked."""
  buckets = []
  for index, bucket in enumerate(signatures):
    try:
      buckets.append(CallSpec.of(bucket))
    except call_spec.CallStructureError as e:
      raise TypeError(f'torch_xla_patches.serve: signature {index}: '
                      f'{e}') from None
  if not buckets:
    raise ValueError('torch_xla_patches.serve: signatures is empty; give one '
                     'CallSpec (or tuple of TensorSpec) per serving bucket')
  return buckets


def _arguments(buckets: Sequence[CallSpec]) -> Any:
  """The arguments part of the ServeKey: the buckets' layout, or, where
  buckets differ in layout (generate()'s prefill, without an attention
  mask, and its decode steps, with one), each layout once, in order."""
  layouts: List[Any] = []
  for bucket in buckets:
    layout = bucket.layout()
    if layout not in layouts:
      layouts.append(layout)
  return layouts[0] if len(layouts) == 1 else ['layouts', layouts]


def _check_model(model: Any) -> None:
  if not isinstance(model, torch.nn.Module):
    raise TypeError('torch_xla_patches.serve: model must be an nn.Module or '
                    f'its forward, got {type(model).__name__}')
  for name, tensor in list(model.named_parameters()) + list(
      model.named_buffers()):
    if tensor.device.type != 'xla':
      raise ValueError(f'torch_xla_patches.serve: {name} is on '
                       f'{tensor.device}; move the model to '
                       'torch_xla.device() first')


def serve_key(model: torch.nn.Module,
              buckets: Sequence[CallSpec],
              forward_call: bool = False) -> ServeKey:
  """The key of serve()'s artifact for `model` and `buckets` (see [Note:
  Serve key]); `forward_call` for a served forward (see [Note: Serving a
  module's forward] in serialization.py)."""
  return ServeKey.of(
      model,
      arguments=_arguments(buckets),
      shardings=_shardings(model, buckets),
      capture=(dict(CAPTURE_SETTINGS, call='forward')
               if forward_call else CAPTURE_SETTINGS),
      formats={
          'artifact': artifact.FORMAT_VERSION,
          'compiled_graph': serializable_backend.STATE_FORMAT_VERSION,
      })


def _shardings(model: torch.nn.Module,
               buckets: Sequence[CallSpec]) -> Dict[str, Any]:
  """The shardings part of the ServeKey: {} unless under SPMD."""
  import torch_xla
  if not torch_xla.runtime.is_spmd():
    return {}
  spec_of = torch_xla._XLAC._get_xla_sharding_spec
  tensors = list(model.named_parameters()) + list(model.named_buffers())
  return {
      'buckets': [[
          spec.sharding.to_json() if spec.sharding is not None else None
          for spec in bucket.tensor_specs
      ]
                  for bucket in buckets],
      'state': [[name, spec_of(tensor)] for name, tensor in tensors],
  }


def artifact_path(cache_dir: str, key: ServeKey) -> str:
  """Where serve() keeps the artifact of `key` (see [Note: Serving
  restarts])."""
  name = key.model.replace('.', '_')
  return os.path.join(cache_dir, SERVE_DIR,
                      f'{name}-{key.digest()}{ARTIFACT_SUFFIX}')


def _why_not_found(path: str, key: ServeKey) -> str:
  """Why no artifact of `key` exists: what the closest artifact of the same
  model differs in."""
  prefix = os.path.basename(path).rsplit('-', 1)[0]
  others = sorted(
      glob.glob(
          os.path.join(glob.escape(os.path.dirname(path)),
                       f'{glob.escape(prefix)}-*{ARTIFACT_SUFFIX}')))
  closest: Optional[Tuple[int, str]] = None
  for other in others:
    try:
      header, _ = artifact.read_header(other)
      differences = key.differences(header.serve_key)
    except artifact.ArtifactError as e:
      differences = [str(e)]
    reason = f'{os.path.basename(other)} differs in ' + ' | '.join(differences)
    if closest is None or len(differences) < closest[0]:
      closest = (len(differences), reason)
  if closest is None:
    return 'no artifact of this model yet'
  return f'no artifact of this key; the closest, {closest[1]}'


def _compile_buckets(served: ServedModel,
                     buckets: Sequence[CallSpec],
                     tensor_pool: Optional[Dict[Any, torch.Tensor]],
                     wait: bool,
                     then: Optional[Callable[[], None]] = None) -> None:
  """Compiles the buckets without running them (see [Note: Ready at
  once]): in the background, or, with `wait`, before returning (raising
  if a bucket's compile raised, as a batch job would want to know); `then`
  runs once they are done."""
  needs_capture = None
  if served.can_capture:
    needs_capture = served.needs_capture
  example = _example(buckets)
  served.warm_up = warmup.BackgroundWarmUp(
      served.compile_only_call,
      buckets,
      tensor_pool,
      then,
      needs_capture,
      capture=served.capture_for,
      capture_first=next(i for i, b in enumerate(buckets) if b is example),
      after_first_request=served.loaded)
  # See [Note: Captures after the first request] in warmup.py.
  served.first_request = served.warm_up.gate
  if wait and not served.warm_up.wait():
    failed = served.warm_up.readiness().failed
    raise RuntimeError(
        f'torch_xla_patches.serve: {len(failed)} of {len(buckets)} buckets '
        'did not compile: ' + '; '.join(failed))


def _save(served: ServedModel, path: str, key: ServeKey) -> None:
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    serialization.save_captures(served.captures(), path, serve_key=key)
  except OSError as e:
    logger.warning(
        'torch_xla_patches.serve: could not write %s (%s); the next restart '
        'traces again', path, e)


# [Note: The first capture]
# serve(wait=True) captures the model on one bucket before it returns (the
# example: its smallest size largest, see _example). serve() in the
# background (the default) returns before any capture: the first call of
# the served model, a request's or the warm-up's, makes it on its own
# arguments (ServedModel._first_capture). A first request thus waits for its
# own capture and compile alone, never for a capture of a bucket whose
# guards may refuse it (a batch of 1 where the example has 2: dynamo
# specializes 1). A request's first capture takes its sizes as they are
# (static, as torch.compile's first trace does, in about half the time of
# a dynamic one): it serves calls of those sizes, and the warm-up's dynamic
# captures serve the others. The warm-up's captures wait for that first
# request (see
# [Note: Captures after the first request] in warmup.py), the example
# first. With no request, the warm-up starts config.serve_capture_delay
# seconds after serve() returns, or when something waits for it
# (wait_ready()). A model the first capture cannot capture is then served
# by torch.compile, as serve(wait=True) would serve it.


def _example(buckets: Sequence[CallSpec]) -> CallSpec:
  """The bucket to capture with: its smallest size largest, so that no size
  of 1 is captured (dynamo specializes 1)."""
  return max(buckets,
             key=lambda b: min(
                 (min(s.shape, default=2) for s in b.tensor_specs), default=2))


def _capture(model: torch.nn.Module,
             key: ServeKey,
             args: tuple,
             kwargs: Dict[str, Any],
             static: bool = False) -> Optional[Any]:
  """The model captured with aot_compile on a call; None, said in the log,
  where aot_compile cannot capture it.

  With `static`, every size is captured as it is (a first request's
  capture, see [Note: The first capture]); where that fails, as below.
  Otherwise a size of 1 is captured symbolically (size_oblivious, see
  serialization.aot_compile) unless that capture fails: a size of 1 that
  broadcasts (the head dimension of transformers' 4-D attention mask)
  cannot be told from one that does not, and the capture then takes
  dynamo's 0/1 specialization, each size of 1 constant."""
  if static:
    try:
      return serialization.aot_compile(model,
                                       args,
                                       kwargs,
                                       dynamic=False,
                                       size_oblivious=False)
    except Exception as e:  # pylint: disable=broad-except
      logger.info(
          'torch_xla_patches.serve: a capture of %s with static sizes '
          'raised %s: %s; capturing it with dynamic sizes', key.model,
          type(e).__name__, e)
  try:
    return serialization.aot_compile(model, args, kwargs)
  except Exception as e:  # pylint: disable=broad-except
    first_error = e
  try:
    return serialization.aot_compile(model, args, kwargs, size_oblivious=False)
  except Exception:  # pylint: disable=broad-except
    e = first_error
    # Whatever torch.compile traces, serve() serves: the capture's own
    # limits (a guard it cannot save, a form it cannot bind) are no reason
    # to fail.
    logger.warning(
        'torch_xla_patches.serve: aot_compile cannot capture %s (%s: %s); '
        'serving such calls through torch.compile, which traces dynamo again '
        'in every process', key.model,
        type(e).__name__, e)
    return None


def _refused_bucket(captures: Sequence[serialization.CompiledModel],
                    buckets: Sequence[CallSpec]) -> Optional[str]:
  """Why the loaded captures' guards refuse a bucket, if every capture
  refuses one."""
  import torch_xla
  device = torch_xla.device()
  for index, bucket in enumerate(buckets):
    args, kwargs = bucket.materialize(device, for_trace=True)
    if not any(c.guard_check(*args, **kwargs) for c in captures):
      return (f'its guards refuse bucket {index} {bucket.describe()}: '
              f'{captures[0].guard_failure(*args, **kwargs)}')
    del args, kwargs
  return None


# [Note: A restart's captures, one at a time]
# Loading a capture from the artifact costs about half a second (torch
# builds its guards again, the graph unpickles), and a restart's artifact
# holds one per guard set its buckets and requests needed (five or six for
# a generation server's prompt and step buckets). serve() in the background
# loads the first (a first request's capture, see [Note: The first
# capture]) and returns; the served model keeps the others pending
# (ServedModel.load_pending) and loads them in order:
#   * where a call's capture is still pending: a call the loaded captures'
#     guards refuse loads the next ones on its own thread, until one
#     accepts it, before anything is captured again;
#   * the warm-up's compile-only calls of the buckets, after the first
#     request (see [Note: Captures after the first request] in warmup.py),
#     the same way;
#   * the rest once the buckets are compiled, on the warm-up's thread.
# So a restart makes no dynamo frame for any call a capture of the artifact
# accepts, as when every capture loaded before serve() returned. serve()
# with wait=True loads every capture first, and replaces an artifact whose
# captures refuse a bucket (_refused_bucket); in the background such a
# bucket is captured again by the warm-up, and once the buckets are
# compiled the artifact is written again with every capture the process
# holds (_restart_warmed_up), so the next restart loads that capture too.
# The same holds where a capture did not load (it and the ones after it
# are left, see ServedModel._load_next) and calls they would have served
# were captured again: the artifact written holds the new captures, not the
# damaged one.


def _load(path: Optional[str],
          model: torch.nn.Module,
          key: ServeKey,
          buckets: Sequence[CallSpec],
          first_only: bool = False) -> serialization.Loaded:
  """The artifact of `key` at `path` if it loads (and, unless
  `first_only`, serves the buckets), else why not (no reason without a
  cache directory). With `first_only`, the captures after the first are
  left pending (see [Note: A restart's captures, one at a time])."""
  if path is None:
    return serialization.Loaded((), '')
  if not os.path.lexists(path):
    return serialization.Loaded((), _why_not_found(path, key))
  loaded = serialization.try_load(path,
                                  model,
                                  serve_key=key,
                                  first_only=first_only)
  if loaded.captures and not first_only:
    refused = _refused_bucket(loaded.captures, buckets)
    if refused is not None:
      return serialization.Loaded((), f'{path} is replaced: {refused}')
  return loaded


def _restart_warmed_up(served: ServedModel, path: str, key: ServeKey) -> None:
  """What a restart does once its buckets are compiled: the artifact's
  captures still pending load, and the artifact is written again if this
  process captured calls its captures refused (see [Note: A restart's
  captures, one at a time])."""
  served.load_pending()
  if served.captures_made:
    logger.info(
        'torch_xla_patches.serve: writing %s again: %d of its %d captures '
        'were made in this process, for calls the loaded ones refused', path,
        served.captures_made, len(served.captures()))
    _save(served, path, key)


def _compiling_in_background(
    load: Callable[[],
                   serialization.CompiledModel]) -> serialization.CompiledModel:
  """A pending capture of the artifact (only serve() in the background
  leaves some), loaded: its first call compiles in the background, as the
  first capture's does (see [Note: Ready at once])."""
  compiled = load()
  compiled.backend_callable.compile_in_background()
  return compiled


def serve(model: torch.nn.Module,
          signatures: Iterable[Any],
          *,
          cache_dir: Optional[str] = None,
          wait: Optional[bool] = None) -> ServedModel:
  """See torch_xla_patches.serve. One pass: the key, then the artifact
  loaded or the model captured, then the served object, its buckets
  compiling, then a captured model saved once they are compiled."""
  module = serialization.forward_owner(model)
  forward_call = module is not None
  if not forward_call:
    module = model
  _check_model(module)
  buckets = _buckets(signatures)
  cache_dir = os.fspath(cache_dir) if cache_dir else config.cache_dir
  wait = config.serve_wait if wait is None else wait
  if not versions.has_torch_aot_compile():
    _say_no_aot_compile()
    return _serve_with_torch_compile(model, module, buckets, wait)
  key = serve_key(module, buckets, forward_call)
  path = artifact_path(cache_dir, key) if cache_dir else None
  loaded = _load(path, model, key, buckets, first_only=not wait)
  captures = loaded.captures
  tensor_pool: Optional[Dict[Any, torch.Tensor]] = None
  if not captures and loaded.reason:
    logger.info('torch_xla_patches.serve: tracing %s (%s)', key.model,
                loaded.reason)
  if not captures and wait:
    # See [Note: The first capture].
    # The buckets then reuse the example's tensors (a whole KV cache, say).
    tensor_pool = {}
    import torch_xla
    args, kwargs = _example(buckets).materialize(torch_xla.device(),
                                                 tensor_pool,
                                                 for_trace=True)
    first = _capture(model, key, args, kwargs)
    del args, kwargs
    if first is None:
      return _serve_with_torch_compile(model, module, buckets, wait)
    captures = (first,)
  served = ServedModel(captures,
                       module,
                       path,
                       loaded=bool(loaded.captures),
                       capture=functools.partial(_capture, model, key),
                       fallback=functools.partial(torch.compile,
                                                  model,
                                                  backend='openxla',
                                                  dynamic=True),
                       pending=[
                           functools.partial(_compiling_in_background, load)
                           for load in loaded.pending
                       ])

  if forward_call:
    _as_forward(served, module)
  if not wait:
    # Whichever call comes first, the warm-up's or a request's, the
    # recorded signatures compile in the background.
    for compiled in captures:
      compiled.backend_callable.compile_in_background()
  then = None
  if path is not None and not served.loaded:
    # After the buckets: the artifact keeps the signatures they compiled,
    # and the captures made for buckets the first one's guards refused.
    then = functools.partial(_save, served, path, key)
  elif path is not None:
    then = functools.partial(_restart_warmed_up, served, path, key)
  _compile_buckets(served, buckets, tensor_pool, wait, then)
  return served


def _as_forward(served: ServedModel, module: torch.nn.Module) -> None:
  """Gives `served` the signature of the module's forward, which it stands
  in for: generate() reads the forward's parameters to choose what it
  passes (see [Note: Serving a module's forward] in serialization.py)."""
  served.__signature__ = inspect.signature(serialization.class_forward(module))


def _say_no_aot_compile() -> None:
  global _warned_no_aot_compile
  if not _warned_no_aot_compile:
    _warned_no_aot_compile = True
    logger.info(
        'torch_xla_patches.serve: torch %s has no aot_compile, so every '
        'restart traces the model with dynamo again; the signature index '
        'still compiles the recorded signatures first.', torch.__version__)


def _serve_with_torch_compile(model: Any, module: torch.nn.Module,
                              buckets: Sequence[CallSpec],
                              wait: bool) -> ServedModel:
  """`model`, the module or its forward, compiled with torch.compile."""
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  served = ServedModel((compiled,), module, None, loaded=False)
  if model is not module:
    _as_forward(served, module)
  _compile_buckets(served, buckets, None, wait)
  return served
