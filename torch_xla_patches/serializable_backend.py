"""The `openxla_serializable` dynamo backend, whose compiled callable torch's
aot_compile can save.

torch 2.9's `aot_compile` saves dynamo's bytecode and guards, and needs the
backend's compiled callable to be a `SerializableCallable`. The `openxla`
backend returns a closure, so this backend returns an
`XlaSerializableCallable`: it runs the graph through the patched bridge and
serializes the FX graph dynamo handed over (`GraphPickler`) and the shape
signatures the bridge compiled for it (`record.make_record` of each), so a
loading process replays them (see [Note: Precompile on load]). The graph is
dynamo's (torch-level ops, before AOTAutograd): inference only.

`serialize_aot` and `deserialize_aot` turn the AOTCompiledFunction that holds
such a callable into the artifact's payload and back.
"""
import contextlib
import dataclasses
import io
import logging
import pickle
import re
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import artifact
from torch_xla_patches import dynamo_bridge, execution, signature_cache
from torch_xla_patches import record
from torch_xla_patches import signature
from torch_xla_patches import torch_internals
from torch_xla_patches.artifact import ArtifactCorruptError

logger = logging.getLogger('torch_xla_patches.serialization')

BACKEND_NAME = 'openxla_serializable'
# Version of the state serialize_compile_artifacts writes.
STATE_FORMAT_VERSION = 1
SerializableCallable = torch_internals.serializable_callable_base()


def _explicit_slices(graph_module: torch.fx.GraphModule) -> None:
  """Makes each slice whose bounds are graph values (`x[:, :seq]` with a
  symbolic `seq`) a node of its own, `slice(start, stop, step)`.

  torch's GraphPickler maps the nodes in a node's arguments through pytree,
  which does not look inside a slice object, and refuses a node it finds
  there (Hugging Face's BERT slices its position ids so). The graph computes
  the same: the slice is built from the same values where it was used."""
  graph = graph_module.graph
  changed = False

  def rewrite(value: Any, user: torch.fx.Node) -> Any:
    nonlocal changed
    if isinstance(value, slice):
      bounds = (value.start, value.stop, value.step)
      if any(isinstance(bound, torch.fx.Node) for bound in bounds):
        changed = True
        with graph.inserting_before(user):
          return graph.call_function(slice, bounds)
      return value
    if isinstance(value, (tuple, list)):
      return type(value)(rewrite(item, user) for item in value)
    if isinstance(value, dict):
      return {key: rewrite(item, user) for key, item in value.items()}
    return value

  for node in list(graph.nodes):
    if node.op in ('call_function', 'call_method', 'call_module'):
      node.args = rewrite(node.args, node)
      node.kwargs = rewrite(node.kwargs, node)
  if changed:
    graph_module.recompile()


def _without_view_base(value: Any) -> Any:
  """A fake tensor that is a view (an argument sliced from a larger one:
  transformers' attention mask), as a tensor of its own sizes and strides:
  torch's GraphPickler describes a view with its base, whose description
  holds the FakeTensorMode, which does not pickle. The bridge reads only the
  sizes."""
  if not isinstance(value, torch.Tensor) or not value._is_view():
    return value
  fake_mode = getattr(value, 'fake_mode', None)
  if fake_mode is None:
    return value
  with fake_mode:
    return torch.empty_strided(value.shape,
                               value.stride(),
                               dtype=value.dtype,
                               device=value.device)


def _pickle_graph(graph_module: torch.fx.GraphModule) -> bytes:
  GraphPickler, Options = torch_internals.graph_pickler()
  _explicit_slices(graph_module)
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
    node.meta['val'] = _without_view_base(node.meta.get('val'))
  try:
    # ops_filter=None: dynamo's graph calls torch-level functions and tensor
    # methods, not just aten ops.
    return GraphPickler.dumps(graph_module, Options(ops_filter=None))
  finally:
    for node, meta in kept.items():
      node.meta = meta


def _unpickle_graph(data: bytes) -> torch.fx.GraphModule:
  GraphPickler, _ = torch_internals.graph_pickler()
  # Fake values (and their symbolic sizes) are rebuilt in a mode of their
  # own; they are only read as metadata.
  graph_module = GraphPickler.loads(data,
                                    torch_internals.graph_loading_fake_mode())
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
               recorded: Sequence[record.RecordedSignature] = ()):
    self._graph_bytes = graph_bytes
    self._graph_module = (graph_module if graph_module is not None else
                          _unpickle_graph(graph_bytes))
    # Passed after the call's arguments (see [Note: Tensor attributes of a
    # captured graph]).
    self._lifted_names, self._lifted = lift_tensor_attributes(
        self._graph_module)
    self._single_output = _returns_one_value(self._graph_module)
    # From an artifact: queued on the first call, and saved again whether or
    # not they were compiled here.
    self._loaded = tuple(recorded)
    self._compiled = None
    # Held by the first call until the graph is handed to the bridge (see
    # __call__).
    self._first_call = threading.Lock()
    self._cache = None
    # A record of every signature served here, by key, in first-seen order.
    self._seen: Dict[Any, record.RecordedSignature] = {}
    # Per thread: the list observed_calls appends each call of that thread
    # to, while observed.
    self._observed = threading.local()
    self._in_background = False

  def name_source(self, source: str) -> None:
    """Names the file the loaded signatures came from, for messages."""
    self._loaded = tuple(
        dataclasses.replace(r, source=source) for r in self._loaded)

  # -- running

  def __call__(self, *args):
    # The graph is handed to the bridge once, by one thread, under the
    # bridge's lock (see [Note: Threads]); its first signature compiles on
    # the compile pool, and this call waits for it in the bridge's callable
    # with no lock held, as any call of a signature compiling does (see
    # [Note: Compiles outside the lock]).
    if self._compiled is None:
      # The bridge's hand-over takes execution_lock itself, for all but its
      # look-ahead on placeholders (see execution.extracted_once).
      with self._first_call:
        if self._compiled is None:
          self._compile_first(list(args) + self._lifted)
    with execution.execution_lock:
      cache = self._cache
      if cache is not None:
        every_arg = args + tuple(self._lifted)
        key = cache.key_of(every_arg)
        if key not in self._seen:
          self._seen[key] = record.make_record(cache.layout, every_arg)
      compiled = self._compiled
    if cache is None:
      out = compiled(*args, *self._lifted)
    else:
      # The bridge's callable of this cache takes the key computed above
      # rather than computing it again.
      out = compiled(*args, *self._lifted, key=key)
    # The bridge unwraps a single output (upstream's convention); dynamo's
    # bytecode indexes the graph's output tuple.
    if self._single_output and not isinstance(out, (tuple, list)):
      out = (out,)
    calls = getattr(self._observed, 'calls', None)
    if calls is not None:
      calls.append((args, tuple(out)))
    return out

  @contextlib.contextmanager
  def observed_calls(self) -> Iterator[List[Tuple[tuple, tuple]]]:
    """Within the block, the (graph arguments, graph outputs) of each call
    this thread makes, in order."""
    calls: List[Tuple[tuple, tuple]] = []
    self._observed.calls = calls
    try:
      yield calls
    finally:
      self._observed.calls = None

  @property
  def signature_cache(self) -> Optional[signature_cache.SignatureCache]:
    """The bridge's cache of the graph; None before the first call, when
    the bridge partitioned the graph around CPU fallback ops, or when the
    graph takes lifted tensor attributes after the call's arguments (a
    program bound to the call's arguments alone would miss them)."""
    return None if self._lifted else self._cache

  def placeholder_values(self, num_args: int) -> List[Any]:
    """The fake value dynamo recorded for each of the graph's `num_args`
    arguments, those a call passes, before the lifted tensor attributes (all
    None if the graph has another number)."""
    values = signature.placeholder_values(self._graph_module,
                                          num_args + len(self._lifted))
    return values[:num_args]

  def rebind_lifted(self, model: Any) -> int:
    """After a load: the lifted tensor attributes are the loaded model's own
    (see [Note: Tensor attributes of a captured graph]) where its tensor at
    the same path has the same dtype and shape; returns how many are not
    (they stay the artifact's copies, said in one log line)."""
    if not self._lifted:
      return 0
    live = tensors_by_path(model)
    missing = []
    for index, (name, tensor) in enumerate(zip(self._lifted_names,
                                               self._lifted)):
      found = live.get(_path_key(name))
      if (found is not None and found.dtype == tensor.dtype and
          found.shape == tensor.shape and found.device == tensor.device):
        self._lifted[index] = found
      else:
        missing.append(name)
    if missing:
      logger.warning(
          'torch_xla_patches: the loaded graph reads %s, which %s does not '
          'hold where the capture found them; it keeps the copies saved with '
          'the artifact', ', '.join(missing),
          type(model).__name__)
    return len(missing)

  def compile_in_background(self) -> None:
    """From now on, the first call compiles the graph's first signature and
    its recorded ones (index and artifact) on the compile pool, traced
    without running, and waits for its own only (serve() ready at once, see
    [Note: Ready at once] in serving.py)."""
    self._in_background = True

  def _compile_first(self, args: List[Any]) -> None:
    if self._in_background and not execution.compiling_only():
      with execution.compile_only():
        self._extract_and_queue(args)
    else:
      self._extract_and_queue(args)

  def _extract_and_queue(self, args: List[Any]) -> None:
    compiled = dynamo_bridge.extract_compiled_graph(self._graph_module, args)
    with execution.execution_lock:
      self._queue_recorded(compiled, args)
      # Last: a call that finds it set finds the cache set too.
      self._compiled = compiled

  def _queue_recorded(self, compiled: Any, args: List[Any]) -> None:
    cache = getattr(compiled, 'signature_cache', None)
    if cache is None:
      # The bridge partitioned the graph around CPU fallback ops: each XLA
      # part has its own cache; signatures are then compiled on demand.
      return
    self._cache = cache
    # [Note: Precompile on load]
    # The signatures an artifact recorded join the graph's backlog, after
    # the first call's own and those of the signature index, within the
    # same first-call budget (see [Note: Replaying recorded signatures]).
    cache.queue_recorded(self._loaded, args)

  def precompile_pending(self) -> int:
    """Compiles the backlog now; returns how many signatures it compiled."""
    if self._cache is None:
      return 0
    return self._cache.drain_backlog()

  def recorded_signatures(self) -> Tuple[record.RecordedSignature, ...]:
    """Signatures to save: those served here, then those loaded."""
    with execution.execution_lock:
      records = list(self._seen.values())
    ids = {r.record_id for r in records}
    records.extend(r for r in self._loaded if r.record_id not in ids)
    return tuple(records)

  # -- SerializableCallable

  @classmethod
  def serialize_compile_artifacts(cls, fn: 'XlaSerializableCallable') -> bytes:
    records = fn.recorded_signatures()
    kinds = fn._cache.layout.kinds if fn._cache is not None else None
    return pickle.dumps({
        'format_version':
            STATE_FORMAT_VERSION,
        'graph':
            fn._graph_bytes,
        'signatures':
            record.records_to_json(kinds, records) if records else None,
    })

  @classmethod
  def deserialize_compile_artifacts(cls,
                                    data: bytes) -> 'XlaSerializableCallable':
    state = pickle.loads(data)
    if not isinstance(
        state, dict) or state.get('format_version') != STATE_FORMAT_VERSION:
      raise ArtifactCorruptError(
          'torch_xla_patches: compiled graph format '
          f'{state.get("format_version") if isinstance(state, dict) else state!r}'
          f', expected {STATE_FORMAT_VERSION}')
    return XlaSerializableCallable(state['graph'],
                                   recorded=record.records_from_json(
                                       state.get('signatures'),
                                       source='the artifact'))


def serialize_aot(aot_fn) -> bytes:
  """Like AOTCompiledFunction.serialize, but also for functions with a
  closure.

  [Note: Closures in saved functions]
  torch 2.9 pickles the captured function's closure cells as they are, and
  cells do not pickle ("cannot pickle 'cell' object"), so a forward that
  uses a name from an enclosing function (a class defined in a function that
  imports torch) cannot be saved with torch's serialize. Here each cell is
  saved as its contents (modules by name) and made a cell again on load.
  The rest of the state is what torch's serialize writes."""
  SerializedCode = torch_internals.serialized_code()
  state = torch_internals.aot_artifacts(aot_fn).__dict__.copy()
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
    artifact.ClosurePickler(stream).dump(state)
    return stream.getvalue()


def deserialize_aot(data: bytes):
  AOTCompiledFunction, CompileArtifacts = (
      torch_internals.aot_compiled_function_types())
  SerializedCode = torch_internals.serialized_code()
  state = pickle.loads(data)
  state['bytecode'] = SerializedCode.to_code_object(state['bytecode'])
  state['original_code'] = SerializedCode.to_code_object(state['original_code'])
  deserializer, compiled_state = state['compiled_fn']
  state['compiled_fn'] = deserializer(compiled_state)
  if state['closure'] is not None:
    state['closure'] = tuple(types.CellType(v) for v in state['closure'])
  # AOTCompiledFunction rebuilds torch's guards from guards_state here.
  return AOTCompiledFunction(CompileArtifacts(**state))


def lift_tensor_attributes(
    graph_module: torch.fx.GraphModule) -> Tuple[List[str], List[torch.Tensor]]:
  """Turns the graph's XLA tensor attributes into inputs after its other
  placeholders; returns their attribute names and the tensors, in that
  order.

  [Note: Tensor attributes of a captured graph]
  dynamo's capture without AOTAutograd makes a tensor the forward reaches
  through a plain object (a transformers StaticCache's keys and values, held
  by the module) an attribute of the graph module (get_attr), the same
  tensor object, not an input. The bridge keeps a graph's constants as they
  were at its trace, and an update in place of one would be neither written
  back nor seen by the next call. Lifted to inputs, appended by the callable
  to every call's arguments, they are what the forward updates: read afresh
  on every call, written back (donated) like any updated argument, and
  restored after a trace. A graph loaded from an artifact holds copies of
  them, pickled with it: rebind_lifted puts the loaded model's own tensors
  in their place, found by the path dynamo named the attribute after.
  """
  graph = graph_module.graph
  placeholders = [node for node in graph.nodes if node.op == 'placeholder']
  last = placeholders[-1] if placeholders else None
  names, lifted = [], []
  for node in list(graph.nodes):
    if node.op != 'get_attr':
      continue
    value = graph_module
    for part in node.target.split('.'):
      value = getattr(value, part, None)
    if not (isinstance(value, torch.Tensor) and
            not isinstance(value, torch.nn.Parameter) and
            value.device.type == 'xla'):
      continue
    if last is None:
      with graph.inserting_before(next(iter(graph.nodes))):
        placeholder = graph.placeholder(f'lifted_{node.name}')
    else:
      with graph.inserting_after(last):
        placeholder = graph.placeholder(f'lifted_{node.name}')
    placeholder.meta.update(node.meta)
    node.replace_all_uses_with(placeholder)
    graph.erase_node(node)
    last = placeholder
    names.append(node.target)
    lifted.append(value)
  if lifted:
    graph_module.recompile()
  return names, lifted


def _path_key(path: str) -> str:
  """A path as dynamo's attribute names keep it: letters and digits."""
  return re.sub(r'[^0-9A-Za-z]', '', path)


def tensors_by_path(model: Any, max_depth: int = 8) -> Dict[str, torch.Tensor]:
  """The tensors reachable from `model` through attributes, lists, tuples
  and dicts, by _path_key of their source (L['module'].a.b[0].c); a key
  two tensors share is left out."""
  found: Dict[str, Optional[torch.Tensor]] = {}
  seen = set()

  def walk(value: Any, path: str, depth: int) -> None:
    if isinstance(value, torch.Tensor):
      key = _path_key(path)
      found[key] = value if key not in found else None
      return
    if depth == max_depth or id(value) in seen:
      return
    seen.add(id(value))
    if isinstance(value, torch.nn.Module):
      for name, child in value.named_children():
        walk(child, f'{path}.{name}', depth + 1)
      for name, tensor in value.named_buffers(recurse=False):
        walk(tensor, f'{path}.{name}', depth + 1)
    if isinstance(value, (list, tuple)):
      for index, item in enumerate(value):
        walk(item, f'{path}[{index}]', depth + 1)
    elif isinstance(value, dict):
      for key, item in value.items():
        if isinstance(key, str):
          walk(item, f'{path}[{key!r}]', depth + 1)
    if (hasattr(value, '__dict__') and not isinstance(value, type) and
        not isinstance(value, (list, tuple, dict))):
      for name, item in vars(value).items():
        if not name.startswith('_'):
          walk(item, f'{path}.{name}', depth + 1)

  walk(model, "L['module']", 0)
  return {key: tensor for key, tensor in found.items() if tensor is not None}


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
  torch_internals.backend_registry().setdefault(BACKEND_NAME,
                                                openxla_serializable)


def unregister_backend() -> None:
  registry = torch_internals.backend_registry()
  if registry.get(BACKEND_NAME) is openxla_serializable:
    del registry[BACKEND_NAME]
