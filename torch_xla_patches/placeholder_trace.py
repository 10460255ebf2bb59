"""Traces on placeholders: a new signature traced and compiled on
placeholders for its arguments, touching none of them, so that it can run
with no lock held (see [Note: Traces on placeholders]); which graphs can be,
and the ops that read values while traced.
"""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch_xla
import torch_xla.runtime as xr

from torch_xla_patches import config, io_utils
from torch_xla_patches.counters import COUNTER_DONATED, increment_counter
from torch_xla_patches.donation import (DonorHold, data_id_of,
                                        donatable_positions, donor_marks,
                                        is_functional, replace_functional_value,
                                        sets_own_donors)
from torch_xla_patches.execution import move_data_note, sync_alone
from torch_xla_patches.signature import ArgLayout, UnsupportedGraphInput
from torch_xla_patches import tracing
from torch_xla_patches.tracing import (CompiledGraphEntry, TracedGraph,
                                       device_data_info_lock, donation_peers,
                                       graph_constants)

# [Note: Traces on placeholders]
# A trace needs the shapes and dtypes of its arguments, never their values
# (nothing runs; CPU fallback ops were split off by the look-ahead before).
# So a new signature of a graph is traced on a placeholder for every tensor
# argument (trace_on_placeholders): io_utils.placeholder, device data of the
# argument's shape and dtype with no buffer (see [Note: Placeholder
# tensors] in io_utils.py). The trace then reads and writes no tensor anyone
# else holds, needs no restore, and runs, with its compile, without
# execution_lock, while other threads run programs that read or donate the
# very tensors it stands for (a parameter, a cache the model holds). The
# program is the one a trace on the arguments makes, with the same hash:
# each placeholder is a parameter of the graph at its argument's position,
# matched to it by the placeholder's id, and at each run the argument's
# buffer is passed there. A donated argument's placeholder carries the donor
# mark (see [Note: Donating in-place updates] in donation.py), which then
# never sits on a buffer anyone holds, and the run takes the argument's
# buffer over. Invariants:
#   * a placeholder never leaves its trace and compile (trace_and_compile in
#     dynamo_bridge.py: both in flight in io_utils.placeholder_traces,
#     begin() to end(), and every placeholder is dropped before the end, a
#     failed trace's included): its IR reads a buffer that does not exist, so
#     nothing may run it. The bridge never syncs it, and a sync of every live
#     tensor waits until no placeholder trace is in flight (see [Note: Syncs
#     wait for placeholder graphs] in io_utils.py);
#   * a trace that fails on placeholders, or cannot start (a sync held it
#     off too long), is made again on the arguments, which raises the
#     trace's own error where it has one.
# Where a placeholder cannot say what the argument is, the arguments
# themselves are traced, under the lock (can_trace_on_placeholders is
# False):
#   * two arguments that share data, a view of another argument, two views
#     of one tensor, or a graph that updates a view (raised after the first
#     trace): the graph would lose that they are one buffer;
#   * tensors the graph reads as attributes of its module (graph_constants),
#     which are not arguments;
#   * under SPMD (shardings), and a graph that marks its own donors;
#   * a graph with an op that reads values while it is traced (an item(),
#     a CPU copy, an op whose output's shape depends on values:
#     VALUE_READING_OPS): running a placeholder's IR reads a buffer that
#     does not exist, and the process dies;
#   * the flag config.trace_on_placeholders is off, or apply() did not
#     install the sync's guard (io_utils.placeholder_traces.guarded).

# [Note: Stand-ins that hold buffers]
# torch_xla compiles a graph whose inputs include device data with no
# buffer (a placeholder) holding its device lock for the whole compile
# (torch's lazy graph walk waits on such data as on a run's result still to
# come), and `_run_cached_graph` waits for that lock holding the GIL: every
# thread of the process stops until the compile is done, measured at the
# compile's length (tools/bench_device_lock.py). So a trace of a call's
# signature, whose arguments hold buffers, stands for each such argument
# with an alias of its buffer instead of a placeholder (BufferAliases): a
# lazy tensor of its own on the argument's device data
# (`_get_tensors_xla_device_data_node`), which the trace reads and writes
# as it would a placeholder, and whose compile takes no device lock. A view
# argument stands for itself with a copy of its values (its own buffer, at
# most _VIEW_COPY_MAX_BYTES; a larger one gets a placeholder); a warm-up's
# placeholders stay placeholders. Invariants:
#   * every alias a trace reads has its IR node made with it, under
#     execution_lock and device_data_info_lock (tracing.py): torch_xla
#     writes into device data, shared by every alias of one buffer (a
#     parameter's by every trace), the id of the lazy tensor that first
#     reads it, replacing what was there. A trace that made that node would
#     write it while another thread's trace read or wrote it (measured: a
#     segmentation fault, two warm-up traces at once); a trace on aliases
#     with their nodes writes no shared info and reads it (the graph's
#     inputs) under device_data_info_lock alone, so traces on aliases run
#     side by side;
#   * the aliases are made and released under execution_lock, where a trace
#     of the arguments reads them too: making one gives its argument the IR
#     node of its own data, which the data ledger takes for a read (see
#     [Note: Donating in-place updates] in donation.py: its next donating
#     run would copy it), so release() gives each such argument its device
#     data back as it was, with the ledger's note of it, unless a run set
#     its data meanwhile; every alias is left a placeholder before the
#     trace leaves flight (drop(): a sync of every live tensor would hand
#     the argument's buffer to an alias the trace wrote to);
#   * matched by buffer handle (see [Note: Matching graph inputs] in
#     tracing.py); an alias the matching did not find is refused
#     (_check_matched), as a constant would be this call's buffer;
#   * a donated argument's alias carries the donor mark onto the argument's
#     buffer, held (see [Note: Donor marks held by traces] in donation.py)
#     until the compile is done or failed, before the trace leaves flight,
#     so no sync of every live tensor (which waits for traces in flight)
#     sees it. A donated argument is the call's own (a
#     request's cache): a program that donates a buffer other threads read
#     meanwhile is a race of the caller's, as with any donating run;
#   * config.trace_on_buffer_aliases off: placeholders for every argument.

# [Note: View copies off the lock]
# A view argument's stand-in is a copy of its values, synced: for a shape
# the device has not copied before, that sync compiles a program (15-19 ms
# for the generation server's (3, 1, 1, 64) attention mask, measured). A
# call's new signature (SignatureCache.on_miss) makes those copies before
# BufferAliases.of, with execution_lock let go, so calls of compiled
# programs on other threads run meanwhile. That is safe because:
#   * the signature is marked compiling before the lock is let go, so
#     another call of it waits for this one instead of tracing it too;
#   * the copy reads the view, which already holds an IR node of its
#     base's data: a donating run of the base on another thread meanwhile
#     takes a private copy instead (the data ledger counts the view as a
#     read, see [Note: Donating in-place updates] in donation.py), and the
#     copy's sync reads the base's old buffer, which the view keeps;
#   * the copy is private and holds no alias: the aliases of the other
#     arguments, and the restores that making them needs, are made after,
#     with the lock taken back, as [Note: Stand-ins that hold buffers] asks.
# A compile-only call (a warm-up's, a replay's) makes its copies under the
# lock, as before: its signature is marked compiling only once its trace is
# submitted, so letting the lock go could trace it twice.

# Bare names of ops, functions and tensor methods that read their inputs'
# values on the host, or whose torch_xla kernels run on the CPU for some
# arguments: a trace or a look-ahead through one runs the graph before it.
VALUE_READING_OPS = frozenset({
    'item', '_local_scalar_dense', 'tolist', 'numpy', 'cpu', '__bool__',
    '__int__', '__float__', 'nonzero', 'nonzero_static', 'argwhere',
    'masked_select', 'unique', '_unique', '_unique2', 'unique_consecutive',
    'unique_dim', 'repeat_interleave', 'bincount', 'histc', 'equal',
    'is_nonzero', 'allclose', 'multinomial', 'randperm', 'bernoulli',
    'bernoulli_', 'normal', 'normal_', 'uniform_', 'random_', 'exponential_',
    'rrelu_with_noise', '_linalg_eigh', 'linalg_inv_ex', '_adaptive_avg_pool2d',
    '_adaptive_avg_pool3d', 'adaptive_max_pool2d', 'max_pool2d_with_indices',
    'max_pool3d_with_indices', '_embedding_bag_forward_only', 'cumprod', 'norm',
    'scatter_reduce', '_adaptive_avg_pool2d_backward',
    '_adaptive_avg_pool3d_backward', 'adaptive_max_pool2d_backward',
    'avg_pool2d_backward', 'avg_pool3d_backward',
    'max_pool2d_with_indices_backward', 'max_pool3d_with_indices_backward',
    'upsample_bilinear2d_backward', 'upsample_nearest2d_backward',
    '_embedding_bag_backward'
})


def _op_name(node: torch.fx.Node) -> str:
  """The bare name of the op a node calls (`nonzero` for `torch.nonzero`,
  `aten.nonzero.default` and the method `x.nonzero()`)."""
  target = node.target
  if isinstance(target, str):
    return target
  schema = getattr(target, '_schema', None)
  if schema is not None:
    return schema.name.split('::')[-1]
  return getattr(target, '__name__', '')


def graph_reads_values(graph: torch.fx.Graph) -> bool:
  """Whether a node of the graph may read tensor values while traced (see
  [Note: Traces on placeholders]); a copy to the CPU among them."""
  for node in graph.nodes:
    if node.op not in ('call_function', 'call_method'):
      continue
    if _op_name(node) in VALUE_READING_OPS:
      return True
    device = node.kwargs.get('device')
    if device is not None and 'cpu' in str(device):
      return True
  return False


# A trace and compile made ready on placeholders, to run with no lock: gives
# the compiled entry, or None where the arguments must be traced after all
# (see [Note: Traces on placeholders]). Its argument: whether it runs on
# the compile pool, where it must never wait for a sync that waits (see
# [Note: Syncs wait for placeholder graphs] in io_utils.py).
DetachedTrace = Callable[[bool], Optional[CompiledGraphEntry]]


def graph_runs_on_placeholders(xla_model: torch.fx.GraphModule) -> bool:
  """What a trace and a look-ahead on placeholders both need of the graph
  and the process: syncs that wait for them, no SPMD, no constant tensors
  (a graph's own state, which a run on the arguments sets back) and no node
  known to read values."""
  return (io_utils.placeholder_traces.guarded() and not xr.is_spmd() and
          not graph_constants(xla_model) and
          not graph_reads_values(xla_model.graph))


def can_trace_on_placeholders(xla_model: torch.fx.GraphModule,
                              args: Sequence[Any], layout: ArgLayout) -> bool:
  """Whether the signature of `args` may be traced on placeholders (see
  [Note: Traces on placeholders])."""
  if (not graph_runs_on_placeholders(xla_model) or sets_own_donors(xla_model)):
    return False
  tensors = [args[i] for i in layout.tensor_positions]
  if any(t.device.type != 'xla' for t in tensors):
    return False
  if len({data_id_of(t) for t in tensors}) != len(tensors):
    return False
  # A view stands alone: its base is no argument, nor the base of another.
  bases = [id(t._base) for t in tensors if t._is_view()]
  return (len(set(bases)) == len(bases) and
          not set(bases) & {id(t) for t in tensors})


def _holds_no_buffer(tensor: torch.Tensor) -> bool:
  """Whether `tensor` is device data with no buffer (a placeholder's, which
  is_placeholder cannot tell of a graph input's value: another tensor)."""
  return 'Data Handle: None' in torch_xla._XLAC._get_xla_tensor_debug_info(
      tensor)


def _alias_of(tensor: torch.Tensor,
              traced: bool = True) -> Optional[torch.Tensor]:
  """A lazy tensor of its own on `tensor`'s device data, or None. A traced
  one gets its IR node here (see [Note: Stand-ins that hold buffers])."""
  _, values = torch_xla._XLAC._get_tensors_xla_device_data_node([tensor], [])
  if len(values) != 1:
    return None
  alias = values[0]
  handles = torch_xla._XLAC._get_tensors_handle([tensor, alias])
  if handles[0] != handles[1]:
    return None
  if traced:
    # Its first read writes the shared device data's info: here, not in the
    # trace.
    torch_xla._XLAC._get_tensors_xla_device_data_node([alias], [])
  return alias


# The largest view a trace on placeholders copies to stand for it (see [Note:
# Stand-ins that hold buffers]); a larger one has a placeholder.
_VIEW_COPY_MAX_BYTES = 1 << 20


def _copy_of_view(view: torch.Tensor) -> Optional[torch.Tensor]:
  """A buffer of its own with `view`'s values, or None for a view too large
  to copy."""
  if view.nelement() * view.element_size() > _VIEW_COPY_MAX_BYTES:
    return None
  copy = torch.clone(view)
  sync_alone([copy])
  return copy


def copies_of_views(
    args: Sequence[Any],
    positions: Sequence[int]) -> Dict[int, Optional[torch.Tensor]]:
  """position -> the copy BufferAliases.of would make of the view argument
  there (None for one too large), for each view argument at `positions`.
  Made ahead of BufferAliases.of with execution_lock let go: the copy's
  sync compiles a program of its own for each new shape (see [Note: View
  copies off the lock])."""
  if not config.trace_on_buffer_aliases:
    return {}
  return {
      position: _copy_of_view(args[position])
      for position in positions
      if args[position]._is_view()
  }


@dataclasses.dataclass(frozen=True)
class _Restore:
  """An argument that building its aliases left read (see [Note: Stand-ins
  that hold buffers])."""
  data_id: str  # the argument's data id the aliases left it
  keeper: torch.Tensor  # an alias to give it back, which nothing traced
  key: int  # the argument's lazy tensor id before, in the data ledger


@dataclasses.dataclass
class BufferAliases:
  """Aliases of the buffers of a call's arguments, for a trace on
  placeholders to stand for them (see [Note: Stand-ins that hold buffers]):
  made and released under execution_lock, used with it let go."""
  # position -> one alias for each of the two traces (the first, the
  # donating one), for each argument that holds a buffer of its own.
  by_position: Dict[int, Tuple[torch.Tensor, torch.Tensor]]
  restores: Dict[int, _Restore]
  # The device data handles of the aliased buffers.
  handles: Set[int]
  # position -> the donating trace's hold on the donor mark of its stand-in
  # there (see [Note: Donor marks held by traces] in donation.py).
  marks: Dict[int, DonorHold] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, args: Sequence[Any], positions: Sequence[int],
         view_copies: Dict[int, Optional[torch.Tensor]]) -> 'BufferAliases':
    """`view_copies`: copies_of_views of the same arguments, made before."""
    by_position: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    restores: Dict[int, _Restore] = {}
    if not config.trace_on_buffer_aliases:
      return cls(by_position, restores, set())
    tensors = [args[position] for position in positions]
    pending = torch_xla._XLAC._check_tensor_need_materialization(tensors)
    held = []
    for position, tensor, flag in zip(positions, tensors, pending):
      if tensor._is_view():
        # Private: no data info to share.
        copy = view_copies[position]
        if copy is not None:
          by_position[position] = (copy, _alias_of(copy))
      elif not (flag or io_utils.is_placeholder(tensor) or
                _holds_no_buffer(tensor)):
        held.append((position, tensor))
    with device_data_info_lock:
      for position, tensor in held:
        before = data_id_of(tensor)
        key = torch_xla._XLAC._xla_get_tensor_id(tensor)
        first = _alias_of(tensor)
        if first is None:
          continue
        by_position[position] = (first, _alias_of(tensor))
        after = data_id_of(tensor)
        if after != before and is_functional(tensor):
          restores[position] = _Restore(data_id=after,
                                        keeper=_alias_of(tensor, traced=False),
                                        key=key)
    handles = set(
        torch_xla._XLAC._get_tensors_handle([
            first for first, _ in by_position.values()
        ])) if by_position else set()
    return cls(by_position, restores, handles)

  def stand_ins(self, args: Sequence[Any], positions: Sequence[int],
                donating: bool) -> 'StandIns':
    """The stand-ins of one trace: an alias where the argument holds a
    buffer, else a placeholder."""
    replaced = list(args)
    placeholders = []
    for position in positions:
      aliases = self.by_position.get(position)
      if aliases is None:
        replaced[position] = io_utils.placeholder(args[position].shape,
                                                  args[position].dtype)
        placeholders.append(position)
      else:
        replaced[position] = aliases[1 if donating else 0]
    return StandIns(args=replaced, placeholders=tuple(placeholders))

  def mark_donor(self, position: int, stand_in: torch.Tensor) -> None:
    """Marks the buffer of `stand_in`, the donating trace's at `position`,
    as a donor until let_go_marks (an alias's is the argument's)."""
    self.marks[position] = donor_marks.hold(stand_in)

  def let_go_marks(self, positions: Optional[Sequence[int]] = None) -> None:
    """Lets go of the donor marks at `positions` (all by default), once the
    compile is done or has failed."""
    for position in list(self.marks if positions is None else positions):
      if position in self.marks:
        donor_marks.let_go(self.marks.pop(position))

  def drop(self) -> None:
    """Lets go of the donor marks, then leaves each alias a placeholder,
    before the trace leaves flight: an alias a trace wrote to holds IR that
    updates the argument's buffer, which torch_xla names by the alias, so a
    sync of every live tensor that found it would hand that buffer over to
    it (measured: the argument's next use failed, its buffer deleted)."""
    self.let_go_marks()
    for aliases in self.by_position.values():
      for alias in aliases:
        torch_xla._XLAC._replace_xla_tensor(
            alias, io_utils.placeholder(alias.shape, alias.dtype))
    self.by_position.clear()

  def release(self, args: Sequence[Any]) -> None:
    """Drops the aliases (if drop() did not) and gives an argument left read
    its device data back, with the data ledger's note, unless something set
    its data since. Under execution_lock."""
    self.drop()
    for position, restore in self.restores.items():
      tensor = args[position]
      if data_id_of(tensor) == restore.data_id:
        # The same values: no update for its views to replay (a commit
        # would make each view's next use pending IR, synced by a compile).
        replace_functional_value(tensor, restore.keeper)
        move_data_note(restore.key, tensor)
    self.restores.clear()


@dataclasses.dataclass(frozen=True)
class StandIns:
  """What a trace on placeholders traces on, by argument position."""
  args: List[Any]
  # The positions holding a placeholder; every other tensor position holds
  # an alias of its argument's buffer.
  placeholders: Tuple[int, ...]


def _check_matched(traced: TracedGraph, aliases: BufferAliases) -> None:
  """Raises where a stand-in the matching did not find would be a constant
  of the program, passed to every run: a buffer that does not exist, or the
  buffer of this call's argument, read by every later call."""
  for value in traced.entry.graph_input_matcher.graph_input_xla_values:
    if value is not None and (_holds_no_buffer(value) or
                              torch_xla._XLAC._get_tensors_handle(
                                  [value])[0] in aliases.handles):
      raise UnsupportedGraphInput(
          'a stand-in was not matched to its argument; tracing the '
          'arguments')


def trace_on_placeholders(xla_model: torch.fx.GraphModule, args: Sequence[Any],
                          layout: ArgLayout,
                          aliases: BufferAliases) -> TracedGraph:
  """Traces the signature of `args` on placeholders for them, with donated
  buffers where the graph updates arguments (see [Note: Donating in-place
  updates] in donation.py), touching no argument (see [Note: Traces on
  placeholders]; can_trace_on_placeholders said so). The graph's tensors
  are those computed. Call it in flight (io_utils.placeholder_traces)."""
  positions = layout.tensor_positions
  stand_ins = aliases.stand_ins(args, positions, donating=False)
  traced = tracing.trace_graph(xla_model, stand_ins.args, layout,
                               stand_ins.placeholders)
  del stand_ins
  updated = [
      position for position, _ in traced.entry.output_plan.inplace_updates
  ]
  if any(args[position]._is_view() for position in updated):
    # Its stand-in is no view: the update would not reach the view's base.
    raise UnsupportedGraphInput(
        'the graph updates a view argument; tracing the arguments')
  donated = (donatable_positions(args, updated, layout)
             if config.donate_inplace_updates and updated else ())
  peers: Tuple[int, ...] = ()
  if donated:
    # The first trace updated its stand-ins: trace again on fresh ones.
    del traced
    stand_ins = aliases.stand_ins(args, positions, donating=True)
    try:
      for position in donated:
        aliases.mark_donor(position, stand_ins.args[position])
      traced = tracing.trace_graph(xla_model, stand_ins.args, layout,
                                   stand_ins.placeholders)
      del stand_ins
      # See trace_donating: an argument written without being read is no
      # input of the program.
      inputs = set(traced.entry.graph_input_matcher.arg_idxs)
      _check_matched(traced, aliases)
    except BaseException:
      aliases.let_go_marks(donated)
      raise
    aliases.let_go_marks(
        [position for position in donated if position not in inputs])
    donated = tuple(position for position in donated if position in inputs)
  else:
    _check_matched(traced, aliases)
  if donated:
    # Counted once the trace is kept (the arguments' trace counts its own).
    increment_counter(COUNTER_DONATED, len(donated))
    peers = donation_peers(args, donated, inputs)
  computed = torch_xla._XLAC._check_tensor_need_materialization(
      traced.graph_tensors) if traced.graph_tensors else []
  # What a trace with collectives left for the next one; the compile does
  # not need it.
  torch_xla._XLAC._set_all_reduce_token(str(torch_xla.device()), None)
  return TracedGraph(
      entry=dataclasses.replace(traced.entry,
                                signature=layout.signature_of(args),
                                donated_positions=tuple(donated),
                                donation_peers=peers),
      graph_tensors=[
          t for t, flag in zip(traced.graph_tensors, computed) if flag
      ],
  )
