"""Running compiled programs: the lock every run holds, the run itself with
its refusals, and the syncs of a run's inputs.

[Note: Threads] says what `execution_lock` guards. `run_program` turns
`_run_cached_graph`'s refusals before running (an input with pending IR, an
evicted program), told apart by their message text, into RefusedBeforeRun.
"""
import contextlib
import functools
import threading
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

import torch
import torch_xla

from torch_xla_patches.counters import COUNTER_SYNCED_INPUTS, increment_counter

_EVICTED_MESSAGE = 'Failed to get computation by hash'
_PENDING_IR_MESSAGE = 'can not be a pending ir'

# [Note: Threads]
# Any number of threads may call compiled graphs, of one model or of many.
# torch_xla's lazy tensors take threads; the bridge's state of a graph does
# not on its own: the hand-over of a graph to the bridge (upstream's
# xla_backend_helper does it on the first call and then deletes the graph),
# the signature cache and its LRU order, the backlog, the usage log. So every
# call of a compiled graph, from its look-up to its outputs (look-up, run,
# usage, backlog), holds one process-wide reentrant lock, `execution_lock`.
# The key comes before the lock, from the call's arguments alone, and so
# does the sync of the call's own inputs that have pending IR (a compile of
# its own where they have a new shape: sync_before_the_lock). One
# device runs one program at a time anyway, and the host work under the
# lock is that of a single-threaded call. What makes a program does not hold
# it where it can help: a new signature is traced on placeholders for its
# arguments (aliases of their buffers, see [Note: Stand-ins that hold
# buffers]) and compiled with the lock let go (see [Note: Traces on
# placeholders] in placeholder_trace.py and [Note: Compiles outside the lock] in
# signature_cache.py), a graph's first signature compiles on the compile
# pool once the graph is handed over (extracted_once), and a call's own
# inputs are synced before the lock (sync_before_the_lock, a bound
# program's included), so that calls of compiled programs go on meanwhile.
# What still holds it: a trace of the arguments themselves (arguments that
# share data, SPMD; with its restore), a graph's hand-over (but its
# look-ahead on placeholders, see [Note: A hand-over's look-ahead on
# placeholders] in dynamo_bridge.py, and the sync of twins of its pending
# arguments, see [Note: A hand-over's sync before the lock] in
# handover_sync.py),
# a capture and a guard check (see
# [Note: What reads the model's tensors] in serialization.py).
# Lock order, first taken first:
#   1. a graph's first-call lock (extracted_once, and the serializable
#      backend's);
#   2. execution_lock;
#   3. dynamo's compile lock (a capture, a trace's restore: see [Note:
#      Restores and dynamo's compiles] in tracing.py);
#   4. the placeholder registry's condition (io_utils.placeholder_traces),
#      and the compile pool's own lock, each guarding its counts or queue
#      alone and never held while waiting for anything else;
#   5. torch_xla's device lock, taken inside torch_xla by a run or a sync
#      and let go when its program is done. An XLA compile of a graph
#      (`_xla_warm_up_cache`) whose inputs all hold buffers takes none; one
#      with a placeholder among its inputs (see [Note: Placeholder tensors]
#      in io_utils.py) takes it for the whole compile (torch's lazy graph
#      walk waits on an input with no buffer as on a run's result still to
#      come), so every run of the device waits for that compile, holding
#      the GIL (`_run_cached_graph` does not let it go): a warm-up's compile
#      on placeholders stops the process for its length, a call's trace
#      stands on its arguments' buffers instead (see [Note: Stand-ins that
#      hold buffers] in placeholder_trace.py); it waits for nothing of ours
#      meanwhile.
# No thread takes a lock earlier in that order while it holds a later one:
# nothing calls a compiled graph under execution_lock or under dynamo's
# compile lock (a graph's first call runs in dynamo's transformed code,
# after its compile), and nothing run under dynamo's compile lock waits for
# execution_lock. The waits that are no locks: a call waits for a compile in
# flight through its future, with execution_lock let go whole; a sync of
# every live tensor (torch_xla's step marker) waits for the placeholder
# traces in flight (see [Note: Syncs wait for placeholder graphs] in
# io_utils.py), holding no lock of the bridge (nothing here syncs every
# live tensor under a lock), and a trace on the compile pool never waits
# for a sync that is only waiting, so a compile the sync waits for is never
# behind one that waits for the sync; both waits are bounded
# (config.placeholder_wait_timeout) and end in a logged error, not a hang.
# So they cannot deadlock. Other threads build lazy IR without the lock (a
# request's inputs) at any time, and torch_xla's sync of every live tensor
# (torch_xla.sync()) races with them (measured: "Check failed:
# data()->tensor_data" reading the shape of a tensor another thread had just
# moved to the device). So nothing here syncs the device
# before a trace or a run, or drops pending IR it did not make: a trace
# materializes its own arguments only, restores those it updated
# (pending_ir_restored), and its outputs die with their references; a run
# syncs its own inputs (sync_pending_inputs), and a donating run copies an
# argument whose buffer something else may hold rather than look for what
# holds it (see [Note: Donating in-place updates] in donation.py). Only on a
# mesh (SPMD), where reads of a run's results leave no trace on them, does a
# donating run still sync the device's pending IR.
execution_lock = threading.RLock()


@contextlib.contextmanager
def execution_lock_released() -> Iterator[None]:
  """Lets execution_lock go for the block, however many times this thread
  holds it, and takes it back as often after (see [Note: Compiles outside
  the lock] in signature_cache.py). The caller must hold it."""
  # threading.Condition releases and restores a reentrant lock the same way.
  saved = execution_lock._release_save()
  try:
    yield
  finally:
    execution_lock._acquire_restore(saved)


# [Note: Compile-only calls]
# A warm-up (precompile(), serve()'s buckets) compiles without running: its
# calls of a compiled function are made under compile_only(), and the
# bridge, at the first graph call of such a call, compiles that graph's
# signature (if it is new) and raises CompiledNotRun instead of running the
# program. Nothing of the call has run by then: dynamo's code runs its
# graph first and its side effects after, AOTAutograd's epilogue follows the
# graph, and the trace leaves the arguments as they were (ArgumentsRestore
# in tracing.py). So a warm-up leaves every parameter, buffer, argument and
# attribute of the model as it was, donates nothing and deletes nothing. A
# graph after a graph break, whose arguments only the run of the graph
# before it would make, compiles at the first real call that reaches it.
# The state is per thread: other threads' calls run as usual meanwhile.


class _CompileOnlyState(threading.local):
  """This thread's compile_only() block: the list of its compiles, None
  outside one (a class default, so a thread that never entered one reads
  None without an exception: every call of a compiled graph asks)."""
  compiles: Optional[List[Any]] = None


_compile_only = _CompileOnlyState()


class CompiledNotRun(Exception):
  """Stops a call made under compile_only() at its first graph call, its
  signature compiled or compiling; nothing of the call ran (see [Note:
  Compile-only calls])."""


@contextlib.contextmanager
def compile_only() -> Iterator[List[Any]]:
  """Within the block, this thread's calls of compiled graphs compile and
  stop (see [Note: Compile-only calls]); yields the list of the futures of
  the compiles those calls started or found in flight, in order."""
  before = _compile_only.compiles
  compiles: List[Any] = []
  _compile_only.compiles = compiles
  try:
    yield compiles
  finally:
    _compile_only.compiles = before


def compiling_only() -> bool:
  """Whether this thread's calls of compiled graphs compile and stop."""
  return _compile_only.compiles is not None


def note_compile(future: Any) -> None:
  """Tells this thread's compile_only() block of a compile its call started
  or found in flight."""
  compiles = _compile_only.compiles
  if compiles is not None and not any(f is future for f in compiles):
    compiles.append(future)


def extracted_once(model: Any, extract: Callable[[Any, Sequence[Any]], Any],
                   boxed: bool) -> Callable[..., Any]:
  """The callable of an AOTAutograd graph `model`, in place of torch's
  xla_backend_helper's: its first call hands the graph to the bridge,
  `extract(model, args)`, which gives the bridge's callable; every call then
  calls that. The hand-over is made once, by one thread, under the graph's
  first-call lock; `extract` takes execution_lock for what reads the
  arguments (the bridge's extract_compiled_graph does; see [Note:
  Threads]): a call that comes meanwhile waits for it, never makes it
  again. It compiles nothing itself (the first
  signature compiles on the compile pool, see [Note: Compiles outside the
  lock] in signature_cache.py), so every call, the first included, waits
  for a compile in the bridge's callable, with no lock held."""
  extracted = None
  first_call = threading.Lock()

  def call(*args):
    nonlocal extracted, model
    if extracted is None:
      with first_call:
        if extracted is None:
          # The bridge's hand-over takes execution_lock itself, for all
          # but its look-ahead on placeholders.
          extracted = extract(model, args)
          # The bridge keeps what it needs of the graph.
          model = None
    return extracted(*args)

  if not boxed:
    return call

  def boxed_call(args):
    # AOTAutograd's boxed convention: the arguments come as one list.
    return call(*args)

  boxed_call._boxed_call = True
  return boxed_call


class RefusedBeforeRun(RuntimeError):
  """A compiled program was not run, and nothing of the call happened: its
  signature is no longer cached, an input has pending IR, or XLA evicted the
  program (see [Note: Bound programs] in bound_program.py)."""


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


def refused_for_pending_ir(refusal: RefusedBeforeRun) -> bool:
  """Whether `refusal` is for an input with pending IR (else the program was
  evicted from XLA's cache)."""
  return _PENDING_IR_MESSAGE in str(refusal)


def sync_pending_inputs(tensors: Sequence[torch.Tensor]) -> None:
  """Materializes the tensors that have pending IR, blocking; counted. Each
  of them then holds a buffer the sync computed for it alone, which nothing
  else holds: noted as given in the data ledger (see note_data)."""
  flags = torch_xla._XLAC._check_tensor_need_materialization(tensors)
  if True in flags:
    increment_counter(COUNTER_SYNCED_INPUTS, 1)
    pending = [t for t, flag in zip(tensors, flags) if flag]
    sync_alone(pending)
    for tensor in pending:
      note_data(tensor, given=True)


def sync_before_the_lock(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
  """Materializes, without execution_lock, those of a call's own inputs
  (not parameters, which other threads read) that have pending IR; returns
  them, for note_synced_inputs under the lock. Inputs of a new shape (a new
  signature's, a cache of a new size just reset) take an XLA compile of
  their own, which then keeps no other thread's call waiting (see [Note:
  Compiles outside the lock] in signature_cache.py)."""
  # pending_of's check, here: every compiled call makes it.
  flags = torch_xla._XLAC._check_tensor_need_materialization(tensors)
  if True not in flags:
    return []
  return sync_pending([t for t, flag in zip(tensors, flags) if flag])


def pending_of(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
  """Those of `tensors` that have pending IR (or whose data sits in an IR
  node), in one C++ call."""
  flags = torch_xla._XLAC._check_tensor_need_materialization(tensors)
  if True not in flags:
    return []
  return [t for t, flag in zip(tensors, flags) if flag]


def sync_pending(pending: List[torch.Tensor]) -> List[torch.Tensor]:
  """sync_before_the_lock's sync of `pending` (pending_of's answer), with
  no lock of the bridge held; returns `pending`."""
  if not pending:
    return pending
  # Runs in flight done first, the GIL let go: a sync whose IR reads a
  # result still to come holds torch_xla's device lock through its compile
  # (see lock 5 in [Note: Threads]), and other threads' runs wait for it
  # holding the GIL.
  torch_xla._XLAC._xla_wait_device_ops([])
  sync_alone(pending)
  return pending


def note_synced_inputs(synced: Sequence[torch.Tensor]) -> None:
  """Under execution_lock: counts and notes in the data ledger the inputs
  sync_before_the_lock synced, as sync_pending_inputs would have."""
  if synced:
    increment_counter(COUNTER_SYNCED_INPUTS, 1)
    for tensor in synced:
      note_data(tensor, given=True)


def sync_alone(tensors: Sequence[torch.Tensor]) -> None:
  """Syncs `tensors` and nothing else (see [Note: Threads]), blocking: each
  becomes device data held by the tensor itself, whether it had pending IR
  or its data sat in an IR node (a tensor just moved to the device); one
  that is device data already costs nothing.

  [Note: Syncs that alias nothing]
  With `sync_xla_data=True` torch_xla's sync gives a tensor updated in place
  (`x.add_(1)`, pending) the buffer of its old value for the new one
  (input-output aliasing), which is safe at a step barrier only: that sync
  takes every live tensor, so no pending IR is left to read the old value.
  A sync of some tensors leaves other tensors' pending IR (`y = x + 1`
  made before the update) reading a buffer that is gone ("buffer ... is
  deleted" when `y` is read). So these syncs ask for no aliasing
  (`sync_xla_data=False`, which still makes each tensor hold its result):
  an in-place update of an input pending at a call costs a new buffer, as
  the same tensor read eagerly (`x.cpu()`) does."""
  if tensors:
    torch_xla._XLAC._xla_sync_multi(list(tensors),
                                    devices=[],
                                    wait=True,
                                    sync_xla_data=False)


# The data ledger: what the bridge knows of the device data a lazy tensor
# holds without IR (see [Note: Donating in-place updates] in donation.py, which
# reads it), by the tensor's unique id (never reused, unlike a data id) -> (its
# data id then, whether given). Given: data that no one else holds, as a run
# gave it to a donated argument (donation.take_result) or a sync computed it
# for the tensor alone from the tensor's own pending IR (sync_pending_inputs,
# donation.sync_alone_noting_reads). Not given: data of a tensor that was read
# before a sync dropped its IR (the sync before a trace, the restore after
# it), which a reader may hold. Oldest first; bounded, as a tensor may be
# dropped without another run. Kept here, below donation.py, so that the syncs
# of a run's inputs note what they compute. Guarded by execution_lock.
known_data: Dict[int, Tuple[str, bool]] = {}
KNOWN_DATA_LIMIT = 4096


def note_data(tensor: torch.Tensor, given: bool) -> None:
  """Notes `tensor`'s current data in the data ledger, given or not."""
  key = torch_xla._XLAC._xla_get_tensor_id(tensor)
  known_data[key] = (data_id_of(tensor), given)
  if len(known_data) > KNOWN_DATA_LIMIT:
    del known_data[next(iter(known_data))]


def move_data_note(old_key: int, tensor: torch.Tensor) -> None:
  """Moves what the data ledger notes under the lazy tensor `old_key` named
  to `tensor`, which holds the same data under a lazy tensor of its own."""
  known = known_data.pop(old_key, None)
  if known is not None:
    known_data[torch_xla._XLAC._xla_get_tensor_id(tensor)] = known


def data_id_of(tensor: torch.Tensor) -> str:
  """torch_xla's name of `tensor`'s IR node and output index while it has
  one ("<node>, <index>"), else of its device data."""
  return torch_xla._XLAC._unique_id_for_ir_and_data(tensor)


@functools.lru_cache(maxsize=None)
def device_name() -> str:
  """The process's XLA device, by name (one per process under PJRT; asking
  torch_xla costs about 8 us per donating run)."""
  return str(torch_xla.device())
