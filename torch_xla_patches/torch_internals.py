"""The private torch APIs save/load use, each reached through one function.

[Note: Private torch APIs]
Saving a compiled model needs parts of torch that are not public: dynamo's
`aot_compile` module and its artifact fields, the code-object wrapper of
`torch._dynamo.package`, the backend registry's dict, and FX's graph pickler.
Every use goes through this module. Each function imports what it needs when
called and, if torch does not have it, raises `TorchInternalsError` naming the
missing attribute and the torch version found; the torch releases that have
each of them are listed in versions.py ([Note: Supported releases]).
"""
import importlib
from typing import Any, Dict, Tuple, Type


class TorchInternalsError(RuntimeError):
  """A private torch API this package needs is missing."""


def _attribute(module_name: str, name: str) -> Any:
  try:
    module = importlib.import_module(module_name)
    return getattr(module, name)
  except (ImportError, AttributeError):
    import torch
    raise TorchInternalsError(
        f'torch_xla_patches: {module_name}.{name} is missing from torch '
        f'{torch.__version__}; saving and loading compiled models needs the '
        'torch releases listed in torch_xla_patches/versions.py.') from None


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


def backend_registry() -> Dict[str, Any]:
  """dynamo's {backend name: compiler function} dict."""
  return _attribute('torch._dynamo.backends.registry', '_COMPILER_FNS')


def graph_pickler() -> Tuple[Type, Type]:
  """(GraphPickler, Options) of torch.fx._graph_pickler."""
  return (_attribute('torch.fx._graph_pickler', 'GraphPickler'),
          _attribute('torch.fx._graph_pickler', 'Options'))


def capture_settings(dynamic: bool, size_oblivious: bool):
  """A context manager with the dynamo and FX settings aot_compile captures
  under: aot_compile enabled, every size symbolic (`dynamic`), and symbolic
  sizes guarded as `0 <= size` rather than `2 <= size` (`size_oblivious`)."""
  import contextlib
  import torch._dynamo
  fx_config = importlib.import_module('torch.fx.experimental._config')
  for owner, name in ((torch._dynamo.config, 'enable_aot_compile'),
                      (fx_config, 'backed_size_oblivious')):
    if not hasattr(owner, name):
      import torch
      raise TorchInternalsError(
          f'torch_xla_patches: the config flag {name} is missing from torch '
          f'{torch.__version__}.')
  dynamo_settings = {'enable_aot_compile': True}
  if dynamic:
    dynamo_settings['assume_static_by_default'] = False
  stack = contextlib.ExitStack()
  stack.enter_context(torch._dynamo.config.patch(**dynamo_settings))
  stack.enter_context(fx_config.patch(backed_size_oblivious=size_oblivious))
  return stack
