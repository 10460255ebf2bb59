"""torch_xla_patches: one dynamo trace, one XLA program per shape signature.

  import torch_xla_patches
  torch_xla_patches.apply()

replaces `extract_compiled_graph` of torch_xla's dynamo bridge with the one in
`torch_xla_patches.dynamo_bridge`. `revert()` restores everything apply()
changed.
"""
import functools
import logging
import os
import sys
import threading
from typing import Any, Optional

from torch_xla_patches import _patching
from torch_xla_patches import config
from torch_xla_patches import native
from torch_xla_patches import torch_internals
from torch_xla_patches import versions
from torch_xla_patches.call_spec import CallSpec
from torch_xla_patches.io_utils import Sharding, TensorSpec
from torch_xla_patches.generation import (CompiledAfterReady, EngineClosed,
                                          GenerationEngine,
                                          GenerationRequestError,
                                          GenerationResult, GenerationStats,
                                          SlotsBusy)

# See [Note: Supported releases] in versions.py.
SUPPORTED_TORCH_XLA_VERSIONS = versions.SUPPORTED_TORCH_XLA_VERSIONS
SUPPORTED_TORCH_VERSIONS = versions.SUPPORTED_TORCH_VERSIONS

_registry = _patching.PatchRegistry()
_lock = threading.Lock()
_decompositions_installed = False


def is_applied() -> bool:
  return len(_registry) > 0


def original(owner: Any, name: str) -> Any:
  """What `owner.name` was before apply() (the current value if unpatched)."""
  return _registry.original(owner, name)


def apply(*,
          automatic_dynamic_shapes: Optional[bool] = None,
          cache_dir: Optional[str] = None,
          precompile_mode: Optional[str] = None,
          persistent_executables: Optional[bool] = None) -> None:
  """Installs the patched bridge. Safe to call more than once.

  Arguments that are not None set the config flag of the same name (see
  config.py); revert() restores them.

  Args:
    automatic_dynamic_shapes: turn dynamo's automatic dynamic shapes back on
      (config.automatic_dynamic_shapes).
    cache_dir: directory of the persistent signature index
      (config.cache_dir, env XLA_PATCHES_CACHE_DIR).
    precompile_mode: 'sync', 'interleaved' or 'off' (config.precompile_mode).
    persistent_executables: also call xr.initialize_cache(<cache_dir>/xla);
      must happen before the first XLA compile of the process.
  """
  flags = {
      'automatic_dynamic_shapes': automatic_dynamic_shapes,
      'cache_dir': None if cache_dir is None else os.fspath(cache_dir),
      'precompile_mode': precompile_mode,
      'persistent_executables': persistent_executables,
  }
  for name, value in flags.items():
    if value is not None:
      config.check(name, value)
  global _decompositions_installed
  import torch_xla
  import torch_xla._dynamo.dynamo_bridge as upstream_bridge
  import torch_xla.core.dynamo_bridge as core_bridge

  with _lock:
    if is_applied():
      return
    # Everything that can refuse runs before anything changes.
    versions.check_supported()
    dynamo_config = torch_internals.dynamo_config(
        'automatic_dynamic_shapes', 'enable_cpp_symbolic_shape_guards')
    for module in (upstream_bridge, core_bridge):
      target = _patching.PatchTarget(module, 'extract_compiled_graph')
      current = getattr(module, 'extract_compiled_graph', None)
      if current is None:
        raise RuntimeError(
            f'torch_xla_patches cannot patch {target.describe()}: expected a '
            'function, found nothing.')
      _patching.check_signature(target, current, ('xla_model', 'xla_args'))
    fx_tracer, fx_module, fx_check = torch_internals.fx_tracing_flag_users()
    backends = torch_internals.backend_registry()
    openxla = (torch_internals.openxla_backend()
               if config.donate_inplace_updates else None)
    index_dir = config.cache_dir if cache_dir is None else os.fspath(cache_dir)
    if persistent_executables is None:
      persistent_executables = config.persistent_executables
    if (persistent_executables and index_dir and
        torch_xla._XLAC._xla_computation_cache_is_initialized()):
      raise RuntimeError(
          'torch_xla_patches.apply(persistent_executables=True) must run '
          'before the first XLA computation of the process.')
    from torch_xla_patches import donation, dynamo_bridge
    from torch_xla_patches import io_utils, serialization

    flags['persistent_executables'] = persistent_executables
    for name, value in flags.items():
      if value is not None:
        _registry.set(config, name, value)
    _install_log_handler()
    if config.switch_interval:
      _registry.on_revert(
          functools.partial(sys.setswitchinterval, sys.getswitchinterval()))
      sys.setswitchinterval(config.switch_interval)
    for module in (upstream_bridge, core_bridge):
      _registry.set(module, 'extract_compiled_graph',
                    dynamo_bridge.extract_compiled_graph)
    # AOTAutograd's in-place updates of inputs, for buffer donation (see
    # [Note: Donating in-place updates]): kept in inference graphs, recorded
    # where the epilogue still writes them (training graphs).
    if openxla is not None:
      backends['openxla'] = torch_internals.InferenceUpdatesInGraph(openxla)
      _registry.on_revert(
          functools.partial(backends.__setitem__, 'openxla', openxla))
    backend_module = torch_internals.xla_backend_module()
    _registry.set(
        backend_module, 'xla_backend_helper',
        donation.record_mutated_inputs(
            _registry.original(backend_module, 'xla_backend_helper')))
    # A sync of every live tensor waits for the traces on placeholders in
    # flight (see [Note: Syncs wait for placeholder graphs] in io_utils.py);
    # torch_xla.sync(), xm.mark_step() and torch_xla.step() all call the
    # step marker. Without this guard nothing traces on placeholders.
    _registry.set(
        torch_xla._XLAC, '_xla_step_marker',
        io_utils.placeholder_traces.guarding(
            _registry.original(torch_xla._XLAC, '_xla_step_marker')))
    _registry.on_revert(io_utils.placeholder_traces.unguarded)
    # torch.compile(dynamic=...) from many threads (see [Note: dynamo's
    # config from many threads]).
    eval_frame = torch_internals.dynamo_eval_frame_module()
    _registry.set(
        eval_frame, 'make_set_enable_dynamic',
        torch_internals.shared_dynamic_config(
            _registry.original(eval_frame, 'make_set_enable_dynamic')))
    # torch.compile'd calls on one thread while another compiles (see [Note:
    # FX tracing seen per thread]).
    _registry.set(
        fx_tracer, 'trace',
        torch_internals.counting_fx_traces(
            _registry.original(fx_tracer, 'trace')))
    _registry.set(
        fx_module, fx_check,
        torch_internals.fx_tracing_on_this_thread(
            _registry.original(fx_module, fx_check), fx_tracer))
    # The per-call work in C++, loaded where its build step built it (see
    # [Note: Building the native fast path]); never built here.
    native.helpers()
    if config.automatic_dynamic_shapes:
      _registry.set(dynamo_config, 'automatic_dynamic_shapes', True)
    if not config.cpp_symbolic_shape_guards:
      _registry.set(dynamo_config, 'enable_cpp_symbolic_shape_guards', False)
    if config.persistent_executables and config.cache_dir:
      import torch_xla.runtime as xr
      xr.initialize_cache(os.path.join(config.cache_dir, 'xla'), readonly=False)
    if config.install_decompositions:
      from torch_xla_patches import decompositions
      decompositions.install()
      _decompositions_installed = True
    if versions.has_torch_aot_compile():
      serialization.register_backend()
    # Last, so revert() first stops the background compiles (see [Note: The
    # compile pool]) before it takes the bridge away.
    _registry.on_revert(_stop_background_compiles)


def _stop_background_compiles() -> None:
  from torch_xla_patches import compile_window, warmup
  warmup.stop_background_warm_ups()
  compile_window.stop_background_compiles()


def _install_log_handler() -> None:
  """Shows the package's log records (warnings, and the progress and
  explanations the flags turn on) on stderr, one plain line each, unless the
  application configured the `torch_xla_patches` logger itself."""
  package_logger = logging.getLogger(__name__)
  if package_logger.handlers:
    return
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter('%(message)s'))
  _registry.set(package_logger, 'handlers', [handler])
  _registry.set(package_logger, 'propagate', False)
  if package_logger.level == logging.NOTSET:
    _registry.set(package_logger, 'level', logging.INFO)
    # setLevel also clears the enabled-for caches of the child loggers.
    package_logger.setLevel(logging.INFO)


def precompile(compiled_fn, specs, progress: bool = True):
  """See torch_xla_patches.warmup.precompile."""
  from torch_xla_patches import warmup
  return warmup.precompile(compiled_fn, specs, progress=progress)


def serve(model,
          signatures,
          *,
          cache_dir: Optional[str] = None,
          wait: Optional[bool] = None):
  """Compiles `model` for its serving buckets and returns a callable that
  serves it; see [Note: Serving restarts] in serving.py.

  Args:
    model: an nn.Module on the XLA device, for inference (calls run under
      torch.no_grad()), or its bound forward, to put in the forward's place
      (`model.forward = serve(model.forward, ...)`, for generate(); see
      [Note: Serving a module's forward] in serialization.py).
    signatures: the serving buckets: an iterable of CallSpec (positional
      and keyword arguments: TensorSpecs, scalars, strings, None and
      objects holding tensors (a transformers StaticCache: an example the
      warm-up copies), nested in lists, tuples and dicts), or of
      tuples of TensorSpec for positional tensors. Other shapes are compiled
      when a call needs them.
    cache_dir: where the artifact (and, unless apply() was given another
      directory, the signature index) is kept across restarts; default
      XLA_PATCHES_CACHE_DIR. None: nothing is kept.
    wait: False: return at once (the first call captures the model) or
      once the artifact is loaded, with the buckets compiling in the
      background (see [Note: Ready at once] in
      serving.py; served.readiness(), served.wait_ready()); True: return
      once every bucket is compiled. Default XLA_PATCHES_SERVE_WAIT (off).
  Returns:
    A served_model.ServedModel: served(*args, **kwargs) returns what
    model(*args, **kwargs) returns.
  """
  apply()
  from torch_xla_patches import fast_dispatch
  with _lock:
    if cache_dir is not None and not config.cache_dir:
      _registry.set(config, 'cache_dir', os.fspath(cache_dir))
    if not fast_dispatch.module_watch.installed:
      # The fast path of served calls relies on it; see [Note: Served fast
      # path].
      for owner, name, replacement in fast_dispatch.module_watch.patches():
        _registry.set(owner, name, replacement)
      _registry.on_revert(fast_dispatch.module_watch.install_hooks())
  from torch_xla_patches import serving
  return serving.serve(model, signatures, cache_dir=cache_dir, wait=wait)


def save(compiled, path, example_inputs=None):
  """See torch_xla_patches.serialization.save."""
  from torch_xla_patches import serialization
  return serialization.save(compiled, path, example_inputs)


def load(path, model=None, precompile: bool = True):
  """See torch_xla_patches.serialization.load."""
  from torch_xla_patches import serialization
  return serialization.load(path, model=model, precompile=precompile)


def revert() -> None:
  """Undoes apply(). Safe to call more than once."""
  global _decompositions_installed
  with _lock:
    _registry.revert_all()
    package_logger = logging.getLogger(__name__)
    package_logger.setLevel(package_logger.level)
    from torch_xla_patches import serialization
    serialization.unregister_backend()
    if _decompositions_installed:
      from torch_xla_patches import decompositions
      decompositions.uninstall()
      _decompositions_installed = False
