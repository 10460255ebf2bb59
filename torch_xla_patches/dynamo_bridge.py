"""The XLA dynamo bridge with one compiled program per shape signature.

`extract_compiled_graph` -> `extract_compiled_graph_helper` ->
`extract_internal` -> `extract_graph_helper`, with `GraphInputMatcher`
building the XLA inputs of a call. The Notes state what each part
guarantees.
"""
import dataclasses
import operator
import warnings

import collections
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from typing import (Any, Callable, Deque, Dict, Hashable, Iterator, List,
                    Optional, Sequence, Tuple)
from numbers import Number

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport
from torch.fx.passes.utils.fuser_utils import topo_sort

# Defined by torch_xla's bridge; its callers (torch_xla/stablehlo.py, tests)
# find them in the bridge module, so this one offers them too.
from torch_xla._dynamo.dynamo_bridge import (NoneRemover,
                                             XLAConstructorMoverPass,
                                             get_fallback_ops)

from torch_xla._dynamo import config as upstream_config
from torch_xla_patches import config, fingerprint, native, record, signature_index
from torch_xla_patches.backlog import Backlog, StartFunction
from torch_xla_patches.signature import (ArgKind, ArgLayout, ShapeSignature,
                                         UnsupportedGraphInput,
                                         check_scalar_input, describe_arg,
                                         tuple_getter)

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as metrics
import torch_xla.runtime as xr
from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

dynamo_debug = int(os.environ.get('XLA_DYNAMO_DEBUG', '0')) == 1
ptxla_debug = int(os.environ.get('PT_XLA_DEBUG', '0')) == 1

# Counters, readable with torch_xla.debug.metrics.counter_value(name), next to
# DynamoExtractCompiledGraph (one per graph handed to the bridge),
# DynamoSyncInputExecuteTime (inputs with pending IR synced before a run) and
# the runtime's CompileTime / UncachedCompile.
# A graph's first signature is compiled when dynamo hands the graph over, so
# its first call is a hit: misses count compiles, hits count calls served.
COUNTER_HIT = 'DynamoSignatureHit'  # a call found its signature's program
COUNTER_MISS = 'DynamoSignatureMiss'  # a new signature was traced + compiled
COUNTER_RETRACE = 'DynamoEvictedRetrace'  # XLA evicted a program; re-traced
COUNTER_DROPPED = 'DynamoSignatureDropped'  # over the cap, LRU entry dropped
COUNTER_FALLBACK_PARTITION = 'DynamoCpuFallbackPartition'  # graph partitioned
# See [Note: Donating in-place updates]: an argument updated in place whose
# buffer the program takes over (counted once per traced signature), ...
COUNTER_DONATED = 'DynamoDonatedInput'
# ... one copied instead because it is a view of another tensor, or shares
# its data with another argument of the trace, ...
COUNTER_DONATION_VIEW = 'DynamoDonationSkippedView'
COUNTER_DONATION_ALIAS = 'DynamoDonationSkippedAlias'
# ... one written eagerly after the parts of a graph partitioned around CPU
# fallback ops (see [Note: Input updates in a partitioned graph]), ...
COUNTER_DONATION_FALLBACK = 'DynamoDonationSkippedFallback'
# ... one AOTAutograd's epilogue writes after the run (a graph that needs
# autograd), counted per traced signature, ...
COUNTER_DONATION_EPILOGUE = 'DynamoDonationSkippedEpilogue'
# ... and a call whose donated argument shares its data with another
# argument, or was read since its data was set: that argument is copied for
# the run (counted per call).
COUNTER_DONATION_COPIED = 'DynamoDonationCopiedAlias'
COUNTER_DONATION_COPIED_READ = 'DynamoDonationCopiedRead'
# A donating run that synced the device's pending IR first: a donated
# argument held data the caller set, which any pending computation may read
# (counted per run; a decode loop's steps after the first do not).
COUNTER_DONATION_READERS_SYNCED = 'DynamoDonationReadersSynced'
# COUNTER_PRECOMPILED and COUNTER_PRECOMPILE_SKIPPED: see backlog.py.

_EVICTED_MESSAGE = 'Failed to get computation by hash'
_PENDING_IR_MESSAGE = 'can not be a pending ir'

_increment_counter = torch_xla._XLAC._xla_increment_counter

logger = logging.getLogger('torch_xla_patches.bridge')

# [Note: Threads]
# Any number of threads may call compiled graphs, of one model or of many.
# torch_xla's lazy tensors take threads; the bridge's state of a graph does
# not on its own: the first compile of a graph (upstream's
# xla_backend_helper compiles on the first call and then deletes the graph),
# the signature cache and its LRU order, the backlog, the usage log. So every
# call of a compiled graph, from its key to its outputs (look-up, trace,
# compile, run, usage, backlog), and every precompile hold one process-wide
# reentrant lock, `execution_lock`: one device runs one program at a time
# anyway, and the host work under the lock is that of a single-threaded
# call. The lock is never taken while dynamo traces (nothing here runs under
# dynamo's compile lock), so the two cannot deadlock. Other threads build
# lazy IR without the lock (a request's inputs) at any time, and torch_xla's
# sync of every live tensor (torch_xla.sync()) races with them (measured:
# "Check failed: data()->tensor_data" reading the shape of a tensor another
# thread had just moved to the device). So nothing here syncs the device
# before a trace or drops pending IR it did not make: a trace materializes
# its own arguments only, restores those it updated (pending_ir_restored),
# and its outputs die with their references. A donating run of a
# torch.compile graph still syncs the device's pending IR when an argument
# it takes over was read (see [Note: Donating in-place updates]).
execution_lock = threading.RLock()


class GraphInputMatcher:
  """Builds the input list of a compiled XLA graph for one call.

  The XLA graph's parameters are device-data nodes found at trace time. Each
  is either a graph argument (taken from the current call), the RNG seed
  (drawn fresh per call, as torch_xla.sync() does), or a true constant of the
  graph (kept). Trace-time argument tensors are never kept, see
  [Note: What an entry keeps alive]. The constructor's arguments are part of
  the bridge's interface: tests and callers build matchers directly.

  Args:
    tensor_id_to_arg_idx: maps a tensor id to the position of the graph
      argument holding it.
    graph_input_tensor_ids: tensor id of each XLA graph input.
    graph_input_xla_values: traced value of each XLA graph input.
    xla_args_tensor_id: unused: the ids of the arguments, which
      `tensor_id_to_arg_idx` already holds.
  """

  def __init__(self,
               tensor_id_to_arg_idx: Dict[int, int],
               graph_input_tensor_ids: Sequence[int],
               graph_input_xla_values: Sequence[torch.Tensor],
               xla_args_tensor_id: Any = None):
    del xla_args_tensor_id
    assert len(graph_input_tensor_ids) == len(graph_input_xla_values)
    seed_id = torch_xla._XLAC._get_seed_info_id()
    self.arg_idxs = tuple(
        tensor_id_to_arg_idx.get(tensor_id)
        for tensor_id in graph_input_tensor_ids)
    # Arguments come from each call; only constants and the seed slot's
    # traced value (for its device) are kept.
    self.graph_input_xla_values = [
        None if arg_idx is not None else value
        for arg_idx, value in zip(self.arg_idxs, graph_input_xla_values)
    ]
    self._arg_getter = tuple_getter(
        tuple(i for i in self.arg_idxs if i is not None))
    # (slot, constant or None for the seed), in ascending slot order:
    # inserting in that order puts each value at its final slot.
    self._fixed_slots = tuple(
        (slot, None if tensor_id == seed_id else value)
        for slot, (tensor_id, arg_idx, value) in enumerate(
            zip(graph_input_tensor_ids, self.arg_idxs, graph_input_xla_values))
        if arg_idx is None)
    self._seed_device = next(
        (str(value.device)
         for tensor_id, value in zip(graph_input_tensor_ids,
                                     graph_input_xla_values)
         if tensor_id == seed_id), None)

  @property
  def draws_seed(self) -> bool:
    """Whether a call draws a fresh RNG seed into one of the inputs."""
    return any(value is None for _, value in self._fixed_slots)

  def _next_seed(self) -> torch.Tensor:
    seed = torch_xla._XLAC._get_base_seed_as_tensor(self._seed_device)
    # Advance the runtime seed the way torch_xla.sync() does, so random ops
    # differ between calls. Reading it as a tensor avoids a device transfer.
    xm.set_rng_state((1012031 + torch_xla._XLAC._xla_get_rng_seed() * 7012063) %
                     18446744073709551615, self._seed_device)
    return seed

  def __call__(self, args: Sequence[Any]) -> Sequence[torch.Tensor]:
    if not self._fixed_slots:
      # The common case: every graph input is an argument.
      return self._arg_getter(args)
    inputs = list(self._arg_getter(args))
    for slot, value in self._fixed_slots:
      inputs.insert(slot, self._next_seed() if value is None else value)
    return inputs


@dataclasses.dataclass(frozen=True)
class OutputPlan:
  """How the results of one XLA run become the graph's outputs.

  `_run_cached_graph` returns one result per distinct output tensor that is
  computed by the graph; outputs that are device data (an unchanged input, a
  constant), duplicates, Python numbers (SymInt outputs of a dynamic graph) and
  Nones are restored here.
  """
  # Number of results `_run_cached_graph` returns (0: the graph is not run).
  num_results: int
  # (argument position, result index): arguments the graph updates in place.
  inplace_updates: Tuple[Tuple[int, int], ...]
  # Argument positions whose tensors are returned as outputs unchanged.
  returned_args: Tuple[int, ...]
  # Constant outputs: numbers, None, and true graph constants.
  constants: Tuple[Any, ...]
  # For each output, an index into results + returned args + constants.
  sources: Tuple[int, ...]

  def __post_init__(self):
    identity = self.sources == tuple(range(self.num_results))
    object.__setattr__(self, '_identity', identity)
    object.__setattr__(self, '_returned_arg_getter',
                       tuple_getter(self.returned_args))
    object.__setattr__(self, '_source_getter', tuple_getter(self.sources))

  def assemble(self, results: List[torch.Tensor], args: Sequence[Any]) -> Any:
    outputs = self.outputs(results, args)
    # The bridge's calling convention: a single output is returned bare.
    return outputs[0] if len(outputs) == 1 else outputs

  def outputs(self, results: List[torch.Tensor],
              args: Sequence[Any]) -> Sequence[Any]:
    """Every graph output, in order (the in-place updates are the caller's:
    see apply_updates)."""
    if self._identity:
      return results
    pool = list(results)
    pool.extend(self._returned_arg_getter(args))
    pool.extend(self.constants)
    return list(self._source_getter(pool))

  @property
  def outputs_are_results(self) -> bool:
    """Whether the graph's outputs are the run's results, in order."""
    return self._identity and not self.inplace_updates


@dataclasses.dataclass(frozen=True)
class CompiledGraphEntry:
  """Everything needed to run one shape signature of a graph.

  [Note: What an entry keeps alive]
  An entry holds no trace-time argument tensor: only the graph hash, index
  maps, and the device data of true graph constants (tensors the graph reads
  that are not arguments). An argument held here would pin a copy of its
  signature's inputs in device memory for as long as the graph lives.
  """
  # Key of the compiled program in XLA's computation cache.
  graph_hash: bytes
  graph_input_matcher: GraphInputMatcher
  output_plan: OutputPlan
  # Named form of this entry's signature, for explanations and persistence.
  signature: ShapeSignature
  # Argument positions whose buffers the program takes over (see [Note:
  # Donating in-place updates]).
  donated_positions: Tuple[int, ...] = ()

  @functools.cached_property
  def input_positions(self) -> Tuple[int, ...]:
    """The argument positions the program reads, each once."""
    return tuple(
        sorted({
            position for position in self.graph_input_matcher.arg_idxs
            if position is not None
        }))


@contextlib.contextmanager
def pending_ir_restored(tensors: Sequence[torch.Tensor],
                        clear_donor_marks: bool = False) -> Iterator[None]:
  """Runs a trace of the FX graph on real arguments and leaves them as they
  were, with no pending IR behind, whether the trace returns or raises (see
  ArgumentsRestore); yields the restore, for a trace to run again."""
  restore = ArgumentsRestore.of(tensors, clear_donor_marks)
  try:
    yield restore
  finally:
    restore()
    restore.release()


@dataclasses.dataclass(frozen=True)
class ArgumentsRestore:
  """Puts the arguments of a trace back as they were before it.

  Tracing runs the FX graph on the real arguments, so in-place updates in the
  graph give them pending IR, and the trace's reads (the clones' too) give
  them an IR node of their device data. Lazy clones (no device copy happens
  unless used) are copied back into the updated ones and into those the
  trace only read (but views, where a copy writes the base), which then
  hold the device data they had, with no IR: a read by the bridge's own
  trace is no read by the caller (see [Note: Donating in-place updates]). The clones are let go by release(). What was
  read before the trace stays known as read (see _maybe_read). The pending IR of the device is not cleared: other threads'
  tensors may be pending (see [Note: Threads]). With `clear_donor_marks`, a
  donor mark on the data a tensor gets back is cleared: the bridge's own,
  of a donating trace; a graph that marks its donors itself keeps its
  marks, as upstream's bridge leaves them.
  """
  tensors: List[torch.Tensor]
  clones: List[torch.Tensor]
  # Per tensor: whether something may hold its buffer by having read it.
  read: List[bool]
  # Per tensor: whether it had IR before the trace.
  had_ir: List[bool]
  clear_donor_marks: bool

  @classmethod
  def of(cls, tensors: Sequence[torch.Tensor],
         clear_donor_marks: bool) -> 'ArgumentsRestore':
    tensors = list(tensors)
    # Before the clones: a clone reads its tensor.
    read = [_maybe_read(t) for t in tensors]
    had_ir = [_read_since_set(t) for t in tensors]
    return cls(tensors=tensors,
               clones=[torch.clone(t) for t in tensors],
               read=read,
               had_ir=had_ir,
               clear_donor_marks=clear_donor_marks)

  def __call__(self) -> None:
    """Copies each clone back into its tensor if the tensor has pending IR,
    or IR the trace left. The copy leaves the tensor's IR a read of its old
    device data; the sync of those tensors alone makes them that device
    data again, and runs nothing. The data of a tensor `read` before the
    trace is noted as read: whatever read it may hold its buffer, which a
    donating run must not take."""
    flags = torch_xla._XLAC._check_tensor_need_materialization(self.tensors)
    updated = [
        (t, c, was_read)
        for t, c, flag, was_read, had_ir in zip(self.tensors, self.clones,
                                                flags, self.read, self.had_ir)
        if flag or (not had_ir and not t._is_view() and _read_since_set(t))
    ]
    for tensor, clone, _ in updated:
      tensor.copy_(clone)
      # A donor mark of the bridge's trace would let the sync below hand the
      # buffer over; a second trace marks again.
      if self.clear_donor_marks:
        _clear_donor_mark(tensor)
    _sync_alone([tensor for tensor, _, _ in updated])
    for tensor, _, was_read in updated:
      if was_read:
        _note_data(tensor, given=False)

  def release(self) -> None:
    """Lets the clones go."""
    del self.clones[:]


def _data_id(tensor: torch.Tensor) -> str:
  return torch_xla._XLAC._unique_id_for_ir_and_data(tensor)


def _flatten_outputs(out: Any) -> List[Any]:
  if isinstance(out, (tuple, list)):
    return list(out)
  return [out]


def _plan_outputs(
    args: Sequence[Any], tensor_positions: Tuple[int, ...], outputs: List[Any],
    position_of_arg_data: Dict[int,
                               int]) -> Tuple[List[torch.Tensor], OutputPlan]:
  """The tensors the XLA graph computes, and how its results map back.

  [Note: Graph outputs]
  The XLA graph computes the in-place-updated arguments first, then the
  tensor outputs. `_run_cached_graph` returns one result per distinct (by
  IR/data identity) tensor among them that has pending IR; device-data
  tensors (an unchanged argument, a constant) are not results.
  """
  updated_flags = torch_xla._XLAC._check_tensor_need_materialization(
      [args[i] for i in tensor_positions])
  updated_positions = [
      pos for pos, flag in zip(tensor_positions, updated_flags) if flag
  ]
  graph_tensors = [args[pos] for pos in updated_positions]
  graph_tensors.extend(o for o in outputs if isinstance(o, torch.Tensor))
  computed_flags = torch_xla._XLAC._check_tensor_need_materialization(
      graph_tensors)
  result_index_of_data: Dict[int, int] = {}
  for tensor, computed in zip(graph_tensors, computed_flags):
    if computed:
      result_index_of_data.setdefault(_data_id(tensor),
                                      len(result_index_of_data))
  position_of_arg_object = {id(args[i]): i for i in tensor_positions}

  returned_args: List[int] = []
  constants: List[Any] = []
  kinds: List[Tuple[str, int]] = []  # ('result' | 'arg' | 'const', index)
  for index, out in enumerate(outputs):
    if isinstance(out, torch.Tensor):
      data_id = _data_id(out)
      if data_id in result_index_of_data:
        kinds.append(('result', result_index_of_data[data_id]))
        continue
      position = position_of_arg_object.get(id(out),
                                            position_of_arg_data.get(data_id))
      if position is not None:
        kinds.append(('arg', len(returned_args)))
        returned_args.append(position)
        continue
    elif out is not None and not isinstance(out, Number):
      raise UnsupportedGraphInput(
          f'graph output {index} has type {type(out).__name__}; the XLA '
          'dynamo bridge returns tensors, numbers and None only.')
    kinds.append(('const', len(constants)))
    constants.append(out)
  num_results = len(result_index_of_data)
  offsets = {
      'result': 0,
      'arg': num_results,
      'const': num_results + len(returned_args)
  }
  plan = OutputPlan(num_results=num_results,
                    inplace_updates=tuple(
                        (pos, result_index_of_data[_data_id(args[pos])])
                        for pos in updated_positions),
                    returned_args=tuple(returned_args),
                    constants=tuple(constants),
                    sources=tuple(offsets[kind] + i for kind, i in kinds))
  return graph_tensors, plan


def _positions_by_handle(args: Sequence[Any],
                         positions: Sequence[int]) -> Dict[int, int]:
  """Device data handle -> position, of the arguments at `positions` that
  hold device data (see [Note: Matching graph inputs])."""
  # A run in flight leaves its results a placeholder without a buffer yet.
  xm.wait_device_ops()
  tensors = [args[i] for i in positions]
  pending = torch_xla._XLAC._check_tensor_need_materialization(tensors)
  held = [(position, tensor)
          for position, tensor, flag in zip(positions, tensors, pending)
          if not flag]
  handles = torch_xla._XLAC._get_tensors_handle([t for _, t in held])
  return {handle: position for (position, _), handle in zip(held, handles)}


def _match_graph_inputs(
    graph_tensors: List[torch.Tensor], tensor_id_to_position: Dict[int, int],
    position_of_arg_data: Dict[int, int],
    position_of_handle: Dict[int, int]) -> GraphInputMatcher:
  """Finds where each device-data input of the XLA graph comes from.

  [Note: Matching graph inputs]
  Each XLA graph input is a device-data node that names the tensor its data
  was made for. That is the argument's own id, except under SPMD, where a
  sync gives a tensor's device data a new one (made for a tensor of the
  sharding code): matched by id alone, such an argument would be kept as a
  constant of the program, and every later call would compute with the
  trace's value. So an input whose id names no argument is matched by its
  data: by data id, which finds an alias made before the call, then by the
  handle of the device buffer the arguments held before the trace. Only an
  input that neither finds is a constant (a tensor the graph made itself,
  the RNG seed)."""
  # Wait for the sync before tracing to finish before reading device data.
  xm.wait_device_ops()
  input_ids, input_values = torch_xla._XLAC._get_tensors_xla_device_data_node(
      graph_tensors)
  seed_id = torch_xla._XLAC._get_seed_info_id()
  id_to_position = dict(tensor_id_to_position)
  unmatched = []
  for tensor_id, value in zip(input_ids, input_values):
    if tensor_id not in id_to_position and tensor_id != seed_id:
      position = position_of_arg_data.get(_data_id(value))
      if position is not None:
        id_to_position[tensor_id] = position
      else:
        unmatched.append((tensor_id, value))
  if unmatched and position_of_handle:
    handles = torch_xla._XLAC._get_tensors_handle([v for _, v in unmatched])
    for (tensor_id, _), handle in zip(unmatched, handles):
      position = position_of_handle.get(handle)
      if position is not None:
        id_to_position[tensor_id] = position
  return GraphInputMatcher(id_to_position, input_ids, input_values)


def compile_graph(graph_tensors: List[torch.Tensor]) -> None:
  """Compiles the XLA graph whose outputs are `graph_tensors` (their pending
  IR) into XLA's computation cache, without running it. Every compile of the
  bridge goes through here, on the main thread or on a compile worker."""
  torch_xla._XLAC._xla_warm_up_cache(graph_tensors, [])


@dataclasses.dataclass(frozen=True)
class TracedGraph:
  """One signature traced and hashed, not compiled yet."""
  entry: CompiledGraphEntry
  # The tensors whose pending IR is the XLA graph to compile; empty when the
  # graph computes nothing (see OutputPlan.num_results).
  graph_tensors: List[torch.Tensor]


def _trace_graph(xla_model: torch.fx.GraphModule, args: Sequence[Any],
                 layout: ArgLayout) -> TracedGraph:
  """Lazily traces `xla_model` on `args` and hashes the XLA graph. The
  arguments keep whatever pending IR the trace gave them: callers restore
  them (see pending_ir_restored)."""
  tensor_positions = layout.tensor_positions
  tensor_id_to_position = {
      torch_xla._XLAC._xla_get_tensor_id(args[i]): i for i in tensor_positions
  }
  position_of_handle = _positions_by_handle(args, tensor_positions)
  if dynamo_debug:
    print(f'Graph Module:\n{xla_model.code}')
  outputs = _flatten_outputs(xla_model(*args))
  # IR/data identity of each argument after the trace, for aliases among
  # outputs and graph inputs.
  position_of_arg_data = {_data_id(args[i]): i for i in tensor_positions}
  graph_tensors, output_plan = _plan_outputs(args, tensor_positions, outputs,
                                             position_of_arg_data)
  graph_hash = b''
  matcher = GraphInputMatcher({}, (), ())
  if output_plan.num_results:
    matcher = _match_graph_inputs(graph_tensors, tensor_id_to_position,
                                  position_of_arg_data, position_of_handle)
    if dynamo_debug:
      print(f'Number of HLO inputs: {len(matcher.arg_idxs)}, outputs: '
            f'{output_plan.num_results}')
      print(torch_xla._XLAC._get_xla_tensors_text(graph_tensors))
    with alias_with_buffer_donor_config():
      graph_hash = torch_xla._XLAC._get_graph_hash(graph_tensors)
  else:
    graph_tensors = []
  entry = CompiledGraphEntry(graph_hash=graph_hash,
                             graph_input_matcher=matcher,
                             output_plan=output_plan,
                             signature=layout.signature_of(args))
  return TracedGraph(entry=entry, graph_tensors=graph_tensors)


# [Note: Donating in-place updates]
# A graph that updates an argument in place (a KV cache written with
# index_copy_, a buffer's running statistics) compiles, without aliasing, to
# a program that writes the whole updated tensor into a new buffer on every
# call: a copy of the argument per call, and two of it alive at the peak.
# torch_xla aliases a program input to its output when the input's device
# data is marked as a buffer donor while the graph is traced and the compile
# runs under alias_with_buffer_donor_config. So a signature whose trace
# updates arguments is traced a second time, from the restored arguments,
# with each updatable argument marked (config.donate_inplace_updates); the
# donation is part of the graph hash, so a donating program and a copying
# one never share an entry. Donation hands the argument's buffer to the
# program, which deletes it, so it is used only where nothing else can still
# read that buffer:
#   * not for an argument that is a view of another tensor, nor for one
#     whose data another argument of the trace shares (one tensor passed
#     twice, an alias made before the call): copied, counted per reason;
#   * at each call of a donating program, a donated argument that shares its
#     data with another argument of that call is replaced for the run by a
#     private copy (counted), and the write-back still goes to the caller's
#     tensor;
#   * anything else that holds the buffer got it by building on the
#     argument: pending IR that reads it (`cache * 2`), a view, a tensor that
#     took it with `copy_` (torch_xla shares the device data, it copies
#     nothing). Building on a tensor gives it an IR node of its device data,
#     which it keeps until its data is set again, and a tensor's data id
#     names that node while it has one. So at each donating call, a donated
#     argument is, by what is known of its buffer:
#       - given: it holds, without IR, the data a run gave it (take_result,
#         noted by the tensor's unique id with its data id), so no one else
#         holds that buffer: donated as is, with no look at the rest of the
#         device. A decode loop runs so at every step. Under SPMD a run's
#         results come with an IR node of their own (torch_xla's, for the
#         sharding), which reads then build on without changing the data
#         id: given data that has IR is unknown (below). There a read, copy_
#         included, is pending IR until a sync computes it into a buffer of
#         its own, so the sync below leaves no one else the buffer;
#       - read: it has IR, or its data was noted as read before a sync
#         dropped its IR (a tensor moved to the device with `to` holds its
#         data in an IR node until a sync; the sync before a trace and the
#         restore after it drop the IR of the arguments): replaced for the
#         run by a private copy (counted), so that a reading one step costs
#         one copy, and the buffer stays with whatever read it;
#       - unknown (data the caller set: made on the device and synced,
#         written in place and synced): the device's pending IR, which may
#         read it, is synced first. An argument with pending IR of its own is
#         computed first, into a buffer of its own.
#     What stays unseen: a tensor that took another's data with `copy_` and
#     was then synced holds that data without IR (torch_xla shares a device
#     data node's data on a copy_ within the device); donated, it deletes
#     the buffer the other still holds.
#   * The argument takes its updated data from the run's result
#     (take_result) as functionalization's in-place ops do, which leaves it
#     given.
#   * Under torch.compile, an inference graph that AOTAutograd compiles
#     with keep_inference_input_mutations (the openxla backend as apply()
#     sets it up) keeps its updates, as dynamo's graph under serve() does.
#     A graph that needs autograd leaves them to AOTAutograd's epilogue,
#     which writes them with `copy_` after the run: those arguments are
#     never donated (counted as COUNTER_DONATION_EPILOGUE). The `copy_`
#     leaves an argument read at every call, so donating it would cost a
#     sync of the device's pending IR before every run, and the XLA
#     compiles of whatever that sync computes: a training step's forward
#     would be slower than without donation, for buffers (BatchNorm's
#     running statistics) a few values wide.
#   * A graph that marks its own donors (torch.ops.xla.dynamo_set_buffer_
#     donor_, upstream's manual donation) is compiled as written.
# A view or alias of a donated argument made by torch_xla (`cache[:16]`,
# `cache.detach()`) follows the argument's new data, as after any run.

# The FX graph's meta key under which record_mutated_inputs leaves
# AOTAutograd's mutated inputs for the bridge.
MUTATED_INPUTS_META = 'torch_xla_patches_mutated_inputs'


def record_mutated_inputs(helper: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps torch's `xla_backend_helper` (what the openxla backends call with
  each graph AOTAutograd compiles) so that the graph carries the positions
  of the inputs AOTAutograd's epilogue updates from its first outputs,
  which are never donated (see [Note: Donating in-place updates]): the
  bridge counts them. The callable it returns, which
  compiles on its first call, holds execution_lock (see [Note: Threads])."""

  def xla_backend_helper(model, fake_tensor_inputs, boxed=False):
    mutated = aot_autograd_mutated_inputs()
    if mutated and _outputs_match_inputs(model, mutated):
      model.meta[MUTATED_INPUTS_META] = mutated
    return holding_execution_lock(helper(model, fake_tensor_inputs,
                                         boxed=boxed))

  return xla_backend_helper


def holding_execution_lock(compiled: Callable[..., Any]) -> Callable[..., Any]:
  """`compiled`, called under execution_lock (see [Note: Threads]); a boxed
  function stays boxed."""

  def locked(*args):
    with execution_lock:
      return compiled(*args)

  if getattr(compiled, '_boxed_call', False):
    locked._boxed_call = True
  return locked


def aot_autograd_mutated_inputs() -> Tuple[int, ...]:
  """While AOTAutograd compiles a forward or inference graph: the positions
  of the graph's inputs whose data its epilogue updates from the graph's
  first outputs, in output order (output k into input
  mutated_inp_runtime_indices[k]). () outside such a compile, or where a
  metadata-only mutation (a resize, a transpose_) is among them."""
  context = torch._guards.TracingContext.try_get()
  metadata = getattr(context, 'fw_metadata', None)
  if metadata is None:
    return ()
  # A training graph's backward is compiled under its forward's context,
  # metadata included: only a forward or inference graph has those outputs.
  names = getattr(context, 'aot_graph_name', None) or []
  if not any(name.endswith(('_forward', '_inference')) for name in names):
    return ()
  indices = tuple(metadata.mutated_inp_runtime_indices)
  if not all(metadata.input_info[i].mutates_data for i in indices):
    return ()
  return indices


def _outputs_match_inputs(graph_module: torch.fx.GraphModule,
                          mutated: Tuple[int, ...]) -> bool:
  """Whether output k of the graph has the dtype and rank of input
  mutated[k], for each k: AOTAutograd's order, checked."""
  inputs = [
      node.meta.get('val')
      for node in graph_module.graph.nodes
      if node.op == 'placeholder'
  ]
  outputs = next((
      node.args[0] for node in graph_module.graph.nodes if node.op == 'output'),
                 ())
  if not isinstance(outputs, (tuple, list)) or len(outputs) < len(mutated):
    return False
  for output, position in zip(outputs, mutated):
    value = output.meta.get('val') if isinstance(output,
                                                 torch.fx.Node) else None
    source = inputs[position] if position < len(inputs) else None
    if not (isinstance(value, torch.Tensor) and
            isinstance(source, torch.Tensor) and value.dtype == source.dtype and
            value.dim() == source.dim()):
      return False
  return True


def _donatable_positions(args: Sequence[Any], positions: Sequence[int],
                         layout: ArgLayout) -> Tuple[int, ...]:
  """The positions among `positions` (updated arguments) that may be
  donated (see [Note: Donating in-place updates]); counts the others by
  reason."""
  positions_of_data: Dict[int, List[int]] = collections.defaultdict(list)
  for position in layout.tensor_positions:
    positions_of_data[_data_id(args[position])].append(position)
  donated = []
  for position in positions:
    tensor = args[position]
    if not isinstance(tensor, torch.Tensor):
      continue
    if tensor._is_view():
      _increment_counter(COUNTER_DONATION_VIEW, 1)
    elif len(positions_of_data[_data_id(tensor)]) > 1:
      _increment_counter(COUNTER_DONATION_ALIAS, 1)
    else:
      donated.append(position)
  return tuple(donated)


def _count_epilogue_updates(xla_model: torch.fx.GraphModule) -> None:
  """Counts, per traced signature, the inputs AOTAutograd's epilogue updates
  (see record_mutated_inputs): never donated (see [Note: Donating in-place
  updates])."""
  updated = xla_model.meta.get(MUTATED_INPUTS_META, ())
  if updated and config.donate_inplace_updates:
    _increment_counter(COUNTER_DONATION_EPILOGUE, len(updated))


def _sets_own_donors(xla_model: torch.fx.GraphModule) -> bool:
  """Whether the graph marks buffer donors itself
  (torch.ops.xla.dynamo_set_buffer_donor_): it is compiled as written."""
  return any(node.op == 'call_function' and
             'dynamo_set_buffer_donor_' in str(node.target)
             for node in xla_model.graph.nodes)


def _trace_donating(xla_model: torch.fx.GraphModule, args: Sequence[Any],
                    layout: ArgLayout, restore: Callable[[], None],
                    traced: TracedGraph) -> TracedGraph:
  """`traced`, a trace of `xla_model` on `args`, with donated buffers (see
  [Note: Donating in-place updates]): where the graph updates arguments
  itself, they are marked as donors and traced again from the arguments
  `restore` puts back."""
  updated = [
      position for position, _ in traced.entry.output_plan.inplace_updates
  ]
  if (not config.donate_inplace_updates or not updated or
      _sets_own_donors(xla_model)):
    return traced
  donated = _donatable_positions(args, updated, layout)
  if not donated:
    return traced
  del traced
  restore()
  for position in donated:
    torch_xla._XLAC._set_buffer_donation(args[position], True)
  traced = _trace_graph(xla_model, args, layout)
  # An argument the graph writes without reading it (module state set with
  # `copy_` from another argument) is no input of the program: there is no
  # buffer to take over, and its result is a buffer of its own.
  inputs = set(traced.entry.graph_input_matcher.arg_idxs)
  donated = tuple(position for position in donated if position in inputs)
  if not donated:
    return traced
  _increment_counter(COUNTER_DONATED, len(donated))
  return dataclasses.replace(traced,
                             entry=dataclasses.replace(
                                 traced.entry, donated_positions=donated))


def _clear_donor_mark(tensor: torch.Tensor) -> None:
  """Clears a donor mark the bridge's trace left on `tensor`'s data (only
  one that is there: torch_xla counts every call that sets a mark, as
  XlaSetBufferDonation)."""
  if torch_xla._XLAC._get_buffer_donation(tensor):
    torch_xla._XLAC._set_buffer_donation(tensor, False)


def _sync_pending_readers() -> None:
  """Syncs the pending IR of the device: it may read a buffer a run takes
  over (see [Note: Donating in-place updates])."""
  _increment_counter(COUNTER_DONATION_READERS_SYNCED, 1)
  torch_xla._XLAC._xla_sync_live_tensors(_device_name(), [], True)


@functools.lru_cache(maxsize=None)
def _device_name() -> str:
  """The process's XLA device, by name (one per process under PJRT; asking
  torch_xla costs about 8 us per donating run)."""
  return str(torch_xla.device())


def _read_since_set(tensor: torch.Tensor) -> bool:
  """Whether torch_xla built IR on `tensor` since its device data was set
  (see [Note: Donating in-place updates]); False for a tensor off the XLA
  device."""
  return tensor.device.type == 'xla' and _was_read(_data_id(tensor))


def _was_read(data_id: str) -> bool:
  # torch_xla names a tensor by its IR node and output index while it has
  # one ("<node>, <index>"), else by its device data.
  return ',' in data_id


# What the bridge knows of the device data a lazy tensor holds without IR
# (see [Note: Donating in-place updates]), by the tensor's unique id (never
# reused, unlike a data id) -> (its data id then, whether given): given for
# data a run gave a donated argument (take_result), which no one else can
# hold; not given for data of a tensor that was read before a sync dropped
# its IR (the sync before a trace, the restore after it), which a reader may
# hold. Oldest first; bounded, as a tensor may be dropped without another
# run. Guarded by execution_lock.
_known_data: Dict[int, Tuple[str, bool]] = {}
_KNOWN_DATA_LIMIT = 4096


def _note_data(tensor: torch.Tensor, given: bool) -> None:
  key = torch_xla._XLAC._xla_get_tensor_id(tensor)
  _known_data[key] = (_data_id(tensor), given)
  if len(_known_data) > _KNOWN_DATA_LIMIT:
    del _known_data[next(iter(_known_data))]


def _maybe_read(tensor: torch.Tensor) -> bool:
  """Whether something may hold `tensor`'s buffer by having read it: it has
  IR, or its data was noted as read (see _known_data)."""
  return tensor.device.type == 'xla' and _given_data(
      tensor, _data_id(tensor), forget=False) is False


def _given_data(tensor: torch.Tensor,
                data_id: str,
                forget: bool = True) -> Optional[bool]:
  """True if `tensor` (whose _data_id is `data_id`) holds data a run gave it
  and nothing read since, False if its data may be read elsewhere, None if
  unknown: data the caller set, or data a run gave that came in an IR node
  of its own (under SPMD), which reads leave no trace on. Forgets the
  tensor's entry unless told not to: the run about to take its buffer over
  gives it new data."""
  key = torch_xla._XLAC._xla_get_tensor_id(tensor)
  known = _known_data.pop(key, None) if forget else _known_data.get(key)
  if known is not None and known[0] == data_id:
    if not known[1]:
      return False
    return None if _was_read(data_id) else True
  return False if _was_read(data_id) else None


def _read_donations(tensors: List[torch.Tensor], data_ids: Optional[List[str]],
                    copy_if_read: List[bool]) -> List[int]:
  """Readies the buffers a run is about to take over, of `tensors` (whose
  _data_id are `data_ids`, or None to read them here) (see [Note: Donating
  in-place updates]): the indices of those read since their data was set,
  which the run takes a private copy of where `copy_if_read` says so. The
  device's pending IR is synced first if any other holds data the caller
  set, or was read where no copy is taken. The native module decides where
  it is loaded; its decision is this loop's."""
  helpers = native.loaded()
  if helpers is not None:
    read, sync_readers = helpers.read_donations(tensors, data_ids, copy_if_read,
                                                _known_data)
  else:
    read = []
    sync_readers = False
    for index, tensor in enumerate(tensors):
      data_id = _data_id(tensor) if data_ids is None else data_ids[index]
      given = _given_data(tensor, data_id)
      if given:
        continue
      if given is False and copy_if_read[index]:
        read.append(index)
      else:
        sync_readers = True
  if sync_readers:
    _sync_pending_readers()
  return read


def _private_copy(tensor: torch.Tensor) -> torch.Tensor:
  """A copy of `tensor` in a buffer of its own, for a donating run (see
  [Note: Donating in-place updates]). A tensor read since its data was set
  (it has IR) is copied on the device, as the program without donation
  would copy it at every call: a lazy clone reads the same device data
  until a sync computes it. Any other (data noted as read before a sync
  dropped its IR, as for a tensor just moved with `to`; an alias of
  another argument) goes through the host, which compiles nothing: XLA
  compiles a clone per shape, more programs than the calls compile without
  donation. Under SPMD the copy stays on the device, sharded as the tensor
  is."""
  if not _was_read(_data_id(tensor)) and not xr.is_spmd():
    copy = tensor.cpu().to(tensor.device)
  else:
    copy = torch.clone(tensor)
  _sync_alone([copy])
  return copy


def prepare_donating_run(entry: CompiledGraphEntry,
                         args: Sequence[Any]) -> Sequence[Any]:
  """The arguments to run a donating entry with (see [Note: Donating
  in-place updates]): a donated argument whose buffer something else may
  hold is replaced by a private copy."""
  data_ids = {
      position: _data_id(args[position]) for position in entry.input_positions
  }
  readers = collections.Counter(data_ids.values())
  copied = {
      position: COUNTER_DONATION_COPIED
      for position in entry.donated_positions
      if readers[data_ids[position]] > 1
  }
  taken = [
      position for position in entry.donated_positions if position not in copied
  ]
  for index in _read_donations([args[position] for position in taken],
                               [data_ids[position] for position in taken],
                               [True] * len(taken)):
    copied[taken[index]] = COUNTER_DONATION_COPIED_READ
  if not copied:
    return args
  run_args = list(args)
  for position, counter in copied.items():
    _increment_counter(counter, 1)
    run_args[position] = _private_copy(args[position])
  return run_args


def take_result(tensor: torch.Tensor,
                result: torch.Tensor,
                drop_update_log: bool = True) -> None:
  """`tensor`, a donated argument, takes the run's updated `result` as its
  data, as an in-place op of torch's functionalization does, without the IR
  a `copy_` leaves on it: the next run can donate it as is (see [Note:
  Donating in-place updates]).

  [Note: Taking a result]
  Functionalization keeps a tensor's data in an inner tensor and its updates
  in a log on the storage it shares with its views and aliases. Replacing
  the inner tensor by the result's and committing the update to the log is
  what makes views and aliases follow (each replays the log when next used).
  A sync of the tensor then only drops the log (the tensor already holds the
  result). That sync is the dearest of the three steps, and the log is
  dropped by any later sync as well, so a caller that takes results over
  and over may skip it as long as it syncs every so often: the log then
  holds at most that many entries, each a few hundred bytes of host memory
  (the buffers were donated)."""
  if not torch._is_functional_tensor(tensor):
    # XLA_DISABLE_FUNCTIONALIZATION=1: a lazy tensor of its own.
    tensor.copy_(result)
    return
  torch._functionalize_replace(tensor, torch._from_functional_tensor(result))
  torch._functionalize_commit_update(tensor)
  if drop_update_log:
    torch._functionalize_sync(tensor)
  _note_data(result, given=True)


def take_results(tensors: List[torch.Tensor], results: List[torch.Tensor],
                 drop_update_log: bool) -> None:
  """take_result of each pair, in one native call where the native module
  is loaded."""
  helpers = native.loaded()
  if helpers is not None:
    helpers.take_results(tensors, results, drop_update_log, _known_data,
                         _KNOWN_DATA_LIMIT)
    return
  for tensor, result in zip(tensors, results):
    take_result(tensor, result, drop_update_log)


def apply_updates(entry: CompiledGraphEntry, results: List[torch.Tensor],
                  args: Sequence[Any]) -> None:
  """The arguments the graph updates in place take their results."""
  donated = entry.donated_positions
  takers, taken = [], []
  for position, result_index in entry.output_plan.inplace_updates:
    if position in donated:
      takers.append(args[position])
      taken.append(results[result_index])
    else:
      args[position].copy_(results[result_index])
  if takers:
    take_results(takers, taken, drop_update_log=True)


def extract_graph_helper(xla_model: torch.fx.GraphModule, args: Sequence[Any],
                         layout: ArgLayout) -> CompiledGraphEntry:
  """Lazily traces `xla_model` on `args`, compiles it, returns its entry."""
  tensors = [args[i] for i in layout.tensor_positions]
  # The arguments enter the graph as device data (see [Note: Threads]: not a
  # sync of every live tensor, which races with other threads' tensors).
  _sync_alone_noting_reads(tensors)
  # A trace or compile that raises must still leave the arguments as they
  # were and no pending IR behind: replaying a recorded signature skips
  # such a failure and the caller's call goes on.
  with pending_ir_restored(
      tensors, clear_donor_marks=not _sets_own_donors(xla_model)) as restore:
    _count_epilogue_updates(xla_model)
    traced = _trace_donating(xla_model, args, layout, restore,
                             _trace_graph(xla_model, args, layout))
    if traced.graph_tensors:
      with alias_with_buffer_donor_config():
        compile_graph(traced.graph_tensors)
  return traced.entry


def _compile_on_worker(graph_tensors: List[torch.Tensor]) -> None:
  try:
    with alias_with_buffer_donor_config():
      compile_graph(graph_tensors)
  finally:
    # A raised exception keeps this frame in its traceback: let the tensors,
    # and the pending IR of the graph, go now.
    del graph_tensors[:]


class CompileWindow:
  """Compiles in flight on worker threads while the main thread traces the
  next signatures of one graph.

  [Note: Parallel compiles]
  Replaying recorded signatures (see [Note: Replaying recorded signatures])
  with config.compile_workers > 1 traces each signature on the calling
  thread, under the GIL, and compiles it on a pool of that many threads
  (`_xla_warm_up_cache` releases the GIL while XLA compiles). A serial trace
  starts by materializing its arguments' pending IR and ends by restoring
  the arguments it updated: either would break a graph whose outputs a
  worker is compiling, if they met. So, while any compile is in flight, a
  trace here
    - materializes arguments only after waiting for every compile in flight,
      and only if one has pending IR;
    - restores only after waiting: a trace that leaves an argument with
      pending IR (an in-place update) waits for every compile in flight,
      compiles on the calling thread and restores the arguments as the
      serial path does; otherwise its lazy clones and intermediate tensors
      die with their references, and the graph's outputs once their compile
      is done (`_compile_on_worker` drops them even when the compile raises);
    - hands the worker only the graph outputs that have pending IR: an output
      that is device data (an unchanged argument) would be written to by the
      worker's sync (its data's info) while the main thread reads it.
  Neither path syncs the device or touches the RNG state, so both give the
  same programs and random streams. Buffer-donor
  aliasing is on for the whole window (it only changes warm-up compiles and
  graph hashes; a sync donates the same buffers either way). The window
  ends when every compile is done. Entries are added, counted and recorded
  by the caller on the calling thread, in the order the signatures were
  started, so the cache, the counters and the errors (see backlog.py) are
  those of a serial replay.
  """

  def __init__(self, workers: int):
    self.workers = workers
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix='xla-compile')
    self._in_flight: List[concurrent.futures.Future] = []

  def _busy(self) -> bool:
    self._in_flight = [f for f in self._in_flight if not f.done()]
    return bool(self._in_flight)

  def wait(self) -> None:
    """Waits for every compile in flight; their errors stay in their
    futures."""
    concurrent.futures.wait(self._in_flight)
    self._in_flight = []

  def _begin_trace(self, tensors: List[torch.Tensor]) -> None:
    if self._busy() and True in (
        torch_xla._XLAC._check_tensor_need_materialization(tensors)):
      self.wait()
    _sync_alone_noting_reads(tensors)

  def trace(
      self, xla_model: torch.fx.GraphModule, args: Sequence[Any],
      layout: ArgLayout
  ) -> Tuple[CompiledGraphEntry, Optional[concurrent.futures.Future]]:
    """Traces one signature; returns its entry and the future of its compile
    (None when it is compiled already, or has nothing to compile)."""
    tensors = [args[i] for i in layout.tensor_positions]
    self._begin_trace(tensors)
    restore = ArgumentsRestore.of(
        tensors, clear_donor_marks=not _sets_own_donors(xla_model))
    restoring = True
    try:
      _count_epilogue_updates(xla_model)
      traced = _trace_graph(xla_model, args, layout)
      if True not in torch_xla._XLAC._check_tensor_need_materialization(
          tensors):
        restoring = False
        restore.release()
        torch_xla._XLAC._set_all_reduce_token(str(torch_xla.device()), None)
        if not traced.graph_tensors:
          return traced.entry, None
        computed = torch_xla._XLAC._check_tensor_need_materialization(
            traced.graph_tensors)
        future = self._pool.submit(
            _compile_on_worker,
            [t for t, flag in zip(traced.graph_tensors, computed) if flag])
        self._in_flight.append(future)
        return traced.entry, future
      # An in-place update: the serial path, after the compiles in flight.
      self.wait()
      traced = _trace_donating(xla_model, args, layout, restore, traced)
      if traced.graph_tensors:
        compile_graph(traced.graph_tensors)
      return traced.entry, None
    except BaseException:
      # No worker may be reading IR that the restore below drops.
      self.wait()
      raise
    finally:
      if restoring:
        restore()
        restore.release()

  @contextlib.contextmanager
  def opened(self) -> Iterator['CompileWindow']:
    try:
      with alias_with_buffer_donor_config():
        try:
          yield self
        finally:
          self.wait()
    finally:
      self._pool.shutdown(wait=True)


class _ClaimedMiss(Exception):
  """Stops a precompile() call at its first new signature; see [Note:
  Parallel precompile]."""


@dataclasses.dataclass(frozen=True)
class _Claim:
  """A signature a precompile() call stopped at, to compile."""
  cache: 'SignatureCache'
  key: Hashable
  args: List[Any]


@dataclasses.dataclass(frozen=True)
class ClaimsCompiled:
  """What PrecompileCalls.compile() did."""
  # The first `ready` claims, in order, are compiled.
  ready: int
  # Why the next claim is not (None: all are ready).
  error: Optional[BaseException]
  # Wall seconds each ready claim took from its trace to the end of its
  # compile (compiles overlap).
  compile_seconds: Tuple[float, ...]
  # Whether each ready claim had a program to compile.
  compiled: Tuple[bool, ...]


# The PrecompileCalls collecting on some thread, or None; read on misses only.
_precompile_calls: Optional['PrecompileCalls'] = None


class PrecompileCalls:
  """The calls of one precompile() with compile workers.

  [Note: Parallel precompile]
  precompile() (and serve(), through it) runs its calls through dynamo in two
  passes. In the first, each call runs under `call()`: a miss in the call's
  first graph call (no graph of that call has run, so neither the graph nor
  what follows it has changed anything) claims the signature in its
  SignatureCache and stops the call with _ClaimedMiss, uncounted; a miss
  after a graph of the call ran is served as usual. `compile()` then traces
  the claims here and compiles them on the workers (a CompileWindow, see
  [Note: Parallel compiles]); each compiled entry waits in its cache. In the
  second pass precompile() makes the stopped calls again, in order: each
  misses, is counted, takes its compiled entry and runs. So the programs, the
  counters, the index records and what the calls do to their arguments (the
  program runs once per call, whole, AOTAutograd's epilogue included) are
  the serial precompile's; only the RNG stream differs (the mark steps come
  in another order). Returning lazy outputs instead of stopping the call
  would let AOTAutograd copy them into mutated inputs, which a later sync
  would execute as another program. A claimed signature is compiled already
  as far as the graph's backlog is concerned. When a compile raises, the
  calls before its own run, then precompile() raises it, as the serial
  precompile would at that call; calls after it that needed no new
  signature did run in the first pass.
  """

  def __init__(self, workers: int):
    self.workers = workers
    self._claims: List[_Claim] = []
    self._thread = threading.get_ident()
    self._hits_at_call = 0

  def call(self, fn: Callable[..., Any], args: Sequence[Any]) -> Optional[int]:
    """Calls fn(*args); None if it ran, else the number of the claim it
    stopped at (an earlier one when another call claimed that signature)."""
    global _precompile_calls
    self._hits_at_call = metrics.counter_value(COUNTER_HIT) or 0
    _precompile_calls = self
    try:
      fn(*args)
      return None
    except _ClaimedMiss as claimed:
      return claimed.args[0]
    finally:
      _precompile_calls = None

  def claim(self, cache: 'SignatureCache', key: Hashable,
            args: Sequence[Any]) -> None:
    """On a miss: stops the call if its signature can wait (see the Note)."""
    if (threading.get_ident() != self._thread or
        (metrics.counter_value(COUNTER_HIT) or 0) != self._hits_at_call):
      return
    for number, claim in enumerate(self._claims):
      if claim.cache is cache and claim.key == key:
        raise _ClaimedMiss(number)
    cache._precompiled[key] = None
    self._claims.append(_Claim(cache=cache, key=key, args=list(args)))
    raise _ClaimedMiss(len(self._claims) - 1)

  def compile(self) -> ClaimsCompiled:
    """Traces every claim here and compiles it on the workers, in order,
    stopping at the first that raises."""
    with execution_lock:
      return self._compile()

  def _compile(self) -> ClaimsCompiled:
    window = CompileWindow(self.workers)
    in_flight: Deque[Tuple[_Claim, Any]] = collections.deque()
    seconds: List[float] = []
    compiled: List[bool] = []
    error = None

    def finish() -> None:
      nonlocal error
      claim, started = in_flight.popleft()
      if error is not None:
        return
      try:
        if isinstance(started, BaseException):
          raise started
        entry, future, begin = started
        if future is not None:
          future.result()
        seconds.append(time.perf_counter() - begin)
        compiled.append(future is not None)
        if claim.key in claim.cache._precompiled:
          claim.cache._precompiled[claim.key] = entry
      except Exception as e:  # pylint: disable=broad-except
        error = e

    with window.opened():
      for claim in self._claims:
        if error is not None:
          break
        if (claim.key in claim.cache.entries or
            claim.key not in claim.cache._precompiled):
          # Served meanwhile by a call whose graph had run (see the Note).
          in_flight.append((claim, (None, None, time.perf_counter())))
        else:
          try:
            begin = time.perf_counter()
            entry, future = window.trace(claim.cache.xla_model, claim.args,
                                         claim.cache.layout)
            in_flight.append((claim, (entry, future, begin)))
          except Exception as e:  # pylint: disable=broad-except
            in_flight.append((claim, e))
            break
        while len(in_flight) > self.workers + 1:
          finish()
      while in_flight:
        finish()
    ready = len(seconds)
    if error is not None:
      # The serial call of the failing claim counted its miss, then raised.
      _increment_counter(COUNTER_MISS, 1)
    for claim in self._claims[ready:]:
      # Serially these calls never came: nothing of theirs is kept.
      claim.cache._precompiled.pop(claim.key, None)
    self._claims = []
    return ClaimsCompiled(ready=ready,
                          error=error,
                          compile_seconds=tuple(seconds),
                          compiled=tuple(compiled))


_graph_ids = itertools.count()
_live_caches: 'weakref.WeakSet[SignatureCache]' = weakref.WeakSet()


def live_signature_caches() -> List['SignatureCache']:
  """Signature caches of the graphs alive in this process."""
  return sorted(_live_caches, key=lambda cache: cache.graph_id)


class SignatureCache:
  """The entries of one graph, keyed by signature, least recently used first.

  [Note: Dynamo real-time input-shape cache look-up]
  The key of a call comes from `ArgLayout.key_function()` (see [Note: Shape
  signatures]); entries are `CompiledGraphEntry`s in an ordered dict so a cap
  can drop the least recently used one.

  With a cache directory, every signature traced here is recorded in the
  graph's signature index, whose `usage` log counts the calls served. The
  signatures recorded by an earlier process (index or artifact) wait in the
  graph's `backlog` (see [Note: Replaying recorded signatures]).
  """

  def __init__(self, xla_model: torch.fx.GraphModule, layout: ArgLayout):
    self.graph_id = next(_graph_ids)
    self.xla_model = xla_model
    self.layout = layout
    self.key_of = layout.key_function()
    self.entries: 'collections.OrderedDict[Hashable, CompiledGraphEntry]' = (
        collections.OrderedDict())
    self._warned_cap = False
    # Signatures a precompile() claimed (see [Note: Parallel precompile]):
    # None until compiled, then the entry, moved to `entries` by the miss of
    # the call that asks for it.
    self._precompiled: Dict[Hashable, Optional[CompiledGraphEntry]] = {}
    self.backlog = Backlog(self.graph_id, layout, self._compile_recorded,
                           self._compile_window)
    self.usage: Optional[signature_index.UsageLog] = None
    if config.cache_dir:
      index = signature_index.GraphIndex(
          config.cache_dir, fingerprint.graph_fingerprint(xla_model, layout),
          layout, config.index_max_signatures)
      self.usage = signature_index.UsageLog(index, config.usage_flush_seconds)
    _live_caches.add(self)

  # -- entries

  def look_up(self, key: Hashable) -> Optional[CompiledGraphEntry]:
    """The entry of `key`, now the most recently used, counted as a hit;
    None if the signature has none. Every run of a cached program, through
    the bridge's callable or a BoundProgram, starts here."""
    entry = self.entries.get(key)
    if entry is not None:
      _increment_counter(COUNTER_HIT, 1)
      self.entries.move_to_end(key)
    return entry

  def served(self, key: Hashable) -> None:
    """After every call of `key` that ran: its served count for the
    signature index, and one recorded signature of the backlog compiled
    (see [Note: Replaying recorded signatures])."""
    usage = self.usage
    if usage is not None:
      usage.served[key] += 1
      if time.monotonic() >= usage.next_flush:
        usage.flush()
    if self.backlog:
      self.backlog.after_served_call()

  def trace(self, key: Hashable, args: Sequence[Any]) -> CompiledGraphEntry:
    entry = extract_graph_helper(self.xla_model, args, self.layout)
    self._add_entry(key, entry)
    return entry

  def _add_entry(self, key: Hashable, entry: CompiledGraphEntry) -> None:
    self.entries[key] = entry
    self.entries.move_to_end(key)
    cap = config.max_signatures_per_graph
    while cap > 0 and len(self.entries) > cap:
      self.entries.popitem(last=False)
      _increment_counter(COUNTER_DROPPED, 1)
      if not self._warned_cap:
        self._warned_cap = True
        logger.warning(
            'torch_xla_patches: graph %d has more than %d shape signatures; '
            'dropping the least recently used ones. Raise '
            'XLA_PATCHES_MAX_SIGNATURES (0: no cap) or pad shapes into '
            'buckets.', self.graph_id, cap)

  def _trace_and_record(self, key: Hashable,
                        args: Sequence[Any]) -> CompiledGraphEntry:
    entry = self.trace(key, args)
    if self.usage is not None:
      self.usage.record(key, record.make_record(self.layout, args))
    return entry

  def on_miss(self, key: Hashable, args: Sequence[Any]) -> CompiledGraphEntry:
    _increment_counter(COUNTER_MISS, 1)
    if config.explain_misses:
      logger.info('%s', self.explain_miss(args))
    entry = self._precompiled.pop(key, None)
    if entry is not None:
      self._add_prepared(key, entry, args)
      return entry
    return self._trace_and_record(key, args)

  def _add_prepared(self, key: Hashable, entry: CompiledGraphEntry,
                    args: Sequence[Any]) -> None:
    self._add_entry(key, entry)
    if self.usage is not None:
      self.usage.record(key, record.make_record(self.layout, args))

  def _compile_recorded(self, args: List[Any]) -> bool:
    key = self.key_of(args)
    if key in self.entries:
      return False
    if key in self._precompiled:
      entry = self._precompiled[key]
      if entry is None:
        # A precompile() call claimed it: serially, that call compiled it
        # already.
        return False
      del self._precompiled[key]
      self._add_prepared(key, entry, args)
      return True
    self._trace_and_record(key, args)
    return True

  @contextlib.contextmanager
  def _compile_window(self, workers: int) -> Iterator[StartFunction]:
    """Opens a window in which recorded signatures are traced here and
    compiled on `workers` threads (see [Note: Parallel compiles])."""
    window = CompileWindow(workers)
    started = set()
    with window.opened():
      yield functools.partial(self._start_recorded, window, started)

  def _start_recorded(self, window: CompileWindow, started: set,
                      args: List[Any]) -> Callable[[], bool]:
    """Traces rebuilt arguments now; the function returned waits for their
    compile, then adds the entry and returns what _compile_recorded would."""
    key = self.key_of(args)
    if key in self.entries:
      return lambda: False
    if key in started or key in self._precompiled:
      # The same signature is in flight, or claimed by a precompile():
      # decided in turn, as serially.
      def in_turn() -> bool:
        window.wait()
        return self._compile_recorded(args)

      return in_turn
    started.add(key)
    made = record.make_record(self.layout, args) if self.usage else None
    entry, future = window.trace(self.xla_model, args, self.layout)

    def finish() -> bool:
      if future is not None:
        future.result()
      self._add_entry(key, entry)
      if made is not None:
        self.usage.record(key, made)
      return True

    return finish

  def explain_miss(self, args: Sequence[Any]) -> str:
    signature = self.layout.signature_of(args)
    header = f'[torch_xla_patches] graph {self.graph_id}: new shape signature'
    if not self.entries:
      return f'{header} (first of this graph)'
    closest = min((signature.differences(entry.signature)
                   for entry in self.entries.values()),
                  key=len)
    return f'{header}; closest known differs in: ' + '; '.join(closest)

  def signatures(self) -> List[ShapeSignature]:
    return [entry.signature for entry in self.entries.values()]

  # -- recorded signatures

  @property
  def backlog_size(self) -> int:
    return len(self.backlog)

  def queue_recorded(self, records: Sequence[record.RecordedSignature],
                     live_args: Sequence[Any]) -> None:
    """Queues recorded signatures (see [Note: Replaying recorded
    signatures]) and, in 'sync' mode before the first call is served,
    compiles what that call's budget still allows."""
    self.backlog.queue(records, live_args)
    self.backlog.drain_for_first_call()

  def queue_index_records(self, live_args: Sequence[Any]) -> None:
    """Queues what the signature index recorded for this graph."""
    if self.usage is None:
      return
    index = self.usage.index
    contents = index.load()
    for problem in contents.problems:
      self.backlog.skip_unreadable(problem.path, problem.reason)
    if not contents.records and config.explain_cache:
      logger.info('[torch_xla_patches] no recorded signatures for graph %s: %s',
                  index.fingerprint.key, index.explain_miss())
    self.queue_recorded(contents.records, live_args)

  def drain_backlog(self) -> int:
    """Compiles every queued signature now; returns how many compiled."""
    with execution_lock:
      return self.backlog.drain_all().compiled

  # -- bound programs

  def bound_program(self, args: Sequence[Any],
                    free_index: Dict[int, int]) -> Optional['BoundProgram']:
    """The compiled program of the signature of `args`, with every argument
    whose position is not in `free_index` (position -> index among the free
    arguments of a call) bound to the tensor `args` holds there now (see
    [Note: Bound programs]); None if that signature is not compiled, or if
    its program cannot be bound (it draws a random seed, returns an
    argument)."""
    key = self.key_of(args)
    with execution_lock:
      entry = self.entries.get(key)
    if entry is None:
      return None
    matcher = entry.graph_input_matcher
    if matcher.draws_seed or entry.output_plan.returned_args:
      return None
    inputs = []
    free_slots = []
    for slot, (arg_idx, constant) in enumerate(
        zip(matcher.arg_idxs, matcher.graph_input_xla_values)):
      if arg_idx is None:
        inputs.append(constant)
      elif arg_idx in free_index:
        if not self.layout.kinds[arg_idx].is_tensor:
          return None
        free_slots.append((slot, free_index[arg_idx]))
        inputs.append(None)
      else:
        inputs.append(args[arg_idx])

    def source(position: int) -> BoundArgument:
      return BoundArgument(
          free_index=free_index.get(position),
          bound=None if position in free_index else args[position])

    updates = tuple(
        BoundUpdate(argument=source(position),
                    result_index=result_index,
                    donated=position in entry.donated_positions)
        for position, result_index in entry.output_plan.inplace_updates)
    donated = tuple((matcher.arg_idxs.index(position), source(position))
                    for position in entry.donated_positions)
    return BoundProgram(self, key, entry, inputs, tuple(free_slots), updates,
                        donated)


@dataclasses.dataclass(frozen=True, eq=False)
class BoundArgument:
  """A graph argument of a bound program: the free argument at `free_index`
  of a call, or else the `bound` tensor."""
  free_index: Optional[int]
  bound: Optional[torch.Tensor]

  def of(self, free_args: Sequence[Any]) -> torch.Tensor:
    return self.bound if self.free_index is None else free_args[self.free_index]


@dataclasses.dataclass(frozen=True, eq=False)
class BoundUpdate:
  """An argument a bound program updates in place, from its result at
  `result_index`; `donated` if the program takes its buffer over."""
  argument: BoundArgument
  result_index: int
  donated: bool


class BoundProgram:
  """One compiled signature, run from the free arguments of a call alone.

  [Note: Bound programs]
  A bound program holds the XLA input list of its signature with every input
  that is not a free argument filled in: the tensors of the bound arguments
  (parameters and buffers, by identity) and the graph's constants. A call
  copies the list, puts the free arguments in their slots and runs the
  program. It checks nothing of what the bound tensors are: the caller
  guarantees that the bound arguments are still what the graph would be
  handed (serving's fast path, through its module watch) and that the free
  arguments have the signature's shapes. What the bridge's own hit path
  does around a run is done here too: free tensors with pending IR are
  synced first, a donated argument read since its data was set is copied
  for the run, arguments updated in place take their results (see [Note:
  Donating in-place updates]; views and aliases of them follow), the
  signature is looked up and served as every run of the bridge is
  (SignatureCache.look_up and served: LRU order, hit counter, usage,
  backlog), under execution_lock (see [Note: Threads]). A run that cannot
  start (its signature dropped from the cache or traced again, a bound
  tensor with pending IR, a program XLA evicted) raises RefusedBeforeRun
  with nothing run; the caller then goes through the bridge's callable,
  which recovers. Any other error is the call's own and propagates.

  Args:
    cache: the graph's signature cache.
    key: the signature's key.
    entry: the signature's compiled entry.
    inputs: the XLA inputs, None in the free slots.
    free_slots: (XLA input slot, free argument index) of each free input.
    updates: each argument updated in place.
    donated: (XLA input slot, argument) of each argument whose buffer the
      program takes over.
  """

  def __init__(self,
               cache: SignatureCache,
               key: Hashable,
               entry: CompiledGraphEntry,
               inputs: List[Any],
               free_slots: Tuple[Tuple[int, int], ...],
               updates: Tuple[BoundUpdate, ...] = (),
               donated: Tuple[Tuple[int, BoundArgument], ...] = ()):
    self.key = key
    self.graph_hash = entry.graph_hash
    self._cache = cache
    self._entry = entry
    self._inputs = inputs
    self._free_slots = free_slots
    self._updates = updates
    self._donated = donated
    self._copy_if_read = [True] * len(donated)
    self._output_plan = entry.output_plan
    self._runs = 0
    self._outputs_are_results = entry.output_plan.outputs_are_results

  def __call__(self, free_args: Sequence[torch.Tensor]) -> List[Any]:
    """Runs the program; returns every graph output, in order. Raises
    RefusedBeforeRun if it cannot start."""
    with execution_lock:
      cache = self._cache
      if cache.look_up(self.key) is not self._entry:
        raise RefusedBeforeRun('the signature\'s entry was dropped from the '
                               'cache or traced again')
      inputs = self._inputs.copy()
      for slot, index in self._free_slots:
        inputs[slot] = free_args[index]
      plan = self._output_plan
      if plan.num_results:
        if not upstream_config.skip_input_data_check:
          # free_args may hold a served call's other leaves (ints, None).
          _sync_pending_inputs([inputs[slot] for slot, _ in self._free_slots])
        if self._donated:
          donated = [argument.of(free_args) for _, argument in self._donated]
          for index in _read_donations(donated, None, self._copy_if_read):
            _increment_counter(COUNTER_DONATION_COPIED_READ, 1)
            inputs[self._donated[index][0]] = _private_copy(donated[index])
        results = run_program(self.graph_hash, inputs)
        self._runs += 1
        if self._updates:
          takers, taken = [], []
          for update in self._updates:
            target = update.argument.of(free_args)
            if update.donated:
              takers.append(target)
              taken.append(results[update.result_index])
            else:
              target.copy_(results[update.result_index])
          if takers:
            # See [Note: Taking a result].
            take_results(takers, taken, self._runs % _UPDATE_LOG_RUNS == 0)
      else:
        results = []
      outputs = (results if self._outputs_are_results else plan.outputs(
          results, ()))
      cache.served(self.key)
      return outputs


# A bound program drops the update logs of the arguments it updates every
# this many runs (see [Note: Taking a result]).
_UPDATE_LOG_RUNS = 32


class RefusedBeforeRun(RuntimeError):
  """A compiled program was not run, and nothing of the call happened: its
  signature is no longer cached, an input has pending IR, or XLA evicted the
  program (see [Note: Bound programs])."""


def run_program(graph_hash: Any, inputs: List[Any]) -> List[torch.Tensor]:
  """`_run_cached_graph`, whose refusals before running (an input with
  pending IR, an evicted program) raise RefusedBeforeRun."""
  try:
    return torch_xla._XLAC._run_cached_graph(graph_hash, inputs)
  except RuntimeError as error:
    message = str(error)
    if _PENDING_IR_MESSAGE in message or _EVICTED_MESSAGE in message:
      raise RefusedBeforeRun(message) from error
    raise


def _sync_pending_inputs(tensors: Sequence[torch.Tensor]) -> None:
  """Materializes the tensors that have pending IR, blocking; counted."""
  flags = torch_xla._XLAC._check_tensor_need_materialization(tensors)
  if True in flags:
    _increment_counter('DynamoSyncInputExecuteTime', 1)
    _sync_alone([t for t, flag in zip(tensors, flags) if flag])


def _sync_alone_noting_reads(tensors: Sequence[torch.Tensor]) -> None:
  """_sync_alone, noting the data of a tensor read since its data was set
  (see _read_since_set) as read: the sync makes a tensor whose data sat in
  an IR node (one just moved to the device, which something may have read)
  hold that data itself, and drops the node."""
  read = [t for t in tensors if _read_since_set(t)]
  _sync_alone(tensors)
  for tensor in read:
    if not _read_since_set(tensor):
      _note_data(tensor, given=False)


def _sync_alone(tensors: Sequence[torch.Tensor]) -> None:
  """Syncs `tensors` and nothing else (see [Note: Threads]), blocking: each
  becomes device data held by the tensor itself, whether it had pending IR
  or its data sat in an IR node (a tensor just moved to the device); one
  that is device data already costs nothing."""
  if tensors:
    torch_xla._XLAC._xla_sync_multi(list(tensors),
                                    devices=[],
                                    wait=True,
                                    sync_xla_data=True)


def extract_internal(xla_model: torch.fx.GraphModule):
  """Compiles the first signature now; returns the per-call function."""
  first_args = xla_model.xla_args
  layout = ArgLayout.from_graph(xla_model, first_args, spmd=xr.is_spmd())
  cache = SignatureCache(xla_model, layout)
  if dynamo_debug:
    print(f'[torch_xla_patches] graph {cache.graph_id} layout: {layout.kinds}')
  cache.on_miss(cache.key_of(first_args), first_args)
  cache.queue_index_records(first_args)
  del xla_model.xla_args

  key_of = cache.key_of
  all_tensors = tuple_getter(layout.tensor_positions)
  # [Note: Input materialization check]
  # `_run_cached_graph` needs device data, not pending IR, as input.
  # Non-parameter tensors (activations, user inputs, tangents) are often
  # pending, so they are checked up front, in one C++ call. Lifted parameters
  # are rarely pending (only after an eager update with no sync), and there
  # are many of them, so they are not checked: `_run_cached_graph` refuses
  # pending IR before it runs anything, and the refusal is handled in
  # run_after_refusal.
  checked_tensors = tuple_getter(
      layout.positions(ArgKind.TENSOR, ArgKind.DYNAMIC_TENSOR))

  def run_after_refusal(refusal: RefusedBeforeRun, key: Hashable,
                        entry: CompiledGraphEntry, args: Sequence[Any]):
    # `_run_cached_graph` refuses pending-IR inputs (see [Note: Input
    # materialization check]) and evicted programs before running anything;
    # sync the inputs, or re-trace the evicted signature, and run again.
    for _ in range(3):
      message = str(refusal)
      if _PENDING_IR_MESSAGE in message:
        if upstream_config.skip_input_data_check:
          # The user turned the input check off: report, don't sync.
          raise refusal.__cause__ or refusal
        _sync_pending_inputs(all_tensors(args))
      else:
        _increment_counter(COUNTER_RETRACE, 1)
        entry = cache.trace(key, args)
      run_args = (prepare_donating_run(entry, args)
                  if entry.donated_positions else args)
      try:
        return entry, run_program(entry.graph_hash,
                                  entry.graph_input_matcher(run_args))
      except RefusedBeforeRun as next_refusal:
        refusal = next_refusal
    raise refusal.__cause__ or refusal

  def optimized_mod(*args):
    with execution_lock:
      key = key_of(args)
      entry = cache.look_up(key)
      if entry is None:
        if _precompile_calls is not None:
          _precompile_calls.claim(cache, key, args)
        entry = cache.on_miss(key, args)
      plan = entry.output_plan
      if plan.num_results:
        if not upstream_config.skip_input_data_check:
          _sync_pending_inputs(checked_tensors(args))
        run_args = (prepare_donating_run(entry, args)
                    if entry.donated_positions else args)
        try:
          results = run_program(entry.graph_hash,
                                entry.graph_input_matcher(run_args))
        except RefusedBeforeRun as refusal:
          entry, results = run_after_refusal(refusal, key, entry, args)
          plan = entry.output_plan
        apply_updates(entry, results, args)
      else:
        results = []
      outputs = plan.assemble(results, args)
      cache.served(key)
      return outputs

  optimized_mod.signature_cache = cache
  return optimized_mod


class _FallbackCounterWatch:
  """Tells whether an op fell back to the CPU since the last look."""

  def __init__(self):
    self._seen = self._snapshot()

  @staticmethod
  def _snapshot() -> Dict[str, int]:
    return {
        name: metrics.counter_value(name)
        for name in metrics.executed_fallback_ops()
    }

  def fell_back(self) -> bool:
    now = self._snapshot()
    changed = now != self._seen
    self._seen = now
    return changed


def _all_on_xla(value: Any) -> bool:
  if isinstance(value, torch.Tensor):
    return value.device.type == 'xla'
  if isinstance(value, (list, tuple)):
    return all(_all_on_xla(v) for v in value)
  return True


class UnsupportedNodesCollector(torch.fx.Interpreter):
  """Runs the graph node by node, noting nodes XLA cannot compile: CPU
  fallback ops and nodes with non-XLA tensor inputs or outputs.

  It compares fallback counters between nodes without clearing them, so
  user-visible counters survive the first call.
  """

  def __init__(self, module: torch.fx.GraphModule):
    super().__init__(module)
    self._unsupported_nodes: List[torch.fx.Node] = []
    self._watch = _FallbackCounterWatch()

  def run_node(self, n: torch.fx.Node):
    if _is_input_update(n):
      # See [Note: Input updates in a partitioned graph]: this run only
      # looks, and an update of a CPU input could not be undone.
      args, _ = self.fetch_args_kwargs_from_env(n)
      if not _all_on_xla(args):
        self._unsupported_nodes.append(n)
      return args[0]
    result = super().run_node(n)
    if n.op in ('placeholder', 'output'):
      return result
    args, kwargs = self.fetch_args_kwargs_from_env(n)
    if (self._watch.fell_back() or not _all_on_xla(result) or
        not _all_on_xla(list(itertools.chain(args, kwargs.values())))):
      self._unsupported_nodes.append(n)
    return result

  def get_unsupported_nodes(self) -> List[torch.fx.Node]:
    return self._unsupported_nodes


class InputCollector(torch.fx.Interpreter):
  """Records, on each fused submodule, the arguments it is first called with."""

  def call_module(self, target, args, kwargs):
    if 'fused_' in target:
      self.fetch_attr(target).xla_args = args
    return super().call_module(target, args, kwargs)

  def run_node(self, n: torch.fx.Node):
    if _is_input_update(n):
      # This run only records (see [Note: Input updates in a partitioned
      # graph]).
      return self.fetch_args_kwargs_from_env(n)[0][0]
    return super().run_node(n)


def extract_compiled_graph(xla_model: torch.fx.GraphModule, xla_args):
  torch_xla._XLAC._xla_increment_counter('DynamoExtractCompiledGraph', 1)
  with execution_lock, torch_xla.experimental.eager_mode_context(False):
    return extract_compiled_graph_helper(xla_model, xla_args)


def partition_fx_graph_for_cpu_fallback(
    xla_model: torch.fx.GraphModule, xla_args: Sequence[Any],
    unsupported_nodes: List[torch.fx.Node]) -> torch.fx.GraphModule:
  """Splits the graph around unsupported nodes; each XLA part gets its own
  signature cache, the unsupported nodes run eagerly on every call.

  [Note: CPU fallback with dynamic shapes]
  Graphs with int inputs are partitioned too: a fallback op left inside a
  traced graph would run once, at trace time, and its output would be a
  constant of the compiled program, stale for every later call of the
  signature. Int inputs are passed to each fused part like any other input
  and enter its signature.
  """
  if ptxla_debug or dynamo_debug:
    print(f'Dynamo fallback ops are {unsupported_nodes}. Please open a GitHub '
          'issue with the above op lowering requests.')
  # See [Note: Input updates in a partitioned graph].
  input_updates = _input_updates(xla_model.graph)
  if input_updates:
    _increment_counter(COUNTER_DONATION_FALLBACK, len(input_updates))
  unsupported = set(unsupported_nodes) | set(input_updates)

  class XlaOperatorSupport(OperatorSupport):

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
      return node.op in ('call_function', 'call_module',
                         'call_method') and (node not in unsupported or
                                             node.target == operator.getitem)

  partitioner = CapabilityBasedPartitioner(xla_model,
                                           XlaOperatorSupport(),
                                           allows_single_node_partition=True)
  partitions = partitioner.propose_partitions()
  # propose_partitions() does not guarantee topological order.
  for partition in partitions:
    partition.nodes = topo_sort(partition.nodes)
  partitioned_graph = partitioner.fuse_partitions(partitions)
  _run_last(partitioned_graph.graph, [node.name for node in input_updates])
  tensor_args = [a for a in xla_args if isinstance(a, torch.Tensor)]
  with pending_ir_restored(tensor_args):
    InputCollector(partitioned_graph).run(*xla_args)

  fused_parts = 0
  for node in list(partitioned_graph.graph.nodes):
    if node.op == 'call_module' and 'fused_' in node.name:
      fused_parts += 1
      fused_module = getattr(partitioned_graph, node.name)
      partitioned_graph.delete_submodule(node.target)
      with partitioned_graph.graph.inserting_after(node):
        new_node = partitioned_graph.graph.call_function(
            extract_internal(fused_module), node.args, None)
        node.replace_all_uses_with(new_node)
      partitioned_graph.graph.erase_node(node)
  partitioned_graph.recompile()
  if fused_parts:
    # Counted only when some part runs on XLA: a graph on CPU tensors alone
    # is not an XLA graph at all.
    _increment_counter(COUNTER_FALLBACK_PARTITION, 1)
  return partitioned_graph


def _input_updates(graph: torch.fx.Graph) -> List[torch.fx.Node]:
  """The nodes of `graph` that write a graph input in place (`copy_`), in
  order.

  [Note: Input updates in a partitioned graph]
  AOTAutograd, keeping an inference graph's updates of its inputs in the
  graph (keep_inference_input_mutations), writes them with `copy_` at the
  graph's end. The partitioner orders nodes by their data dependencies
  alone, which do not say that an update must follow every read of the
  input it writes, so a fused part could read an input another part has
  already written. So in a graph partitioned around CPU fallback ops, the
  updates are left out of the fused parts and run, in their order, after
  everything else, as AOTAutograd's epilogue would run them: eagerly, with
  no donation (counted as COUNTER_DONATION_FALLBACK). The runs that find
  the unsupported nodes and record the parts' arguments only look: they
  skip the updates, since one of a CPU input could not be undone.
  """
  return [node for node in graph.nodes if _is_input_update(node)]


def _is_input_update(node: torch.fx.Node) -> bool:
  return (node.op == 'call_function' and
          node.target is torch.ops.aten.copy_.default and
          isinstance(node.args[0], torch.fx.Node) and
          node.args[0].op == 'placeholder')


def _run_last(graph: torch.fx.Graph, names: Sequence[str]) -> None:
  """Moves the nodes named `names` (fuse_partitions makes a new graph), in
  order, then the output node, to the end of `graph`.
  fuse_partitions orders the nodes topologically, and an output that
  depends on nothing (a graph whose only effects are updates of its inputs:
  an optimizer step) can come first, where no node after it would run."""
  by_name = {node.name: node for node in graph.nodes}
  output = next(node for node in graph.nodes if node.op == 'output')
  for node in [by_name[name] for name in names] + [output]:
    last = next(iter(reversed(graph.nodes)))
    if last is not node:
      last.append(node)


def _find_unsupported_nodes(xla_model: torch.fx.GraphModule,
                            xla_args: Sequence[Any]) -> List[torch.fx.Node]:
  tensor_args = [a for a in xla_args if isinstance(a, torch.Tensor)]
  collector = UnsupportedNodesCollector(xla_model)
  with pending_ir_restored(tensor_args):
    collector.run(*xla_args)
  return collector.get_unsupported_nodes()


def _check_args(xla_args: Sequence[Any]) -> None:
  """Fails, or warns, with the argument named, before any tracing.

  A tensor on another device is allowed: the nodes that touch it are left
  out of the XLA graph and run eagerly (see `UnsupportedNodesCollector`), so
  the result stays correct, only slower.
  """
  for index, arg in enumerate(xla_args):
    if isinstance(arg, torch.Tensor):
      if arg.device.type != 'xla':
        # torch_xla's tests match the message's opening words.
        warnings.warn(
            f'Found tensor with shape {arg.size()} on {arg.device}: '
            f'{describe_arg(index, arg)} is not on the XLA device; the ops '
            'that use it run eagerly. Move all inputs to torch_xla.device() '
            'to run them in the compiled XLA graph.')
    else:
      check_scalar_input(index, arg)


def extract_compiled_graph_helper(xla_model: torch.fx.GraphModule, xla_args):
  # Sync functional wrappers so each argument's value reference is current.
  for arg in xla_args:
    if isinstance(arg, torch.Tensor) and torch._is_functional_tensor(arg):
      torch._functionalize_sync(arg)
  _check_args(xla_args)
  # Materialize the arguments so their ids show up as graph inputs (only
  # them: see [Note: Threads]).
  _sync_alone_noting_reads([
      arg for arg in xla_args
      if isinstance(arg, torch.Tensor) and arg.device.type == 'xla'
  ])
  # Make CPU tensor constructors in the graph create XLA tensors.
  XLAConstructorMoverPass()(xla_model.graph)

  unsupported_nodes = _find_unsupported_nodes(xla_model, xla_args)
  if unsupported_nodes:
    return partition_fx_graph_for_cpu_fallback(xla_model, xla_args,
                                               unsupported_nodes)
  xla_model.xla_args = xla_args
  return extract_internal(xla_model)
