"""The compiled signatures of one graph: the LRU of entries, their usage for
the signature index, and the backlog of recorded signatures.
"""
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence

import torch

from torch_xla_patches import config, fingerprint, record, signature_index
from torch_xla_patches.backlog import Backlog, StartFunction, compile_stats
from torch_xla_patches.bound_program import BoundArgument, BoundProgram
from torch_xla_patches import compile_window
from torch_xla_patches.compile_window import CompileWindow
from torch_xla_patches.counters import (COUNTER_DROPPED, COUNTER_HIT,
                                        COUNTER_MISS, increment_counter)
from torch_xla_patches import execution
from torch_xla_patches.signature import ArgLayout, ShapeSignature
from torch_xla_patches.placeholder_trace import DetachedTrace
from torch_xla_patches.tracing import CompiledGraphEntry, TracedGraph

logger = logging.getLogger('torch_xla_patches.bridge')


@dataclasses.dataclass(frozen=True)
class SignatureCompiled:
  """What a compile on the compile pool gives (see [Note: Compiles outside
  the lock])."""
  entry: CompiledGraphEntry
  # Seconds the compile took on its worker.
  seconds: float
  # 1 if XLA compiled a program (0: its cache had it, or none was needed);
  # with several workers, a compile elsewhere at the same time can count.
  xla_compiles: int


class _CompileClock:
  """Wall seconds and whether XLA compiled, from its making to result()."""

  def __init__(self):
    self._compiles, _ = compile_stats()
    self._start = time.perf_counter()

  def result(self, entry: CompiledGraphEntry) -> SignatureCompiled:
    compiles, _ = compile_stats()
    return SignatureCompiled(entry=entry,
                             seconds=time.perf_counter() - self._start,
                             xla_compiles=int(compiles > self._compiles))


class CompileFailed(RuntimeError):
  """The compile of a signature that a call waited for raised; the message
  names the graph and the signature (see [Note: Compiles outside the
  lock])."""


_graph_ids = itertools.count()
# See [Note: Replays beside served calls].
REPLAY_BESIDE_SERVING_S = 2.0
_live_caches: 'weakref.WeakSet[SignatureCache]' = weakref.WeakSet()


def live_signature_caches() -> List['SignatureCache']:
  """Signature caches of the graphs alive in this process."""
  return sorted(_live_caches, key=lambda cache: cache.graph_id)


class SignatureCache:
  """The entries of one graph, keyed by signature, least recently used first.

  [Note: Dynamo real-time input-shape cache look-up]
  The key of a call comes from `ArgLayout.key_function()` (see [Note: Shape
  signatures] in signature.py); entries are `CompiledGraphEntry`s in an ordered
  dict so a cap can drop the least recently used one.

  With a cache directory, every signature traced here is recorded in the
  graph's signature index, whose `usage` log counts the calls served. The
  signatures recorded by an earlier process (index or artifact) wait in the
  graph's `backlog` (see [Note: Replaying recorded signatures] in backlog.py in
  backlog.py).

  Args:
    xla_model: the graph.
    layout: what each of its arguments is.
    trace: traces one signature: (xla_model, args, layout) -> the traced
      graph, compiled unless it has tensors left to compile (the bridge's
      extract_graph_helper).
    detach: makes a trace of one signature on placeholders ready, to run with
      no lock: (xla_model, args, layout) -> a function that traces, or None
      where the arguments must be traced themselves (the bridge's
      detached_trace).

  [Note: Compiles outside the lock]
  A new signature of a call that needs it (on_miss) is traced on placeholders
  for its arguments where placeholders can describe them (see [Note: Traces on
  placeholders] in placeholder_trace.py), and then compiled, both with
  execution_lock let go: the trace reads and writes no tensor anyone else holds,
  and its graph is no one else's. Elsewhere it is traced under the lock, and the
  trace leaves the arguments as they were; where every tensor of the program's
  graph is an output the trace computed (it updates no argument in place and
  returns none), they hold no IR of a tensor anyone else can reach, and the XLA
  compile of them (the long part) runs without the lock too. A compile-only
  call (see [Note: Compile-only calls] in execution.py) and a graph's first
  signature (see execution.extracted_once) trace and compile on the compile
  pool, with no lock where placeholders can be used (such a trace never waits
  for a sync that waits, see [Note: Syncs wait for placeholder graphs] in
  io_utils.py). Calls of programs compiled already go on meanwhile. While a
  signature is traced and compiled, its future is in `compiling`: a call of
  the same signature, from any thread, waits for it without the lock, so a
  signature compiles once however many threads ask (one miss; the waiters
  count hits), and a compile that raises gives its error to the calls that
  waited for it (CompileFailed) and to no other. A program whose graph holds
  arguments compiles under the lock, in its trace: an update in place not
  donated is their pending IR, which the restore drops, and a returned
  argument's device data would be written by the compile while other threads
  read it. So do recorded signatures replayed from the backlog (see
  backlog.py), whose drains hold the lock, but for a replay beside served
  calls (below).

  [Note: Replays beside served calls]
  A graph whose recorded signatures are queued (its hand-over, see
  queue_recorded) while another thread served a call of another graph
  within REPLAY_BESIDE_SERVING_S replays them on the compile pool, as a
  compile-only call does (_compile_in_background: traced on stand-ins and
  compiled with no lock where the arguments allow it), one record at a
  time: the next is taken after a served call of this graph once the one
  before is compiled. A replay under the lock there would stop that thread's
  calls for as long as it traces and compiles (a generation server's new
  batch size: tens of ms a record). A call of a signature still replaying
  waits for it without the lock, as for any compile in flight (on_miss). A
  process's first graphs, and a graph whose calls come from the thread that
  last served, replay as config.precompile_mode says; once a graph replays
  beside served calls, it keeps doing so. One record at a time bounds what
  the replays hold (a record's rebuilt arguments) to one record's; they are
  rebuilt under the lock, as before (zeros of the recorded sizes). A replay
  that raises there is logged, and the calls of its signature compile it
  themselves (a call that waited for it included): nothing recorded makes a
  call fail.
  """

  def __init__(self,
               xla_model: torch.fx.GraphModule,
               layout: ArgLayout,
               trace: Callable[[torch.fx.GraphModule, Sequence[Any], ArgLayout],
                               TracedGraph],
               detach: Optional[Callable[
                   [torch.fx.GraphModule, Sequence[Any], ArgLayout, bool],
                   Optional[DetachedTrace]]] = None):
    self.graph_id = next(_graph_ids)
    self._trace = trace
    # Makes a trace on placeholders ready, or says None (see [Note: Traces on
    # placeholders] in placeholder_trace.py); its last argument lets it let
    # execution_lock go while it copies view arguments, where the signature
    # is marked compiling ([Note: View copies off the lock]).
    self._detach = detach
    self.xla_model = xla_model
    self.layout = layout
    self.key_of = layout.key_function()
    self.entries: 'collections.OrderedDict[Hashable, CompiledGraphEntry]' = (
        collections.OrderedDict())
    self._warned_cap = False
    # Signatures compiling without the lock (see [Note: Compiles outside the
    # lock]), until their entry is added or their compile raised.
    self.compiling: Dict[Hashable, concurrent.futures.Future] = {}
    self.backlog = Backlog(self.graph_id, layout, self._compile_recorded,
                           self._compile_window)
    self.usage: Optional[signature_index.UsageLog] = None
    # When, and by which thread, this graph last served a call, with a
    # cache directory (the only source of recorded signatures): see [Note:
    # Replays beside served calls].
    self.last_served_at = float('-inf')
    self.last_served_by: Optional[int] = None
    # Whether this graph replays beside served calls, and the futures of
    # those replays that a compile or a waiting call still holds.
    self._replays_beside = False
    self._replays: 'weakref.WeakSet[concurrent.futures.Future]' = (
        weakref.WeakSet())
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
      increment_counter(COUNTER_HIT, 1)
      self.entries.move_to_end(key)
    return entry

  def served(self, key: Hashable) -> None:
    """After every call of `key` that ran: its served count for the
    signature index, and one recorded signature of the backlog compiled
    (see [Note: Replaying recorded signatures] in backlog.py)."""
    usage = self.usage
    if usage is not None:
      usage.served[key] += 1
      now = self.last_served_at = time.monotonic()
      self.last_served_by = threading.get_ident()
      if now >= usage.next_flush:
        usage.flush()
    if self.backlog:
      if self._replays_beside:
        self._replay_next_beside()
      else:
        self.backlog.after_served_call()

  def trace(self, key: Hashable, args: Sequence[Any]) -> CompiledGraphEntry:
    """Traces and compiles the signature of `args` holding the lock."""
    traced = self._trace(self.xla_model, args, self.layout)
    if traced.graph_tensors:
      compile_window.compile_traced(list(traced.graph_tensors))
    self._add_entry(key, traced.entry)
    return traced.entry

  def _add_entry(self, key: Hashable, entry: CompiledGraphEntry) -> None:
    self.entries[key] = entry
    self.entries.move_to_end(key)
    cap = config.max_signatures_per_graph
    while cap > 0 and len(self.entries) > cap:
      self.entries.popitem(last=False)
      increment_counter(COUNTER_DROPPED, 1)
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
    self._record(key, args)
    return entry

  def _record(self, key: Hashable, args: Sequence[Any]) -> None:
    if self.usage is not None:
      self.usage.record(key, record.make_record(self.layout, args))

  def on_miss(self,
              key: Hashable,
              args: Sequence[Any],
              release_lock: bool = True) -> CompiledGraphEntry:
    """The entry of a signature with none yet, compiled now (counted as a
    miss) or by the thread compiling it already (a hit once it is; see
    [Note: Compiles outside the lock]). The caller holds execution_lock; with
    `release_lock`, the compile and the wait let it go."""
    while True:
      future = self._compiling(key)
      if future is None:
        break
      # A compile still queued on the pool is the next one it runs.
      compile_window.compile_pool().promote(future)
      with execution.execution_lock_released():
        concurrent.futures.wait([future])
      if future.cancelled():
        continue
      error = future.exception()
      if error is not None and future in self._replays:
        # A replay's failure is the replay's: this call compiles the
        # signature itself (see [Note: Replays beside served calls]).
        continue
      if isinstance(error, CompileFailed):
        raise CompileFailed(str(error)) from error
      if error is not None:
        raise CompileFailed(
            f'torch_xla_patches: graph {self.graph_id}: the compile of '
            f'{self.layout.signature_of(args).describe()}, which this call '
            f'waited for, raised {type(error).__name__}: {error}') from error
      entry = self.look_up(key)
      if entry is not None:
        # Compiled by the call it waited for: a hit, as if it had come after.
        return entry
    # Counted where the signature is traced: calls that waited for another
    # call's compile are hits.
    increment_counter(COUNTER_MISS, 1)
    if config.explain_misses:
      logger.info('%s', self.explain_miss(args))
    # In `compiling` from its trace on, so that a call of the same
    # signature waits for this one, the lock let go or not.
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    self.compiling[key] = future
    clock = _CompileClock()
    try:
      entry = None
      detached = (self._detach(self.xla_model, args, self.layout, True)
                  if release_lock and self._detach is not None else None)
      if detached is not None:
        with execution.execution_lock_released():
          entry = detached(False)
      if entry is None:
        traced = self._trace(self.xla_model, args, self.layout)
        entry = traced.entry
        if traced.graph_tensors and release_lock:
          with execution.execution_lock_released():
            compile_window.compile_traced(traced.graph_tensors)
        elif traced.graph_tensors:
          compile_window.compile_traced(traced.graph_tensors)
        del traced
    except BaseException as error:
      del self.compiling[key]
      future.set_exception(error)
      raise
    self._add_compiled(key, entry, args)
    del self.compiling[key]
    future.set_result(clock.result(entry))
    return entry

  def compile_only(self, key: Hashable, args: Sequence[Any]) -> None:
    """For a compile-only call (see [Note: Compile-only calls] in
    execution.py): a new signature is traced now and compiled on the compile
    pool (counted as a miss); one compiled or compiling already is left as
    it is. The future of its compile, if any, is noted for the caller
    (execution.note_compile); it gives a SignatureCompiled. The caller holds
    execution_lock."""
    if key in self.entries:
      return
    future = self._compiling(key)
    if future is not None:
      execution.note_compile(future)
      return
    increment_counter(COUNTER_MISS, 1)
    if config.explain_misses:
      logger.info('%s', self.explain_miss(args))
    self._compile_in_background(args)

  def _compile_in_background(self, args: Sequence[Any]) -> None:
    """Traces the signature of `args` and compiles it on the compile pool;
    the future of its compile is noted (execution.note_compile). Traced on
    placeholders there, with no lock, where it can be (see [Note: Traces on
    placeholders] in placeholder_trace.py), else now. The caller holds
    execution_lock."""
    detached = (self._detach(self.xla_model, args, self.layout, False)
                if self._detach is not None else None)
    if detached is not None:
      self._trace_and_compile_in_background(args, detached)
      return
    clock = _CompileClock()
    traced = self._trace(self.xla_model, args, self.layout)
    # Under SPMD the trace's sync of the arguments replicates those the
    # user left unannotated: the calls that follow have that key.
    key = self.key_of(args)
    if key in self.entries:
      return
    if self._compiling(key) is not None:
      execution.note_compile(self.compiling[key])
      return
    if not traced.graph_tensors:
      # Compiled in its trace, holding the lock (see [Note: Compiles outside
      # the lock]).
      self._add_compiled(key, traced.entry, args)
      done = concurrent.futures.Future()
      done.set_result(clock.result(traced.entry))
      execution.note_compile(done)
      return
    made = record.make_record(self.layout, args) if self.usage else None
    signature = traced.entry.signature
    graph_tensors = list(traced.graph_tensors)
    del traced.graph_tensors[:]
    entry = traced.entry

    def compile_traced() -> CompiledGraphEntry:
      compile_window.compile_traced(graph_tensors)
      return entry

    self._submit(key, signature, made, 'compile', compile_traced)

  def _trace_and_compile_in_background(self, args: Sequence[Any],
                                       detached: DetachedTrace) -> None:
    """_compile_in_background of a trace on placeholders: traced and compiled
    on the compile pool, no lock held. The caller holds execution_lock."""
    key = self.key_of(args)
    made = record.make_record(self.layout, args) if self.usage else None
    signature = self.layout.signature_of(args)
    # The trace runs as the call would have (grad mode is per thread).
    grad_enabled = torch.is_grad_enabled()

    def trace_and_compile() -> CompiledGraphEntry:
      with torch.set_grad_enabled(grad_enabled):
        entry = detached(True)
      if entry is None:
        # Traced on the arguments after all, under the lock, as a
        # compile-only call's trace is.
        with execution.execution_lock, torch.set_grad_enabled(grad_enabled):
          traced = self._trace(self.xla_model, args, self.layout)
        entry = traced.entry
        if traced.graph_tensors:
          compile_window.compile_traced(traced.graph_tensors)
        del traced
      return entry

    self._submit(key, signature, made, 'trace and compile', trace_and_compile)

  def _submit(self, key: Hashable, signature: Any, made: Any, work: str,
              make_entry: Callable[[], CompiledGraphEntry]) -> None:
    """Runs `make_entry` (the `work` of `signature`'s program) on the compile
    pool, no lock held, and adds its entry under `key`; a failure forgets
    `key` and raises CompileFailed from the future. The caller holds
    execution_lock."""

    def run() -> SignatureCompiled:
      clock = _CompileClock()
      try:
        entry = make_entry()
      except Exception as error:
        with execution.execution_lock:
          del self.compiling[key]
        raise CompileFailed(
            f'torch_xla_patches: graph {self.graph_id}: the background '
            f'{work} of {signature.describe()} raised '
            f'{type(error).__name__}: {error}') from error
      compiled = clock.result(entry)
      with execution.execution_lock:
        self._add_entry(key, entry)
        if made is not None:
          self.usage.record(key, made)
        del self.compiling[key]
      return compiled

    future = compile_window.compile_pool().submit(run)
    self.compiling[key] = future
    execution.note_compile(future)

  def _compiling(self, key: Hashable) -> Optional[concurrent.futures.Future]:
    """The future of the compile of `key` in flight; one the pool cancelled
    before it ran (revert(), exit) is forgotten."""
    future = self.compiling.get(key)
    if future is not None and future.cancelled():
      del self.compiling[key]
      return None
    return future

  def _add_compiled(self, key: Hashable, entry: CompiledGraphEntry,
                    args: Sequence[Any]) -> None:
    self._add_entry(key, entry)
    self._record(key, args)

  def _compile_recorded(self, args: List[Any]) -> bool:
    key = self.key_of(args)
    if key in self.entries or self._compiling(key) is not None:
      return False
    if execution.compiling_only() or self._replays_beside:
      # The first call of a warm-up (see [Note: Compile-only calls] in
      # execution.py): the recorded signatures compile on the pool, as its
      # buckets do, and the warm-up waits for them. So do a replay's beside
      # served calls, which no one waits for.
      self._compile_in_background(args)
      in_flight = self.compiling.get(key)
      if self._replays_beside and in_flight is not None:
        self._replays.add(in_flight)
        in_flight.add_done_callback(self._replay_done)
      return True
    self._trace_and_record(key, args)
    return True

  @contextlib.contextmanager
  def _compile_window(self, workers: int) -> Iterator[StartFunction]:
    """Opens a window in which recorded signatures are traced here and compiled
    on `workers` threads (see [Note: Parallel compiles] in
    compile_window.py)."""
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
    if key in started or key in self.compiling:
      # The same signature is in flight: decided in turn, as serially.
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
    """Queues recorded signatures (see [Note: Replaying recorded signatures] in
    backlog.py) and, in 'sync' mode before the first call is served, compiles
    what that call's budget still allows."""
    self.backlog.queue(records, live_args)
    if not self._replays_beside and self._other_thread_serving():
      self._replays_beside = True
    if self._replays_beside:
      self._replay_next_beside()
    else:
      self.backlog.drain_for_first_call()

  def _other_thread_serving(self) -> bool:
    """Whether another thread served a call of another graph lately (see
    [Note: Replays beside served calls])."""
    if config.precompile_mode == 'off' or execution.compiling_only():
      return False
    here = threading.get_ident()
    since = time.monotonic() - REPLAY_BESIDE_SERVING_S
    return any(cache is not self and cache.last_served_by not in (
        None, here) and cache.last_served_at >= since
               for cache in list(_live_caches))

  def _replay_done(self, future: concurrent.futures.Future) -> None:
    """Says, on the compile pool, that a replay beside served calls raised:
    the signature is compiled by its first call, as if never recorded."""
    error = None if future.cancelled() else future.exception()
    if error is not None:
      logger.warning('%s; the calls of that signature compile it themselves',
                     error)

  def _replay_next_beside(self) -> None:
    """Starts the next recorded signature's replay on the compile pool once
    the one before is compiled (see [Note: Replays beside served calls])."""
    if all(replay.done() for replay in list(self._replays)):
      self.backlog.drain_one()

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
    with execution.execution_lock:
      return self.backlog.drain_all().compiled

  # -- bound programs

  def bound_program(self, args: Sequence[Any],
                    free_index: Dict[int, int]) -> Optional['BoundProgram']:
    """The compiled program of the signature of `args`, with every argument
    whose position is not in `free_index` (position -> index among the free
    arguments of a call) bound to the tensor `args` holds there now (see [Note:
    Bound programs] in bound_program.py); None if that signature is not
    compiled, or if its program cannot be bound (it draws a random seed, returns
    an
    argument)."""
    key = self.key_of(args)
    with execution.execution_lock:
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
        free_slots.append((arg_idx, slot, free_index[arg_idx]))
        inputs.append(None)
      else:
        inputs.append(args[arg_idx])
    # In graph-argument order, the order the bridge's callable syncs a
    # call's pending inputs in (see [Note: Bound programs]).
    free_slots = [(slot, free) for _, slot, free in sorted(free_slots)]

    def source(position: int) -> BoundArgument:
      return BoundArgument(
          free_index=free_index.get(position),
          bound=None if position in free_index else args[position])

    updated = {
        position: source(position)
        for position, _ in entry.output_plan.inplace_updates
    }
    donated = tuple((matcher.arg_idxs.index(position), source(position))
                    for position in entry.donated_positions)
    return BoundProgram(self, key, entry, inputs, tuple(free_slots), updated,
                        donated)
