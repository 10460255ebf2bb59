"""Save a compiled model to a file; load it in a new process without dynamo.

  compiled = torch_xla_patches.serialization.aot_compile(model, (x,))
  compiled(x2)                      # serves, and records x2's signature
  torch_xla_patches.save(compiled, 'model.xla_aot')
  ...                               # a new process:
  loaded = torch_xla_patches.load('model.xla_aot', model=model)
  loaded(x3)                        # no dynamo trace, torch's guards checked

torch 2.9's `aot_compile` (`torch._dynamo.config.enable_aot_compile`) captures
a function with dynamo once and saves dynamo's bytecode and guards; the
backend's compiled callable must be a `SerializableCallable`. The `openxla`
backend returns a closure, so this module adds the `openxla_serializable`
backend, whose callable (`XlaSerializableCallable`) runs the graph through
the patched bridge (`torch_xla_patches.dynamo_bridge.extract_compiled_graph`)
and serializes:
  * the FX graph dynamo handed to the backend (`GraphPickler`), and
  * the shape signatures the bridge compiled for it (`persistent.make_record`
    of each, with the graph's input kinds),
so the loading process compiles the known signatures before the first request
(see [Note: Precompile on load]) and any new one on demand.

Limits, on purpose:
  * Inference only. The graph is dynamo's (torch-level ops, before
    AOTAutograd) and the bridge traces it directly, so there is no backward;
    every call runs under torch.no_grad().
  * No XLA executable is saved: torch_xla 2.9 cannot load serialized
    executables (see config.persistent_executables), so each signature is
    compiled again in the new process. What the artifact saves is dynamo's
    trace and guards (most of a cold first call) and the list of signatures.
  * `fullgraph=True` only (a torch aot_compile restriction), and the model's
    classes must be defined at a module's top level: torch 2.9 cannot save
    a type guard on a class defined in a function ("defined in local
    scope").
  * A graph the bridge partitions around CPU fallback ops runs and saves,
    but records no signatures: each XLA part compiles on demand.

[Note: Artifact safety]
The file is a magic line, a JSON header and a pickle payload. The header holds
the payload's SHA-256 and size, the torch, torch_xla and Python versions, and
a digest of the model's source (every nn.Module class in the model, or the
function). `load` refuses, with `ArtifactMismatchError` naming expected and
found values, an artifact from other versions or for other source, because
the saved bytecode and graph may then compute something else. A file that is
truncated or does not parse raises `ArtifactCorruptError`. Both are
`ArtifactError`s. The payload is a pickle: load only files you trust.
"""
import dataclasses
import hashlib
import importlib
import inspect
import io
import json
import logging
import os
import pickle
import platform
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import io_utils
from torch_xla_patches import persistent
from torch_xla_patches.versions import (has_torch_aot_compile,
                                        require_torch_aot_compile)

if has_torch_aot_compile():
  from torch._dynamo.aot_compile import SerializableCallable
else:
  # torch 2.8: the module imports, and aot_compile/save/load say which torch
  # they need (see [Note: Supported releases] in versions.py).
  SerializableCallable = object
from torch_xla_patches.signature import ArgKind

logger = logging.getLogger('torch_xla_patches.serialization')

BACKEND_NAME = 'openxla_serializable'
FORMAT_VERSION = 1
_MAGIC = b'TORCH_XLA_PATCHES_AOT\n'
# The header is one JSON line; anything longer than this is not our file.
_MAX_HEADER_BYTES = 1 << 20


class ArtifactError(RuntimeError):
  """An artifact that cannot be loaded; the message says why."""


class ArtifactCorruptError(ArtifactError):
  """The file is truncated, altered, or not an artifact at all."""


class ArtifactMismatchError(ArtifactError):
  """The artifact was made for other versions or other model source."""


def _records_to_state(
    kinds: Optional[List[str]],
    records: Sequence[persistent.RecordedSignature]) -> Dict[str, Any]:
  return {
      # Informational: each record is checked against the live graph's kinds.
      'kinds':
          kinds,
      'specs': [list(r.specs) for r in records],
      'shardings': [
          None if r.shardings is None else list(r.shardings) for r in records
      ],
  }


def _records_from_state(state: Any) -> Tuple[persistent.RecordedSignature, ...]:
  """The recorded signatures of a deserialized artifact, unchecked: each is
  checked against the live graph when it is replayed (see [Note: Index
  contents are untrusted]), so a damaged one is skipped there, counted and
  named, never fatal."""
  if state is None:
    return ()
  specs = state.get('specs') if isinstance(state, dict) else state
  shardings = state.get('shardings') if isinstance(state, dict) else None
  if not isinstance(specs, list):
    # Kept as one record that fails its check when replayed, so the damage
    # is reported and counted like any other.
    specs = [specs]
  if not isinstance(shardings, list) or len(shardings) != len(specs):
    shardings = [None] * len(specs)
  records = []
  for index, (raw, raw_shardings) in enumerate(zip(specs, shardings)):
    try:
      record_id = persistent.record_id_of(raw, raw_shardings)
    except (TypeError, ValueError):
      record_id = f'unreadable-{index}'
    records.append(
        persistent.RecordedSignature(
            record_id=record_id,
            specs=tuple(raw) if isinstance(raw, list) else raw,
            shardings=(tuple(raw_shardings)
                       if isinstance(raw_shardings, list) else raw_shardings),
            source='the artifact'))
  return tuple(records)


@dataclasses.dataclass(frozen=True)
class ArtifactHeader:
  """What `load` checks before it unpickles anything but the header."""
  format_version: int
  torch_version: str
  torch_xla_version: str
  python_version: str
  # 'Block', 'DecoderLM', ... or the function's qualified name.
  model_name: str
  # SHA-256 over model_source_parts (see _source_parts).
  model_source_digest: str
  # {qualified class or function name: SHA-256 of its source}.
  model_source_parts: Dict[str, str]
  # Whether the function was a bound method (called as fn(model, *args)).
  bound_method: bool
  # Positional arguments of a call to warm up with: an input spec per
  # argument (see _arg_specs), or None if they cannot be rebuilt.
  example_args: Optional[List[Any]]
  payload_sha256: str
  payload_size: int

  def check_runtime(self) -> None:
    expected = {
        'torch': self.torch_version,
        'torch_xla': self.torch_xla_version,
        'Python': self.python_version,
    }
    found = _runtime_versions()
    differing = [
        f'{name} {expected[name]} (found {found[name]})' for name in expected
        if expected[name] != found[name]
    ]
    if differing:
      raise ArtifactMismatchError(
          'torch_xla_patches: the artifact was saved with ' +
          ', '.join(differing) + '; refusing to load it. Save it again with '
          'the versions of this process.')


def _runtime_versions() -> Dict[str, str]:
  import torch_xla
  return {
      'torch': torch.__version__,
      'torch_xla': torch_xla.__version__,
      'Python': platform.python_version(),
  }


# ---------------------------------------------------------------------------
# The backend and its serializable callable.


def _pickle_graph(graph_module: torch.fx.GraphModule) -> bytes:
  from torch.fx._graph_pickler import GraphPickler, Options
  for node in graph_module.graph.nodes:
    # dynamo keeps a placeholder's fake value under 'example_value'; the
    # bridge's ArgLayout reads 'val' to tell static from symbolic sizes.
    if node.op == 'placeholder' and 'val' not in node.meta:
      if 'example_value' in node.meta:
        node.meta['val'] = node.meta['example_value']
  # Only what the bridge reads survives: the rest of dynamo's metadata
  # (sources, stack traces, weak references) is not needed to run the graph
  # and not always picklable.
  kept = {}
  for node in graph_module.graph.nodes:
    kept[node] = node.meta
    node.meta = {k: v for k, v in node.meta.items() if k in ('val',)}
  try:
    # ops_filter=None: dynamo's graph calls torch-level functions and tensor
    # methods, not just aten ops.
    return GraphPickler.dumps(graph_module, Options(ops_filter=None))
  finally:
    for node, meta in kept.items():
      node.meta = meta


def _unpickle_graph(data: bytes) -> torch.fx.GraphModule:
  from torch._subclasses.fake_tensor import FakeTensorMode
  from torch.fx._graph_pickler import GraphPickler
  from torch.fx.experimental.symbolic_shapes import ShapeEnv
  # Fake values (and their symbolic sizes) are rebuilt in a mode of their
  # own; they are only read as metadata.
  fake_mode = FakeTensorMode(shape_env=ShapeEnv())
  graph_module = GraphPickler.loads(data, fake_mode)
  # The pickled module carries no generated forward; make it.
  graph_module.recompile()
  return graph_module


class XlaSerializableCallable(SerializableCallable):
  """The compiled callable of the `openxla_serializable` backend.

  Runs the graph through the patched bridge, compiling on the first call
  (like upstream's `xla_backend_helper`), and records each new signature so
  it can be saved.

  Args:
    graph_bytes: the pickled FX graph (see _pickle_graph).
    graph_module: the graph to run; unpickled from graph_bytes if None.
    recorded: signatures to compile on the first call (from an artifact).
  """

  def __init__(self,
               graph_bytes: bytes,
               graph_module: Optional[torch.fx.GraphModule] = None,
               recorded: Sequence[persistent.RecordedSignature] = ()):
    self._graph_bytes = graph_bytes
    self._graph_module = (graph_module if graph_module is not None else
                          _unpickle_graph(graph_bytes))
    self._single_output = _returns_one_value(self._graph_module)
    # From an artifact: queued on the first call, and saved again whether or
    # not they were compiled here.
    self._loaded = tuple(recorded)
    self._compiled = None
    self._cache = None
    # A record of every signature served here, by key, in first-seen order.
    self._seen: Dict[Any, persistent.RecordedSignature] = {}
    # The first call's arguments: the live parameters later replays use.
    self._live_args: Optional[List[Any]] = None

  def name_source(self, source: str) -> None:
    """Names the file the loaded signatures came from, for messages."""
    self._loaded = tuple(
        dataclasses.replace(r, source=source) for r in self._loaded)

  # -- running

  def __call__(self, *args):
    if self._compiled is None:
      self._compile_first(list(args))
    cache = self._cache
    if cache is not None:
      key = cache.key_of(args)
      if key not in self._seen:
        self._seen[key] = persistent.make_record(cache.layout, args)
    out = self._compiled(*args)
    # The bridge unwraps a single output (upstream's convention); dynamo's
    # bytecode indexes the graph's output tuple.
    if self._single_output and not isinstance(out, (tuple, list)):
      return (out,)
    return out

  def _compile_first(self, args: List[Any]) -> None:
    from torch_xla_patches import config, dynamo_bridge
    self._compiled = dynamo_bridge.extract_compiled_graph(
        self._graph_module, args)
    cache = getattr(self._compiled, 'signature_cache', None)
    if cache is None:
      # The bridge partitioned the graph around CPU fallback ops: each XLA
      # part has its own cache; signatures are then compiled on demand.
      return
    self._cache = cache
    self._live_args = args
    # [Note: Precompile on load]
    # The signatures an artifact recorded join the graph's backlog after the
    # first call's own and are replayed by the bridge (see [Note: Replaying
    # recorded signatures]) as config.precompile_mode says: all before the
    # first call returns ('sync', within the replay bounds; the rest one
    # after each call), one after each call ('interleaved'), or when
    # CompiledModel.precompile_pending() is called ('off').
    cache.queue_recorded(self._loaded, except_args=args)
    if config.precompile_mode == 'sync':
      cache.drain_backlog(args,
                          max_count=config.replay_sync_max_signatures or None,
                          seconds=config.replay_sync_seconds or None)

  def precompile_pending(self) -> int:
    """Compiles the backlog now; returns how many signatures it compiled."""
    if self._cache is None or not self._cache.backlog_size:
      return 0
    return self._cache.drain_backlog(self._live_args).compiled

  def recorded_signatures(self) -> Tuple[persistent.RecordedSignature, ...]:
    """Signatures to save: those served here, then those loaded."""
    records = list(self._seen.values())
    ids = {r.record_id for r in records}
    records.extend(r for r in self._loaded if r.record_id not in ids)
    return tuple(records)

  # -- SerializableCallable

  @classmethod
  def serialize_compile_artifacts(cls, fn: 'XlaSerializableCallable') -> bytes:
    records = fn.recorded_signatures()
    kinds = None
    if fn._cache is not None:
      kinds = [kind.value for kind in fn._cache.layout.kinds]
    return pickle.dumps({
        'format_version': FORMAT_VERSION,
        'graph': fn._graph_bytes,
        'signatures': _records_to_state(kinds, records) if records else None,
    })

  @classmethod
  def deserialize_compile_artifacts(cls,
                                    data: bytes) -> 'XlaSerializableCallable':
    state = pickle.loads(data)
    if not isinstance(state,
                      dict) or state.get('format_version') != FORMAT_VERSION:
      raise ArtifactCorruptError(
          'torch_xla_patches: compiled graph format '
          f'{state.get("format_version") if isinstance(state, dict) else state!r}'
          f', expected {FORMAT_VERSION}')
    return XlaSerializableCallable(state['graph'],
                                   recorded=_records_from_state(
                                       state.get('signatures')))


def _returns_one_value(graph_module: torch.fx.GraphModule) -> bool:
  for node in graph_module.graph.nodes:
    if node.op == 'output':
      out = node.args[0]
      return isinstance(out, (tuple, list)) and len(out) == 1
  return False


def openxla_serializable(graph_module: torch.fx.GraphModule,
                         example_inputs: Sequence[Any]):
  """Dynamo backend: like `openxla_eval` (no AOTAutograd), but serializable.

  Inference only, see the module docstring.
  """
  del example_inputs  # compiled on the first real call, like openxla
  graph_bytes = _pickle_graph(graph_module)
  return XlaSerializableCallable(graph_bytes, graph_module=graph_module)


def register_backend() -> None:
  """Registers `openxla_serializable` with dynamo (apply() calls this)."""
  from torch._dynamo.backends import registry
  registry._COMPILER_FNS.setdefault(BACKEND_NAME, openxla_serializable)


def unregister_backend() -> None:
  from torch._dynamo.backends import registry
  if registry._COMPILER_FNS.get(BACKEND_NAME) is openxla_serializable:
    del registry._COMPILER_FNS[BACKEND_NAME]


# ---------------------------------------------------------------------------
# Model source digest.


def _source_of(obj: Any) -> str:
  try:
    return inspect.getsource(obj)
  except (OSError, TypeError):
    # No source file to read (a REPL, exec, a renamed class): fall back to
    # the compiled code of its functions, which changes with the source.
    codes = []
    if inspect.isclass(obj):
      for name, member in sorted(vars(obj).items()):
        if inspect.isfunction(member):
          codes.append(f'{name}:{_code_text(member.__code__)}')
    elif hasattr(obj, '__code__'):
      codes.append(_code_text(obj.__code__))
    return '\n'.join(codes)


def _code_text(code: types.CodeType) -> str:
  """Bytecode, names and constants (nested code too) of a code object."""
  consts = [
      _code_text(c) if isinstance(c, types.CodeType) else repr(c)
      for c in code.co_consts
  ]
  return f'{code.co_code.hex()}|{code.co_names}|{consts}'


def _source_parts(model: Any) -> Dict[str, str]:
  """{name: SHA-256 of source} of every module class in `model`, or of the
  function `model`."""
  if isinstance(model, torch.nn.Module):
    objects = {}
    for module in model.modules():
      cls = type(module)
      objects[f'{cls.__module__}.{cls.__qualname__}'] = cls
  else:
    fn = getattr(model, '__func__', model)
    objects = {f'{fn.__module__}.{fn.__qualname__}': fn}
  return {
      name: hashlib.sha256(_source_of(obj).encode()).hexdigest()
      for name, obj in sorted(objects.items())
  }


def _digest(parts: Dict[str, str]) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _model_name(model: Any) -> str:
  if isinstance(model, torch.nn.Module):
    return type(model).__qualname__
  return getattr(model, '__qualname__', repr(model))


def _arg_specs(args: Sequence[Any]) -> Optional[List[Any]]:
  """Input specs of positional call arguments; None if one is not a tensor
  or a number (then nothing is warmed up at load)."""
  if not all(isinstance(a, (torch.Tensor, bool, int, float)) for a in args):
    return None
  return [io_utils.arg_spec(arg) for arg in args]


def _rebuild_call_args(specs: Any, device: Any, max_bytes: int) -> List[Any]:
  """The example call of a header, checked before anything is allocated;
  persistent.RecordError says what is wrong with it."""
  if not isinstance(specs, list):
    raise persistent.RecordError(f'example_args is {type(specs).__name__}')
  total = 0
  for index, spec in enumerate(specs):
    if isinstance(spec, dict) and set(spec) == {'value'}:
      if not isinstance(spec['value'], (bool, int, float)):
        raise persistent.RecordError(f'argument {index} is not a number')
      continue
    (checked,) = persistent.parse_specs((ArgKind.DYNAMIC_TENSOR,), [spec])
    total += persistent.tensor_bytes(checked['shape'],
                                     io_utils.dtype_from_name(checked['dtype']))
  if total > max_bytes:
    raise persistent.RecordError(
        f'its tensors would take {total} bytes, over the bound of {max_bytes}')
  return [io_utils.arg_from_spec(spec, device) for spec in specs]


# ---------------------------------------------------------------------------
# torch's AOTCompiledFunction, to and from bytes.


class _ClosurePickler(pickle.Pickler):
  """Pickles Python modules by name (a closure over `torch` is common)."""

  def reducer_override(self, obj):
    if isinstance(obj, types.ModuleType):
      return importlib.import_module, (obj.__name__,)
    return NotImplemented


def _serialize_aot(aot_fn) -> bytes:
  """Like AOTCompiledFunction.serialize, but also for functions with a
  closure.

  [Note: Closures in saved functions]
  torch 2.9 pickles the captured function's closure cells as they are, and
  cells do not pickle ("cannot pickle 'cell' object"), so a forward that
  uses a name from an enclosing function (a class defined in a function that
  imports torch) cannot be saved with torch's serialize. Here each cell is
  saved as its contents (modules by name) and made a cell again on load.
  The rest of the state is what torch's serialize writes."""
  from torch._dynamo.package import SerializedCode
  state = aot_fn._artifacts.__dict__.copy()
  # Rebuilt on load from guards_state, as torch does.
  state['guard_manager'] = None
  state['bytecode'] = SerializedCode.from_code_object(state['bytecode'])
  state['original_code'] = SerializedCode.from_code_object(
      state['original_code'])
  compiled_fn = state['compiled_fn']
  state['compiled_fn'] = (
      type(compiled_fn).deserialize_compile_artifacts,
      type(compiled_fn).serialize_compile_artifacts(compiled_fn))
  if state['closure'] is not None:
    state['closure'] = tuple(cell.cell_contents for cell in state['closure'])
  with io.BytesIO() as stream:
    _ClosurePickler(stream).dump(state)
    return stream.getvalue()


def _deserialize_aot(data: bytes):
  from torch._dynamo.aot_compile import AOTCompiledFunction, CompileArtifacts
  from torch._dynamo.package import SerializedCode
  state = pickle.loads(data)
  state['bytecode'] = SerializedCode.to_code_object(state['bytecode'])
  state['original_code'] = SerializedCode.to_code_object(state['original_code'])
  deserializer, compiled_state = state['compiled_fn']
  state['compiled_fn'] = deserializer(compiled_state)
  if state['closure'] is not None:
    state['closure'] = tuple(types.CellType(v) for v in state['closure'])
  # AOTCompiledFunction rebuilds torch's guards from guards_state here.
  return AOTCompiledFunction(CompileArtifacts(**state))


# ---------------------------------------------------------------------------
# Compile, save, load.


class CompiledModel:
  """A model or function compiled with torch's aot_compile and our backend.

  Call it like the model. `torch_xla_patches.save` writes it to a file.

  Args:
    aot_fn: the AOTCompiledFunction.
    model: the nn.Module whose forward was compiled, or the function.
    bound_method: whether aot_fn is called as aot_fn(model, *args).
    example_args: input specs of an example call (see _arg_specs), used by
      load to warm up; None if the call cannot be rebuilt from specs.
  """

  def __init__(self, aot_fn, model: Any, bound_method: bool,
               example_args: Optional[List[Any]]):
    self.aot_fn = aot_fn
    self.model = model
    self.bound_method = bound_method
    self.example_args = example_args

  def __call__(self, *args, **kwargs):
    # Inference only: the graph is dynamo's, with no AOTAutograd (see the
    # module docstring).
    with torch.no_grad():
      if self.bound_method:
        return self.aot_fn(self.model, *args, **kwargs)
      return self.aot_fn(*args, **kwargs)

  def precompile_pending(self) -> int:
    """Compiles the recorded signatures not compiled yet (see [Note:
    Precompile on load]); returns how many. Call it after the first request
    to serve that one first."""
    return self.backend_callable.precompile_pending()

  @property
  def backend_callable(self) -> XlaSerializableCallable:
    return self.aot_fn._artifacts.compiled_fn


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
      are graph inputs) or a function; a torch.compile'd module is unwrapped.
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
  import torch._dynamo
  if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
    model = model._orig_mod
  bound = isinstance(model, torch.nn.Module)
  target = model.forward if bound else model
  # aot_compile captures outside torch.compile's own context, which is where
  # dynamic=True would turn static-by-default shapes off; do it here.
  patch = {'enable_aot_compile': True}
  if dynamic:
    patch['assume_static_by_default'] = False
  import torch.fx.experimental._config as fx_config
  with torch._dynamo.config.patch(**patch), fx_config.patch(
      backed_size_oblivious=size_oblivious), torch.no_grad():
    aot_fn = torch.compile(target,
                           backend=openxla_serializable,
                           fullgraph=True,
                           dynamic=dynamic).aot_compile(
                               (tuple(args), dict(kwargs or {})))
  if not isinstance(aot_fn._artifacts.compiled_fn, XlaSerializableCallable):
    raise TypeError('torch_xla_patches: aot_compile did not use the '
                    f'{BACKEND_NAME} backend')
  return CompiledModel(aot_fn, model, bound,
                       _arg_specs(args) if not kwargs else None)


def save(compiled: Any,
         path: str,
         example_inputs: Optional[Sequence[Any]] = None) -> str:
  """Writes `compiled` to `path` atomically; returns the path.

  Args:
    compiled: a CompiledModel (from aot_compile or load), or a model /
      function / torch.compile'd module, which is then captured with
      aot_compile on `example_inputs` (positional arguments).
  """
  require_torch_aot_compile('torch_xla_patches.save')
  if not isinstance(compiled, CompiledModel):
    if example_inputs is None:
      raise TypeError('torch_xla_patches.save: pass a CompiledModel, or a '
                      'model with example_inputs to capture it with')
    compiled = aot_compile(compiled, tuple(example_inputs))
  payload = _serialize_aot(compiled.aot_fn)
  parts = _source_parts(compiled.model)
  versions = _runtime_versions()
  header = ArtifactHeader(format_version=FORMAT_VERSION,
                          torch_version=versions['torch'],
                          torch_xla_version=versions['torch_xla'],
                          python_version=versions['Python'],
                          model_name=_model_name(compiled.model),
                          model_source_digest=_digest(parts),
                          model_source_parts=parts,
                          bound_method=compiled.bound_method,
                          example_args=compiled.example_args,
                          payload_sha256=hashlib.sha256(payload).hexdigest(),
                          payload_size=len(payload))
  header_line = json.dumps(dataclasses.asdict(header),
                           sort_keys=True).encode() + b'\n'
  path = os.fspath(path)
  io_utils.atomic_write_bytes(path,
                              _MAGIC + header_line + payload,
                              prefix='.tmp-aot-')
  return path


def read_header(path: str) -> Tuple[ArtifactHeader, bytes]:
  """The header and the verified payload; ArtifactCorruptError if unusable."""
  try:
    with open(path, 'rb') as f:
      data = f.read()
  except OSError as e:
    raise ArtifactError(f'torch_xla_patches: cannot read artifact {path}: '
                        f'{e}') from None
  if not data.startswith(_MAGIC):
    raise ArtifactCorruptError(
        f'torch_xla_patches: {path} is not a torch_xla_patches artifact '
        '(no magic line)')
  end = data.find(b'\n', len(_MAGIC), len(_MAGIC) + _MAX_HEADER_BYTES)
  if end < 0:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} has no complete header')
  try:
    fields = json.loads(data[len(_MAGIC):end])
    header = ArtifactHeader(**fields)
  except (ValueError, TypeError) as e:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} has a malformed header: '
        f'{e}') from None
  if header.format_version != FORMAT_VERSION:
    raise ArtifactMismatchError(
        f'torch_xla_patches: artifact {path} has format version '
        f'{header.format_version}, expected {FORMAT_VERSION}')
  payload = data[end + 1:]
  if len(payload) != header.payload_size:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} is truncated or padded: payload '
        f'of {len(payload)} bytes, expected {header.payload_size}')
  digest = hashlib.sha256(payload).hexdigest()
  if digest != header.payload_sha256:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} is corrupt: payload SHA-256 '
        f'{digest}, expected {header.payload_sha256}')
  return header, payload


def _check_source(header: ArtifactHeader, model: Any) -> None:
  parts = _source_parts(model)
  if _digest(parts) == header.model_source_digest:
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
      f'{header.model_source_digest[:12]}; found {_digest(parts)[:12]}). '
      f'Differing: {details}. Save the artifact again from this source.')


def load(path: str,
         model: Any = None,
         precompile: bool = True) -> CompiledModel:
  """Loads an artifact written by `save`; see [Note: Artifact safety].

  Args:
    path: the artifact.
    model: the nn.Module to run (its parameters and buffers are graph inputs
      taken at call time), or the function that was saved.
    precompile: warm up now: one call on zeros of the saved example shape,
      which compiles every recorded signature (see [Note: Precompile on
      load]). Otherwise the first call does it.
  Raises:
    ArtifactCorruptError, ArtifactMismatchError.
  """
  require_torch_aot_compile('torch_xla_patches.load')
  header, payload = read_header(os.fspath(path))
  header.check_runtime()
  if model is None:
    raise TypeError('torch_xla_patches.load needs model=: the saved graph '
                    'takes the parameters, or the function, from it')
  _check_source(header, model)
  if header.bound_method != isinstance(model, torch.nn.Module):
    raise ArtifactMismatchError(
        f'torch_xla_patches: the artifact was saved for '
        f'{"a module" if header.bound_method else "a function"}, load got '
        f'{type(model).__name__}')
  try:
    aot_fn = _deserialize_aot(payload)
  except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} does not unpickle: {e}') from None
  compiled = CompiledModel(aot_fn, model, header.bound_method,
                           header.example_args)
  compiled.backend_callable.name_source(os.fspath(path))
  if precompile and header.example_args is not None:
    _warm_up(compiled, header.example_args, os.fspath(path))
  return compiled


def _warm_up(compiled: CompiledModel, example_args: Any, path: str) -> None:
  """Calls `compiled` on zeros of the saved example shapes, which compiles
  the recorded signatures (see [Note: Precompile on load]). A damaged
  example call is skipped with a warning: the first real call then does the
  same work."""
  import torch_xla
  params = compiled.model.parameters() if isinstance(compiled.model,
                                                     torch.nn.Module) else ()
  live_bytes = sum(p.numel() * p.element_size() for p in params)
  try:
    args = _rebuild_call_args(example_args, torch_xla.device(),
                              max(256 << 20, 8 * live_bytes))
  except persistent.RecordError as e:
    logger.warning(
        'torch_xla_patches: not warming up %s: its example call is unusable '
        '(%s); the first call compiles instead.', path, e)
    return
  try:
    compiled(*args)
    torch_xla.sync()
  except Exception as e:  # pylint: disable=broad-except
    logger.warning(
        'torch_xla_patches: warming up %s failed (%s: %s); the first call '
        'compiles instead.', path,
        type(e).__name__, e)
