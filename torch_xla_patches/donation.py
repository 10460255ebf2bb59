"""Donation: which arguments a program takes the buffers of, what is known of
each argument's buffer (the data ledger), readying a donating run and taking
its results over. See [Note: Donating in-place updates]. And a
functionalization wrapper's value, replaced and committed (take_result,
commit_value), for the modules above it too.
"""
import collections
import contextlib
import dataclasses
import threading
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

import torch
import torch_xla
import torch_xla.runtime as xr
import torch_xla.utils.dlpack as xla_dlpack

from torch_xla_patches import config, native
from torch_xla_patches.counters import (
    COUNTER_DONATION_ALIAS, COUNTER_DONATION_COPIED,
    COUNTER_DONATION_COPIED_READ, COUNTER_DONATION_EPILOGUE,
    COUNTER_DONATION_READERS_SYNCED, COUNTER_DONATION_SMALL,
    COUNTER_DONATION_VIEW, increment_counter)
from torch_xla_patches.execution import (KNOWN_DATA_LIMIT, data_id_of,
                                         device_name, extracted_once,
                                         known_data, note_data, sync_alone)
from torch_xla_patches.io_utils import TensorSpec
from torch_xla_patches.signature import ArgLayout

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
#     tensor. Only an argument of the donated one's dtype and number of
#     elements can share its data (a device buffer has one shape): the entry
#     lists those positions once (donation_peers), and a call reads the data
#     ids of those alone. A bound program (serve()'s fast path) makes no such
#     check: a served call whose arguments alias fails its capture's guards
#     and is captured again, so it answers right;
#   * anything else that holds the buffer got it by building on the
#     argument: pending IR that reads it (`cache * 2`), a view, a tensor that
#     took it with `copy_` (torch_xla shares the device data, it copies
#     nothing). Building on a tensor gives it an IR node of its device data,
#     which it keeps until its data is set again, and a tensor's data id
#     names that node while it has one. So at each donating call, a donated
#     argument is, by what the data ledger (execution.py) knows of its
#     buffer:
#       - given: it holds, without IR, data no one else holds, noted by the
#         tensor's unique id with its data id: the data a run gave it
#         (take_result), or a buffer a sync of the bridge computed for it
#         alone from its own pending IR (the sync of a run's inputs,
#         execution.sync_pending_inputs, and of a trace's arguments,
#         sync_alone_noting_reads; what read that pending IR reads the
#         computation, not the buffer). Donated as is, with no look at the
#         rest of the device: a decode loop runs so at every step, from the
#         first on caches just made on the device (`torch.zeros(...,
#         device=...)`, not synced).
#       - given, with IR: under SPMD a run's results come with an IR node of
#         their own (torch_xla's, for the sharding), which reads then build
#         on without changing the data id, so a read leaves no trace. The
#         device's pending IR is synced first (counted): there a read, copy_
#         included, is pending IR until a sync computes it into a buffer of
#         its own, so the sync leaves no one else the buffer. It is the one
#         sync of more than a run's own arguments (see [Note: Threads] in
#         execution.py).
#       - any other: moved onto a private copy before the run (counted; see
#         [Note: Moving onto a private copy]), and the old buffer stays with
#         whatever may hold it. It has IR (it was read
#         since its data was set); or its data was noted as read before a
#         sync dropped its IR (a tensor moved to the device with `to` holds
#         its data in an IR node until a sync; the sync before a trace and
#         the restore after it drop the IR of the arguments); or the caller
#         set its data where the bridge did not see it (made on the device
#         and synced, written in place and synced). Such data may have
#         pending readers with no trace on the argument (`cache * 2` built
#         on a tensor moved with `to`, which `cache.cpu()` then made hold
#         that data without IR), found only by looking at every live tensor
#         of the device, which races with other threads' tensors (see [Note:
#         Threads] in execution.py). So a read costs one copy, that step, and
#         a cache the caller set one copy, at its first step.
#     A tensor that took another's data with `copy_` and was then synced
#     holds that data without IR (torch_xla shares a device data node's data
#     on a copy_ within the device, and a sync of it computes nothing): data
#     the caller set, copied.
#   * The argument takes its updated data from the run's result
#     (take_result) as functionalization's in-place ops do, which leaves it
#     given.
#   * Under torch.compile, an inference graph that AOTAutograd compiles
#     with keep_inference_input_mutations (the openxla backend as apply()
#     sets it up) keeps its updates, as dynamo's graph under serve() does.
#     A graph that needs autograd leaves them to AOTAutograd's epilogue,
#     which writes them with `copy_` after the run: those arguments are
#     never donated (counted as COUNTER_DONATION_EPILOGUE). The `copy_`
#     leaves an argument holding data the bridge cannot vouch for at every
#     call, so donating it would cost a private copy of it before every run:
#     a training step's forward would be slower than without donation, for
#     buffers (BatchNorm's running statistics) a few values wide.
#   * A graph that marks its own donors (torch.ops.xla.dynamo_set_buffer_
#     donor_, upstream's manual donation) is compiled as written.
# A view or alias of a donated argument made by torch_xla (`cache[:16]`,
# `cache.detach()`) follows the argument's new data, as after any run.

# The FX graph's meta key under which record_mutated_inputs leaves
# AOTAutograd's mutated inputs for the bridge.
MUTATED_INPUTS_META = 'torch_xla_patches_mutated_inputs'


def record_mutated_inputs(helper: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps torch's `xla_backend_helper` (what the openxla backends call with
  each graph AOTAutograd compiles) so that the graph carries the positions of
  the inputs AOTAutograd's epilogue updates from its first outputs, which are
  never donated (see [Note: Donating in-place updates]): the bridge counts them.
  The callable it returns hands the graph to the bridge on its first call,
  as `helper`'s does, once (execution.extracted_once)."""
  del helper  # Its callable would let every thread hand the graph over.

  def xla_backend_helper(model, fake_tensor_inputs, boxed=False):
    del fake_tensor_inputs
    mutated = aot_autograd_mutated_inputs()
    if mutated and _outputs_match_inputs(model, mutated):
      model.meta[MUTATED_INPUTS_META] = mutated
    import torch_xla.core.dynamo_bridge as bridge
    return extracted_once(
        model, lambda graph, args: bridge.extract_compiled_graph(graph, args),
        boxed)

  return xla_backend_helper


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


def donatable_positions(args: Sequence[Any], positions: Sequence[int],
                        layout: ArgLayout) -> Tuple[int, ...]:
  """The positions among `positions` (updated arguments) that may be
  donated (see [Note: Donating in-place updates]); counts the others by
  reason."""
  positions_of_data: Dict[int, List[int]] = collections.defaultdict(list)
  for position in layout.tensor_positions:
    positions_of_data[data_id_of(args[position])].append(position)
  donated = []
  for position in positions:
    tensor = args[position]
    if not isinstance(tensor, torch.Tensor):
      continue
    if tensor._is_view():
      increment_counter(COUNTER_DONATION_VIEW, 1)
    elif len(positions_of_data[data_id_of(tensor)]) > 1:
      increment_counter(COUNTER_DONATION_ALIAS, 1)
    elif tensor.nelement() * tensor.element_size() < config.donate_min_bytes:
      increment_counter(COUNTER_DONATION_SMALL, 1)
    else:
      donated.append(position)
  return tuple(donated)


def count_epilogue_updates(xla_model: torch.fx.GraphModule) -> None:
  """Counts, per traced signature, the inputs AOTAutograd's epilogue updates
  (see record_mutated_inputs): never donated (see [Note: Donating in-place
  updates])."""
  updated = xla_model.meta.get(MUTATED_INPUTS_META, ())
  if updated and config.donate_inplace_updates:
    increment_counter(COUNTER_DONATION_EPILOGUE, len(updated))


def sets_own_donors(xla_model: torch.fx.GraphModule) -> bool:
  """Whether the graph marks buffer donors itself
  (torch.ops.xla.dynamo_set_buffer_donor_): it is compiled as written."""
  return any(node.op == 'call_function' and
             'dynamo_set_buffer_donor_' in str(node.target)
             for node in xla_model.graph.nodes)


def clear_donor_mark(tensor: torch.Tensor) -> None:
  """Clears a donor mark the bridge's trace left on `tensor`'s data (only
  one that is there: torch_xla counts every call that sets a mark, as
  XlaSetBufferDonation)."""
  if torch_xla._XLAC._get_buffer_donation(tensor):
    torch_xla._XLAC._set_buffer_donation(tensor, False)


# [Note: Donor marks held by traces]
# A donor mark sits on a buffer's device data, which every alias of the
# buffer shares (see [Note: Stand-ins that hold buffers] in
# placeholder_trace.py), and the graph hash and the program of every trace
# and compile that reads the buffer include it while it is there. Two traces
# that donate one buffer at once (a call's trace on aliases, with no lock,
# and a replay's trace of the arguments, under execution_lock) each need the
# mark from their trace until their compile is done: one clearing it while
# the other compiled changed the other's program, whose hash was then no
# entry's (its first run found no program and traced again). So the bridge
# marks a buffer it shares for a trace only through DonorMarks, which counts
# the holds on each buffer: the first hold sets the mark, the last one let
# go clears it. Invariants:
#   * a hold names its buffer by the handle it had when taken, and is let go
#     with a tensor that still refers to that device data (the alias that
#     took it, or the argument the trace's restore gave it back);
#   * a mark that no trace of the bridge holds (a user's, one a graph sets
#     itself with dynamo_set_buffer_donor_) is left where it is: the program
#     then donates that buffer, as upstream's bridge compiles it;
#   * torch_xla's alias-with-buffer-donor flag, which makes the marks part
#     of a hash and a program, is process-wide too: the bridge turns it on
#     only through donor_aliasing, which keeps it on while any trace or
#     compile of the bridge is inside.
@dataclasses.dataclass(frozen=True)
class DonorHold:
  """One trace's hold on a buffer's donor mark (DonorMarks.hold)."""
  # A tensor on the marked device data, to clear the mark through.
  tensor: torch.Tensor
  # The buffer's handle when the hold was taken; None for a placeholder,
  # whose data no one shares.
  handle: Optional[int]


class DonorMarks:
  """The donor marks the bridge's traces hold on shared buffers (see [Note:
  Donor marks held by traces])."""

  def __init__(self):
    self._lock = threading.Lock()
    # Buffer handle -> the number of holds on its mark.
    self._holds: Dict[int, int] = {}

  def hold(self, tensor: torch.Tensor) -> DonorHold:
    """Marks `tensor`'s buffer as a donor for one more trace."""
    with self._lock:
      handle = _buffer_handle(tensor)
      if handle is not None:
        self._holds[handle] = self._holds.get(handle, 0) + 1
      torch_xla._XLAC._set_buffer_donation(tensor, True)
      return DonorHold(tensor=tensor, handle=handle)

  def let_go(self, hold: DonorHold) -> None:
    """Lets go of `hold`; clears the mark when it was the buffer's last."""
    with self._lock:
      if hold.handle is not None:
        left = self._holds[hold.handle] - 1
        if left:
          self._holds[hold.handle] = left
          return
        del self._holds[hold.handle]
      clear_donor_mark(hold.tensor)

  def held(self) -> int:
    """How many buffers some trace holds a mark on."""
    with self._lock:
      return len(self._holds)


class _DonorAliasing:
  """torch_xla's alias-with-buffer-donor flag, on while any of the bridge's
  traces or compiles needs it (see [Note: Donor marks held by traces]).
  torch_xla's alias_with_buffer_donor_config puts back the value it found,
  which is process-wide: a compile on one thread that ended put it off
  under another thread's compile, whose program then took no donation."""

  def __init__(self):
    self._lock = threading.Lock()
    self._users = 0
    self._before = False

  @contextlib.contextmanager
  def __call__(self) -> Iterator[None]:
    with self._lock:
      if not self._users:
        self._before = (
            torch_xla._XLAC._xla_get_enable_alias_with_buffer_donor_config())
        torch_xla._XLAC._xla_set_enable_alias_with_buffer_donor_config(True)
      self._users += 1
    try:
      yield
    finally:
      with self._lock:
        self._users -= 1
        if not self._users:
          torch_xla._XLAC._xla_set_enable_alias_with_buffer_donor_config(
              self._before)


# Buffer-donor aliasing on for a trace's hash or a compile, whatever other
# threads' traces and compiles begin or end meanwhile.
donor_aliasing = _DonorAliasing()


def _buffer_handle(tensor: torch.Tensor) -> Optional[int]:
  """The handle of `tensor`'s buffer; None for a tensor with no buffer (a
  placeholder)."""
  try:
    return torch_xla._XLAC._get_tensors_handle([tensor])[0]
  except RuntimeError:
    return None


donor_marks = DonorMarks()


def _sync_pending_readers() -> None:
  """Syncs the pending IR of the device: it may read a buffer a run takes
  over whose reads leave no trace (a run's result under SPMD, see [Note:
  Donating in-place updates])."""
  increment_counter(COUNTER_DONATION_READERS_SYNCED, 1)
  torch_xla._XLAC._xla_sync_live_tensors(device_name(), [], True)


def read_since_set(tensor: torch.Tensor) -> bool:
  """Whether torch_xla built IR on `tensor` since its device data was set
  (see [Note: Donating in-place updates]); False for a tensor off the XLA
  device."""
  return tensor.device.type == 'xla' and _was_read(data_id_of(tensor))


def _was_read(data_id: str) -> bool:
  # torch_xla names a tensor by its IR node and output index while it has
  # one ("<node>, <index>"), else by its device data.
  return ',' in data_id


# The data ledger (execution.known_data), read and written here as
# _known_data: see [Note: Donating in-place updates].
_known_data = known_data
_KNOWN_DATA_LIMIT = KNOWN_DATA_LIMIT


def maybe_read(tensor: torch.Tensor) -> bool:
  """Whether something may hold `tensor`'s buffer: it has IR, its data was
  noted as read, or the data ledger does not vouch for it (see given_data)."""
  return tensor.device.type == 'xla' and given_data(
      tensor, data_id_of(tensor), forget=False) is False


def given_data(tensor: torch.Tensor,
               data_id: str,
               forget: bool = True) -> Optional[bool]:
  """True if `tensor` (whose data_id_of is `data_id`) holds data the ledger
  notes as given (a run gave it, or a sync of the bridge computed it for the
  tensor alone) and nothing read since; None if that data came in an IR node
  of its own (a run's result under SPMD), which reads leave no trace on;
  False otherwise: its buffer may be held elsewhere (it was read, or it holds
  data the caller set, which the ledger does not vouch for). Forgets the
  tensor's entry unless told not to: the run about to take its buffer over
  gives it new data."""
  key = torch_xla._XLAC._xla_get_tensor_id(tensor)
  known = _known_data.pop(key, None) if forget else _known_data.get(key)
  if known is not None and known[0] == data_id and known[1]:
    return None if _was_read(data_id) else True
  return False


def read_donations(tensors: List[torch.Tensor], data_ids: Optional[List[str]],
                   copy_if_read: List[bool]) -> List[int]:
  """Readies the buffers a run is about to take over, of `tensors` (whose
  data_id are `data_ids`, or None to read them here) (see [Note: Donating
  in-place updates]): the indices of those whose buffer may be held
  elsewhere (read since their data was set, or data the caller set), which
  the run takes a private copy of where `copy_if_read` says so. The device's
  pending IR is synced first if any other holds given data whose reads leave
  no trace (a run's result under SPMD), or may be held elsewhere where no
  copy is taken. The native module decides where it is loaded; its decision
  is this loop's."""
  helpers = native.loaded()
  if helpers is not None:
    read, sync_readers = helpers.read_donations(tensors, data_ids, copy_if_read,
                                                _known_data)
  else:
    read = []
    sync_readers = False
    for index, tensor in enumerate(tensors):
      data_id = data_id_of(tensor) if data_ids is None else data_ids[index]
      given = given_data(tensor, data_id)
      if given:
        continue
      if given is False and copy_if_read[index]:
        read.append(index)
      else:
        sync_readers = True
  if sync_readers:
    _sync_pending_readers()
  return read


class PrivateCopyLost(RuntimeError):
  """A donated argument let go of its buffer to move onto a private copy
  made through the host, and neither the copy nor the argument's values
  could be put back on the device (see [Note: Moving onto a private copy])."""


def _copies_through_host(tensor: torch.Tensor) -> bool:
  """Whether `tensor`'s private copy is made through the host."""
  # A 0-dim tensor sent from the host is a scalar torch_xla transfers
  # asynchronously, which a run then refuses as in flight.
  return (not _was_read(data_id_of(tensor)) and not xr.is_spmd() and
          tensor.dim() > 0)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
  """`tensor`'s values in a CPU tensor of their own."""
  # `cpu()` of device data reads it without waiting: the result of a run
  # still in flight has no value yet ("Trying to access XLA data while an
  # async operation is in flight"). The wait takes torch_xla's device lock,
  # after execution_lock in the lock order ([Note: Threads] in
  # execution.py).
  torch_xla._XLAC._xla_wait_device_ops([])
  if xr.device_type() == 'CPU':
    # The CPU client's buffers are host memory, which a DLPack view reads
    # in place: one copy of the values, where `cpu()` holds two at its peak
    # (an XLA literal, then the tensor made from it).
    return torch.from_dlpack(xla_dlpack.to_dlpack(tensor)).clone()
  return tensor.cpu()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
  """The host copy `host` sent to the XLA `device`, in a buffer of the
  device's own: a run would not donate a DLPack view of host memory (it
  writes its result to a new buffer instead)."""
  return host.to(device)


def private_copy(tensor: torch.Tensor) -> torch.Tensor:
  """A copy of `tensor` in a buffer of its own, for a donating run (see
  [Note: Donating in-place updates]). A tensor read since its data was set
  (it has IR) is copied on the device, as the program without donation
  would copy it at every call: a lazy clone reads the same device data
  until a sync computes it. Any other (data noted as read before a sync
  dropped its IR, as for a tensor just moved with `to`; data the caller
  set; an alias of another argument) goes through the host, which compiles
  nothing: XLA compiles a clone per shape, more programs than the calls
  compile without donation. Under SPMD the copy stays on the device,
  sharded as the tensor is, and so does a 0-dim tensor."""
  if _copies_through_host(tensor):
    copy = _to_device(_host_copy(tensor), tensor.device)
  else:
    copy = torch.clone(tensor)
  sync_alone([copy])
  return copy


def move_to_private_copy(tensor: torch.Tensor) -> torch.Tensor:
  """What a donating run takes over in place of `tensor`, whose buffer
  something else may hold: `tensor` itself, moved onto a private copy of its
  data (see [Note: Moving onto a private copy]); a private copy alone where
  `tensor` is no functionalization wrapper.

  [Note: Moving onto a private copy]
  The run donates a private copy, and the argument takes the run's result
  after it, so the argument's old buffer is left to whatever else holds it.
  Were the argument to keep that buffer until the run is done, every
  argument copied for a run (each layer's cache, at a first step on caches
  the caller set) would be alive twice at the run's start. So each one
  takes its copy over as the copy is made, before the next is made, as it
  takes a run's result (take_result: functionalization's storage drops its
  old base only so), and whatever holds the old buffer (a view's or a
  pending reader's IR, a tensor that took it with copy_) keeps it, while a
  buffer nothing else holds goes. The copy holds the same values, was
  synced alone and is held by nothing else: given, in the data ledger.
  A copy made on the device is alive beside the old buffer until the
  argument takes it over. A copy made through the host is made in two
  halves with the buffer let go between them: the values come to the
  host, the argument lets go of its buffer (it takes lazy zeros of its
  size, which hold no buffer), and only then is the host copy sent to the
  device. So a buffer nothing else holds is gone before its copy is made,
  and the device never holds two of it; the host holds one argument's
  values at a time. On the CPU client, whose buffers are host memory, the
  values come to the host through a DLPack view, in one copy. Between the
  halves the argument holds zeros; like any argument of a call in flight
  it is not to be read by another thread meanwhile. Should the copy fail
  to reach the device (its memory full), the values are sent once more;
  if that fails too, PrivateCopyLost says the argument lost them.
  Arguments that share their data with another argument of the run do not
  move (see prepare_donating_run): the other would move with them, and the
  run would read the buffer it donates."""
  if not is_functional(tensor):
    return private_copy(tensor)
  if not _copies_through_host(tensor):
    take_result(tensor, private_copy(tensor))
    return tensor
  host = _host_copy(tensor)
  _let_go_of_data(tensor)
  copy = None
  try:
    copy = _to_device(host, tensor.device)
  finally:
    if copy is None:
      _give_values_back(tensor, host)
  sync_alone([copy])
  take_result(tensor, copy)
  return tensor


def _let_go_of_data(tensor: torch.Tensor) -> None:
  """The functionalization wrapper `tensor` takes lazy zeros of its size
  and dtype, which hold no buffer, as an update its views replay, and
  drops its old value: its buffer goes unless something else holds it."""
  zeros = torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
  commit_value(tensor, zeros)


def _give_values_back(tensor: torch.Tensor, host: torch.Tensor) -> None:
  """After a failed move through the host, `tensor` takes `host`'s values
  again, or PrivateCopyLost says it could not."""
  try:
    take_result(tensor, _to_device(host, tensor.device))
  except BaseException as error:
    raise PrivateCopyLost(
        f'a donated argument ({TensorSpec.of(tensor).describe()}) let go of its buffer to '
        'move onto a private copy, and neither the copy nor its values '
        f'could be sent to the device again ({error}); it holds zeros now: '
        'set its values again before using it') from error


def prepare_donating_run(entry: 'CompiledGraphEntry',
                         args: Sequence[Any]) -> Sequence[Any]:
  """The arguments to run a donating entry with (see [Note: Donating
  in-place updates]): a donated argument whose buffer something else may
  hold is replaced by a private copy."""
  # The program's aliasing was fixed when it compiled. A donor mark left on
  # an argument's data would let a sync hand its buffer to another
  # computation, or this run donate it twice.
  for position in entry.donated_positions:
    clear_donor_mark(args[position])
  data_ids = {
      position: data_id_of(args[position]) for position in entry.donation_peers
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
  for index in read_donations([args[position] for position in taken],
                              [data_ids[position] for position in taken],
                              [True] * len(taken)):
    copied[taken[index]] = COUNTER_DONATION_COPIED_READ
  if not copied:
    return args
  run_args = list(args)
  for position, counter in copied.items():
    increment_counter(counter, 1)
    run_args[position] = (private_copy(args[position])
                          if counter == COUNTER_DONATION_COPIED else
                          move_to_private_copy(args[position]))
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
  commit_value(tensor, result, drop_update_log)
  note_data(result, given=True)


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


def sync_alone_noting_reads(tensors: Sequence[torch.Tensor]) -> None:
  """sync_alone, noting in the data ledger what the sync gave each tensor
  (see [Note: Donating in-place updates]): a tensor with pending IR of its
  own gets a buffer the sync computes for it alone, given; a tensor whose
  data sat in an IR node (one just moved to the device, which something may
  have read) holds that data itself and loses the node, read."""
  flags = torch_xla._XLAC._check_tensor_need_materialization(list(tensors))
  computed = [t for t, flag in zip(tensors, flags) if flag]
  read = [
      t for t, flag in zip(tensors, flags) if not flag and read_since_set(t)
  ]
  sync_alone(tensors)
  for tensor in computed:
    note_data(tensor, given=True)
  for tensor in read:
    if not read_since_set(tensor):
      note_data(tensor, given=False)


def is_functional(tensor: torch.Tensor) -> bool:
  """Whether `tensor` is a functionalization wrapper."""
  return torch._is_functional_tensor(tensor)


def inner_value(tensor: torch.Tensor) -> torch.Tensor:
  """The lazy tensor inside the functionalization wrapper `tensor`, or
  `tensor` itself."""
  if torch._is_functional_tensor(tensor):
    return torch._from_functional_tensor(tensor)
  return tensor


def commit_value(tensor: torch.Tensor,
                 value: torch.Tensor,
                 drop_update_log: bool = True) -> None:
  """Gives the functionalization wrapper `tensor` the lazy tensor `value`
  as an update its views replay (replace and commit), and drops the update
  log unless told not to (see [Note: Taking a result]); nothing runs. A
  run's result is taken so (take_result), a restore gives back the data
  held before a trace so ([Note: Restores on a mesh] in tracing.py), and a
  move onto a private copy lazy zeros ([Note: Moving onto a private
  copy])."""
  replace_functional_value(tensor, value)
  torch._functionalize_commit_update(tensor)
  if drop_update_log:
    apply_view_updates(tensor)


def apply_view_updates(tensor: torch.Tensor) -> None:
  """Brings the functionalization wrapper `tensor`'s value up to date with
  the updates its views and aliases logged, and drops the log
  (functionalization's sync: nothing runs on the device)."""
  torch._functionalize_sync(tensor)


def replace_functional_value(tensor: torch.Tensor, value: torch.Tensor) -> None:
  """Gives the functionalization wrapper `tensor` the lazy tensor inside
  `value` (or `value` itself) as its value, logging no update: for a value
  that holds the same data, which its views need not replay."""
  torch._functionalize_replace(tensor, inner_value(value))
