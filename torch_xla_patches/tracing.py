"""Tracing one signature of a graph: what its XLA inputs are (input
matching), how its results become the graph's outputs (the output plan), the
entry a compiled signature keeps, and the restore of the arguments after a
trace.
"""
import dataclasses
import functools
import contextlib
import os
import threading
from numbers import Number
from typing import (Any, Callable, Collection, Dict, Iterator, List, Optional,
                    Sequence, Tuple)

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from torch_xla_patches import config, io_utils
from torch_xla_patches.counters import COUNTER_DONATED, increment_counter
from torch_xla_patches.donation import (DonorHold, commit_value, data_id_of,
                                        donatable_positions, donor_aliasing,
                                        donor_marks, inner_value, is_functional,
                                        maybe_read, note_data, read_since_set,
                                        sets_own_donors)
from torch_xla_patches.execution import sync_alone
from torch_xla_patches.signature import (ArgLayout, ShapeSignature,
                                         UnsupportedGraphInput, tuple_getter)

dynamo_debug = int(os.environ.get('XLA_DYNAMO_DEBUG', '0')) == 1


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
    outputs = results if self._identity else self.outputs(results, args)
    # The bridge's calling convention: a single output is returned bare.
    return outputs[0] if len(outputs) == 1 else outputs

  def outputs(self, results: List[torch.Tensor],
              args: Sequence[Any]) -> Sequence[Any]:
    """Every graph output, in order (the in-place updates are the caller's:
    see write_back in program_run.py)."""
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
class UpdateSplit:
  """A compiled entry's in-place updates, as (argument position, result
  index), by how a run writes them back."""
  # Donated arguments, which take their result's data over.
  taken: Tuple[Tuple[int, int], ...]
  # Any other, which copies its result.
  copied: Tuple[Tuple[int, int], ...]


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
  # Donating in-place updates] in donation.py).
  donated_positions: Tuple[int, ...] = ()
  # The input positions whose data a donated argument can share at a call:
  # those of a donated argument's dtype and number of elements (a device
  # buffer has one shape), the donated ones among them.
  donation_peers: Tuple[int, ...] = ()

  @functools.cached_property
  def update_split(self) -> 'UpdateSplit':
    """The in-place updates split by how a run writes them back (see
    write_back in program_run.py): fixed per entry, so split once."""
    donated = set(self.donated_positions)
    updates = self.output_plan.inplace_updates
    return UpdateSplit(taken=tuple(u for u in updates if u[0] in donated),
                       copied=tuple(u for u in updates if u[0] not in donated))

  @functools.cached_property
  def writes_nothing_back(self) -> bool:
    """Whether a run computes something and updates no argument: it runs
    the program on its inputs and nothing else (see [Note: One run of a
    compiled program] in program_run.py)."""
    return bool(self.output_plan.num_results and
                not self.output_plan.inplace_updates and
                not self.donated_positions)

  @functools.cached_property
  def input_positions(self) -> Tuple[int, ...]:
    """The argument positions the program reads, each once."""
    return tuple(
        sorted({
            position for position in self.graph_input_matcher.arg_idxs
            if position is not None
        }))


@contextlib.contextmanager
def pending_ir_restored(
    tensors: Sequence[torch.Tensor]) -> Iterator['ArgumentsRestore']:
  """Runs a trace of the FX graph on real arguments and leaves them as they
  were, with no pending IR behind, whether the trace returns or raises (see
  ArgumentsRestore); yields the restore, for a trace to run again."""
  restore = ArgumentsRestore.of(tensors)
  try:
    yield restore
  finally:
    restore()
    restore.release()


def dynamo_compile_lock() -> Any:
  """dynamo's lock around each frame's compile: its trace, its fake tensors,
  AOTAutograd and the backend (see [Note: Restores and dynamo's
  compiles])."""
  import torch._dynamo.convert_frame
  return torch._dynamo.convert_frame.compile_lock


@dataclasses.dataclass(frozen=True)
class ArgumentsRestore:
  """Puts the arguments of a trace back as they were before it.

  [Note: Restores and dynamo's compiles]
  A restore writes a graph input (a parameter, a buffer, a cache) through
  torch's functionalization: each write is queued on the tensor's functional
  storage and applied by the sync after it. A dynamo compile on another
  thread turns the same tensors into fake tensors (dynamo's inputs, then
  AOTAutograd's); a conversion that finds the queued write applies it under
  its fake mode, which refuses the real tensor ("Please convert all Tensors
  to FakeTensors first", raised as BackendCompilerFailed), and nothing guards
  the queue against two threads. A restore therefore holds dynamo's compile
  lock from its first write to its sync: it never overlaps another thread's
  dynamo compile. Restores happen when a signature is traced, so only a
  trace waits for a dynamo compile, never a call of a compiled program; no
  thread holding dynamo's compile lock waits for execution_lock.

  Tracing runs the FX graph on the real arguments, so in-place updates in the
  graph give them pending IR, and the trace's reads (the clones' too) give them
  an IR node of their device data. Lazy clones (no device copy happens unless
  used) are copied back into the updated ones and into those the trace only read
  (but views, where a copy writes the base), which then hold the device data
  they had, with no IR: a read by the bridge's own trace is no read by the
  caller (see [Note: Donating in-place updates] in donation.py). The clones are
  let go by release(). What was read before the trace stays known as read (see
  maybe_read). The pending IR of the device is not cleared: other threads'
  tensors may be pending (see [Note: Threads] in execution.py). The donor
  marks of a donating trace (mark_donor) are let go; any other mark stays
  (see [Note: Donor marks held by traces] in donation.py): a user's, or one
  a graph sets itself, as upstream's bridge leaves them.

  A placeholder (see [Note: Placeholder tensors] in io_utils.py) has no
  value to put back and no buffer a sync could read: it is not cloned, and
  a placeholder the trace left with IR gets the data of a fresh placeholder,
  which runs nothing.

  [Note: Restores on a mesh]
  Under SPMD the copy of a clone back into a sharded tensor is a computation
  (torch_xla puts the tensor's sharding on the update, `custom_sharding`),
  so its sync runs a program and gives the tensor a new buffer, alive beside
  the old one: a copy of every cache a trace updated, at each restore. So
  on a mesh each functionalization wrapper that is no view and holds device
  data gets a keeper before the trace (_keepers_of): a lazy tensor of its
  own on that data. The restore gives the wrapper, as its value, a new lazy
  tensor on the keeper's data, commits that as an update and drops the
  update log (functionalization's replace and commit, as take_result does):
  nothing runs, the wrapper holds its old buffer with its sharding, and its
  views replay the update to the old values. Invariants:
    * each restore makes its own lazy tensor on the keeper's data, never
      the keeper itself: the value it gives the wrapper is what a later
      trace on the wrapper (the donating one) updates in place;
    * the wrapper then holds its data in an IR node, which a sync of it
      does not drop (as a run's results under SPMD); the data ledger notes
      the data as it knew it before the trace: given stays given (what read
      it meanwhile, the clones, the keeper and the trace's graph, is the
      bridge's own and let go before any run, and a donating run of data
      held in an IR node syncs the device's pending IR first), anything
      else is noted as read, and the next donating run copies it;
    * on one device the copy back runs nothing already (the copy of a clone
      is an IR node of the old device data, which the sync makes device
      data again), and no keeper is made.
  """
  tensors: List[torch.Tensor]
  clones: List[torch.Tensor]
  # Per tensor: whether something may hold its buffer by having read it.
  read: List[bool]
  # Per tensor: whether it had IR before the trace.
  had_ir: List[bool]

  # The placeholders among the tensors, which are neither cloned nor synced.
  placeholders: List[torch.Tensor] = dataclasses.field(default_factory=list)
  # The donor marks the trace holds (see [Note: Donor marks held by traces]
  # in donation.py).
  marks: List[DonorHold] = dataclasses.field(default_factory=list)
  # Per tensor on a mesh, its keeper or None; empty elsewhere (see [Note:
  # Restores on a mesh]).
  keepers: List[Optional[torch.Tensor]] = dataclasses.field(
      default_factory=list)

  @classmethod
  def of(cls, tensors: Sequence[torch.Tensor]) -> 'ArgumentsRestore':
    placeholders = [t for t in tensors if io_utils.is_placeholder(t)]
    if placeholders:
      tensors = [t for t in tensors if not io_utils.is_placeholder(t)]
    tensors = list(tensors)
    # Before the clones: a clone reads its tensor.
    read = [maybe_read(t) for t in tensors]
    had_ir = [read_since_set(t) for t in tensors]
    return cls(tensors=tensors,
               clones=[torch.clone(t) for t in tensors],
               read=read,
               had_ir=had_ir,
               placeholders=placeholders,
               keepers=_keepers_of(tensors))

  def mark_donor(self, tensor: torch.Tensor) -> None:
    """Marks `tensor`'s buffer as a donor until the restore."""
    self.marks.append(donor_marks.hold(tensor))

  def __call__(self) -> None:
    """Copies each clone back into its tensor if the tensor has pending IR,
    or IR the trace left. The copy leaves the tensor's IR a read of its old
    device data; the sync of those tensors alone makes them that device
    data again, and runs nothing. On a mesh a tensor with a keeper gets its
    data back from it instead (see [Note: Restores on a mesh]). The data of
    a tensor `read` before the trace is noted as read: whatever read it may
    hold its buffer, which a donating run must not take."""
    for tensor in self.placeholders:
      if read_since_set(tensor) or True in (
          torch_xla._XLAC._check_tensor_need_materialization([tensor])):
        io_utils.reset_placeholder(tensor)
    flags = torch_xla._XLAC._check_tensor_need_materialization(self.tensors)
    keepers = self.keepers or [None] * len(self.tensors)
    updated = []
    kept = []
    for tensor, clone, flag, was_read, had_ir, keeper in zip(
        self.tensors, self.clones, flags, self.read, self.had_ir, keepers):
      if not (flag or (not had_ir and not tensor._is_view() and
                       read_since_set(tensor))):
        continue
      if keeper is None:
        updated.append((tensor, clone, was_read))
      else:
        kept.append((tensor, keeper, was_read))
    # See [Note: Restores and dynamo's compiles].
    with dynamo_compile_lock():
      for tensor, keeper, _ in kept:
        commit_value(tensor, _on_device_data_of(keeper))
      for tensor, clone, _ in updated:
        tensor.copy_(clone)
      # A donor mark of the bridge's trace would let the sync below hand
      # the buffer over; a second trace marks again. Another trace's hold
      # stays (see [Note: Donor marks held by traces] in donation.py).
      for hold in self.marks:
        donor_marks.let_go(hold)
      del self.marks[:]
      sync_alone([tensor for tensor, _, _ in updated])
    for tensor, _, was_read in updated:
      if was_read:
        note_data(tensor, given=False)
    for tensor, _, was_read in kept:
      note_data(tensor, given=not was_read)

  def release(self) -> None:
    """Lets the clones and keepers go."""
    del self.clones[:]
    del self.keepers[:]


def _on_device_data_of(tensor: torch.Tensor) -> Optional[torch.Tensor]:
  """A new lazy tensor (no functionalization wrapper) on `tensor`'s device
  data, or None where `tensor` holds none."""
  with device_data_info_lock:
    _, values = torch_xla._XLAC._get_tensors_xla_device_data_node([tensor], [])
  if len(values) != 1:
    return None
  return inner_value(values[0])


def _keepers_of(
    tensors: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
  """On a mesh, the keeper of each of `tensors` that needs one (see [Note:
  Restores on a mesh]), else None; elsewhere, none."""
  if not xr.is_spmd() or not tensors:
    return []
  pending = torch_xla._XLAC._check_tensor_need_materialization(list(tensors))
  return [
      _on_device_data_of(tensor) if
      (not flag and is_functional(tensor) and not tensor._is_view()) else None
      for tensor, flag in zip(tensors, pending)
  ]


def graph_constants(xla_model: torch.fx.GraphModule) -> List[torch.Tensor]:
  """The XLA tensors the graph reads as attributes of its module (get_attr),
  not as arguments: what dynamo's capture without AOTAutograd makes of a
  tensor held by a plain object (a transformers StaticCache's keys and
  values). A trace that updates one in place must restore it as it restores
  the arguments."""
  constants = []
  seen = set()
  for node in xla_model.graph.nodes:
    if node.op != 'get_attr':
      continue
    value = xla_model
    for part in node.target.split('.'):
      value = getattr(value, part, None)
    if (isinstance(value, torch.Tensor) and value.device.type == 'xla' and
        id(value) not in seen):
      seen.add(id(value))
      constants.append(value)
  return constants


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
      result_index_of_data.setdefault(data_id_of(tensor),
                                      len(result_index_of_data))
  position_of_arg_object = {id(args[i]): i for i in tensor_positions}

  returned_args: List[int] = []
  constants: List[Any] = []
  kinds: List[Tuple[str, int]] = []  # ('result' | 'arg' | 'const', index)
  for index, out in enumerate(outputs):
    if isinstance(out, torch.Tensor):
      data_id = data_id_of(out)
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
                        (pos, result_index_of_data[data_id_of(args[pos])])
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


# Held while torch_xla reads or writes the info of device data that another
# thread's trace may share (the id of the lazy tensor that first read it;
# see [Note: Stand-ins that hold buffers] in placeholder_trace.py): where the
# bridge reads a graph's inputs off the lock, and where aliases of a call's
# buffers are made. Held for one torch_xla call at a time, never while
# waiting for another lock.
device_data_info_lock = threading.Lock()


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
  with device_data_info_lock:
    input_ids, input_values = (
        torch_xla._XLAC._get_tensors_xla_device_data_node(graph_tensors))
  seed_id = torch_xla._XLAC._get_seed_info_id()
  id_to_position = dict(tensor_id_to_position)
  unmatched = []
  for tensor_id, value in zip(input_ids, input_values):
    if tensor_id not in id_to_position and tensor_id != seed_id:
      position = position_of_arg_data.get(data_id_of(value))
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


@dataclasses.dataclass(frozen=True)
class TracedGraph:
  """One signature traced and hashed, not compiled yet."""
  entry: CompiledGraphEntry
  # The tensors whose pending IR is the XLA graph to compile; empty when the
  # graph computes nothing (see OutputPlan.num_results).
  graph_tensors: List[torch.Tensor]


def graph_draws_random_numbers(graph: torch.fx.Graph) -> bool:
  """Whether a node of `graph` calls an aten op that draws from the device's
  random number generator (tagged `torch.Tag.nondeterministic_seeded`): each
  one a trace or a look-ahead runs moves the generator's seed on. A node
  calling an overload packet counts as calling its default overload."""
  for node in graph.nodes:
    if node.op != 'call_function':
      continue
    target = getattr(node.target, 'default', node.target)
    if torch.Tag.nondeterministic_seeded in getattr(target, 'tags', ()):
      return True
  return False


# [Note: Random draws in a trace]
# torch_xla builds the seed of each random draw on the device's seed as a
# chain of IR (a multiply-add per draw since the seed's last data), so a
# program that draws random numbers has another graph hash for every draw
# the device saw before its trace since the last sync, another thread's
# included. A trace of a graph that draws them first ends that chain:
# `set_rng_state(get_rng_state())` makes the running seed the seed's data,
# which gives every later draw the value it would have had (the same random
# numbers) on a chain of its own draws alone. The restart and the trace's
# draws hold _random_draws_lock, so no two traces' draws interleave: a
# signature's program is the same whichever order the compile workers
# trace in, as its serial trace's.
_random_draws_lock = threading.Lock()


@contextlib.contextmanager
def _seed_chain_restarted() -> Iterator[None]:
  with _random_draws_lock:
    xm.set_rng_state(xm.get_rng_state())
    yield


def trace_graph(
    xla_model: torch.fx.GraphModule,
    args: Sequence[Any],
    layout: ArgLayout,
    placeholders: Collection[int] = ()) -> TracedGraph:
  """Lazily traces `xla_model` on `args` and hashes the XLA graph. The
  arguments keep whatever pending IR the trace gave them: callers restore
  them (see pending_ir_restored). `placeholders`: the positions holding a
  placeholder, which has no buffer (see [Note: Traces on placeholders])."""
  tensor_positions = layout.tensor_positions
  tensor_id_to_position = {
      torch_xla._XLAC._xla_get_tensor_id(args[i]): i for i in tensor_positions
  }
  position_of_handle = _positions_by_handle(
      args, [i for i in tensor_positions if i not in placeholders])
  if dynamo_debug:
    print(f'Graph Module:\n{xla_model.code}')
  with (_seed_chain_restarted() if graph_draws_random_numbers(xla_model.graph)
        else contextlib.nullcontext()):
    outputs = _flatten_outputs(xla_model(*args))
  # IR/data identity of each argument after the trace, for aliases among
  # outputs and graph inputs.
  position_of_arg_data = {data_id_of(args[i]): i for i in tensor_positions}
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
    with donor_aliasing():
      graph_hash = torch_xla._XLAC._get_graph_hash(graph_tensors)
  else:
    graph_tensors = []
  entry = CompiledGraphEntry(graph_hash=graph_hash,
                             graph_input_matcher=matcher,
                             output_plan=output_plan,
                             signature=layout.signature_of(args))
  return TracedGraph(entry=entry, graph_tensors=graph_tensors)


def compilable_elsewhere(traced: TracedGraph) -> bool:
  """Whether `traced`, of a trace that updated no argument, can be compiled
  after the arguments are restored, on any thread (see [Note: Compiles
  outside the lock] in signature_cache.py): every tensor of its graph is an
  output the trace computed. An output that is device data (an argument
  returned, a tensor saved for backward) is part of the program's hash,
  and a compile's sync would write its data's info while other threads
  read it."""
  if not traced.graph_tensors:
    return False
  computed = torch_xla._XLAC._check_tensor_need_materialization(
      traced.graph_tensors)
  if False in computed:
    return False
  # What a trace with collectives left for the next one; the compile does
  # not need it.
  torch_xla._XLAC._set_all_reduce_token(str(torch_xla.device()), None)
  return True


def trace_donating(xla_model: torch.fx.GraphModule, args: Sequence[Any],
                   layout: ArgLayout, restore: 'ArgumentsRestore',
                   traced: TracedGraph) -> TracedGraph:
  """`traced`, a trace of `xla_model` on `args`, with donated buffers (see
  [Note: Donating in-place updates] in donation.py): where the graph updates
  arguments itself, they are marked as donors and traced again from the
  arguments `restore` puts back."""
  updated = [
      position for position, _ in traced.entry.output_plan.inplace_updates
  ]
  if (not config.donate_inplace_updates or not updated or
      sets_own_donors(xla_model)):
    return traced
  donated = donatable_positions(args, updated, layout)
  if not donated:
    return traced
  del traced
  restore()
  for position in donated:
    restore.mark_donor(args[position])
  traced = trace_graph(xla_model, args, layout)
  # An argument the graph writes without reading it (module state set with
  # `copy_` from another argument) is no input of the program: there is no
  # buffer to take over, and its result is a buffer of its own.
  inputs = set(traced.entry.graph_input_matcher.arg_idxs)
  donated = tuple(position for position in donated if position in inputs)
  if not donated:
    return traced
  increment_counter(COUNTER_DONATED, len(donated))

  return dataclasses.replace(traced,
                             entry=dataclasses.replace(
                                 traced.entry,
                                 donated_positions=donated,
                                 donation_peers=donation_peers(
                                     args, donated, inputs)))


def donation_peers(args: Sequence[Any], donated: Sequence[int],
                   inputs: Collection[Optional[int]]) -> Tuple[int, ...]:
  """The program's inputs of a donated argument's dtype and size (see
  [Note: Donating in-place updates] in donation.py)."""

  def size(position: int) -> Tuple[torch.dtype, int]:
    return args[position].dtype, args[position].nelement()

  sizes = {size(position) for position in donated}
  return tuple(position for position in sorted(
      p for p in inputs if p is not None) if size(position) in sizes)
