"""The backlog of a graph: recorded signatures (from the signature index or an
artifact) waiting to be compiled, and the one bounded way to compile them.

[Note: Replaying recorded signatures]
A graph's recorded signatures are queued once, most served first, when its
first call (or an artifact's first call) hands them over. Replaying one
rebuilds its arguments from the live call's template (record.ReplayTemplate:
parameters and static tensors as they are, zeros of the recorded sizes for
the others), traces and compiles it through the bridge. When that happens
depends on config.precompile_mode, one meaning per value:
  sync         before the graph's first call returns, within one budget per
               first call (config.replay_sync_max_signatures and
               config.replay_sync_seconds, 0 meaning no bound), shared by
               everything queued before that call returns (index and
               artifact alike); the rest one after each later served call;
  interleaved  one after each served call, the first included;
  off          only when a caller drains the backlog (CompiledModel.
               precompile_pending).
A graph handed over while another thread serves another graph replays on
the compile pool instead, one record at a time (see [Note: Replays beside
served calls] in signature_cache.py, which calls drain_one).
A record that fails a check (record.RecordError) is skipped, counted
(DynamoSignaturePrecompileSkipped) and named in one warning per graph: damage
costs compile time, never a call. Any other exception is a bug of the replay
itself: it is counted and skipped the same way, unless config.strict_replay
is set (the test suite sets it), where it propagates.

A drain that may take more than one record, with config.compile_workers > 1,
traces each record on the calling thread and compiles it on worker threads
(see [Note: Parallel compiles] in compile_window.py). Records are still
finished one at a time, in queue order, on the calling thread: each outcome,
counter, progress line and error comes where the serial drain has it. At most
compile_workers + 1 records are in flight (one waits while the workers
compile). When a finished record raises under config.strict_replay, the
drain waits for the compiles in flight and puts their records back at the
head of the queue, unfinished, before it raises: the queue is the one the
serial drain leaves (XLA's cache keeps what those compiles made, so replaying
them again costs a trace, not a compile).
"""
import collections
import contextlib
import dataclasses
import enum
import logging
import time
from typing import (Any, Callable, ContextManager, Deque, Iterator, List,
                    Optional, Sequence, Set, Tuple)

import torch_xla
import torch_xla.debug.metrics as metrics

from torch_xla_patches import config, execution
from torch_xla_patches.counters import increment_counter
from torch_xla_patches import record as record_lib
from torch_xla_patches.record import RecordedSignature, ReplayTemplate
from torch_xla_patches.signature import ArgLayout

# Counters, next to the bridge's (see counters.py).
COUNTER_PRECOMPILED = 'DynamoSignaturePrecompiled'  # a recorded one compiled
# A recorded signature (index or artifact) that failed a check, or whose
# rebuild, trace or compile raised; or an index file that did not parse.
COUNTER_PRECOMPILE_SKIPPED = 'DynamoSignaturePrecompileSkipped'

logger = logging.getLogger('torch_xla_patches.bridge')
progress_logger = logging.getLogger('torch_xla_patches.precompile')


def compile_stats() -> Tuple[int, float]:
  """XLA compiles so far in this process, and their seconds."""
  data = metrics.metric_data('CompileTime')
  if not data:
    return 0, 0.0
  return data[0], data[1] / 1e9


class BacklogOutcome(enum.Enum):
  COMPILED = 'compiled'
  # Already compiled in this process (served before its turn came).
  KNOWN = 'known'
  # Failed a check, or its rebuild, trace or compile raised.
  SKIPPED = 'skipped'


@dataclasses.dataclass(frozen=True)
class BacklogStep:
  """What happened to one recorded signature taken from a backlog."""
  record: RecordedSignature
  outcome: BacklogOutcome
  # Why it was skipped ('' otherwise).
  reason: str
  seconds: float
  compile_seconds: float


@dataclasses.dataclass(frozen=True)
class BacklogReport:
  """What one drain did."""
  compiled: int
  skipped: int
  # Recorded signatures still queued.
  remaining: int


@dataclasses.dataclass
class _Budget:
  """What a drain may still take: a count and a deadline (None: no bound)."""
  count: Optional[int]
  deadline: Optional[float]

  @classmethod
  def of(cls, count: int, seconds: float) -> '_Budget':
    return cls(count=count if count > 0 else None,
               deadline=time.perf_counter() + seconds if seconds > 0 else None)

  def allows_one(self) -> bool:
    return (self.count is None or
            self.count > 0) and (self.deadline is None or
                                 time.perf_counter() < self.deadline)

  def take_one(self) -> None:
    if self.count is not None:
      self.count -= 1


# Compiles the rebuilt arguments of one record; False if the signature was
# compiled already.
CompileFunction = Callable[[List[Any]], bool]
# Starts compiling the rebuilt arguments of one record (traces them now);
# the function it returns waits for the compile and returns, or raises, what
# CompileFunction would have.
StartFunction = Callable[[List[Any]], Callable[[], bool]]
# Opens a window with this many compile workers, in which StartFunction may
# be called; it closes once every compile started in it is done.
WindowFunction = Callable[[int], ContextManager[StartFunction]]


@dataclasses.dataclass(frozen=True)
class _Started:
  """One record taken from the queue, its compile maybe still running."""
  record: RecordedSignature
  start: float
  compile_seconds_before: float
  # Waits for the compile; None when rebuilding or starting raised `error`.
  finish: Optional[Callable[[], bool]]
  error: Optional[Exception]


class Backlog:
  """The recorded signatures of one graph not compiled yet; see [Note:
  Replaying recorded signatures].

  Args:
    graph_id: the graph's number, for messages.
    layout: the graph's argument layout.
    compile_signature: traces and compiles rebuilt arguments (the bridge's
      SignatureCache.compile_recorded).
    compile_window: opens a window of parallel compiles (the bridge's
      SignatureCache.compile_window); None: drains compile serially.
  """

  def __init__(self,
               graph_id: int,
               layout: ArgLayout,
               compile_signature: CompileFunction,
               compile_window: Optional[WindowFunction] = None):
    self.graph_id = graph_id
    self.layout = layout
    self._compile_signature = compile_signature
    self._compile_window = compile_window
    self._queue: Deque[RecordedSignature] = collections.deque()
    self._queued_ids: Set[str] = set()
    # From the call that queued the records; dropped once the queue is
    # empty, so the backlog pins nothing after its work is done.
    self._template: Optional[ReplayTemplate] = None
    # The budget of the first call, open until that call is served.
    self._first_call_budget: Optional[_Budget] = None
    self._first_call_served = False
    self._warned_skip = False

  def __len__(self) -> int:
    return len(self._queue)

  def queue(self, records: Sequence[RecordedSignature],
            live_args: Sequence[Any]) -> int:
    """Adds `records`, in order, except those queued already and the one of
    the live call; returns how many."""
    if self._template is None:
      self._template = ReplayTemplate.of(self.layout, live_args)
    live_id = record_lib.make_record(self.layout, live_args).record_id
    queued = 0
    for item in records:
      if item.record_id == live_id or item.record_id in self._queued_ids:
        continue
      self._queued_ids.add(item.record_id)
      self._queue.append(item)
      queued += 1
    return queued

  def skip_unreadable(self, source: str, reason: str) -> None:
    """Counts and reports a recorded signature that could not be read."""
    self._skip(source, reason)

  # -- draining

  def drain_for_first_call(self) -> None:
    """In 'sync' mode, compiles what the first call's budget allows; the
    budget opens on the first drain and is shared until that call is
    served (after_served_call)."""
    if config.precompile_mode != 'sync' or self._first_call_served:
      return
    if self._first_call_budget is None:
      self._first_call_budget = _Budget.of(config.replay_sync_max_signatures,
                                           config.replay_sync_seconds)
    self._drain(self._first_call_budget)

  def after_served_call(self) -> None:
    """Compiles one queued signature after a served call ('sync' after the
    first call, 'interleaved'); the first call of 'sync' waited already."""
    first_call = not self._first_call_served
    self._first_call_served = True
    if not self._queue or config.precompile_mode == 'off':
      return
    if first_call and config.precompile_mode == 'sync':
      return
    self.drain_one()

  def drain_one(self) -> BacklogReport:
    """Compiles the next queued signature, whatever the mode."""
    return self._drain(_Budget(count=1, deadline=None))

  def drain_all(self) -> BacklogReport:
    """Compiles everything queued now, whatever the mode."""
    return self._drain(_Budget(count=None, deadline=None))

  def _drain(self, budget: _Budget) -> BacklogReport:
    total = len(self._queue) if budget.count is None else min(
        len(self._queue), budget.count)
    workers = config.compile_workers
    if self._compile_window is None or total < 2 or execution.compiling_only():
      # A warm-up's drain traces here and compiles on the compile pool (see
      # [Note: Compile-only calls] in execution.py).
      workers = 1
    steps: List[BacklogStep] = []
    with self._window(workers) as start:
      in_flight: Deque[_Started] = collections.deque()
      try:
        while self._queue and budget.allows_one():
          item = self._queue.popleft()
          budget.take_one()
          in_flight.append(self._start(item, start))
          # The serial drain finishes each record before taking the next.
          while len(in_flight) > (workers + 1 if workers > 1 else 0):
            steps.append(
                self._finish(in_flight.popleft(),
                             len(steps) + 1, total))
        while in_flight:
          steps.append(self._finish(in_flight.popleft(), len(steps) + 1, total))
      finally:
        # Only after a raise: those records were not finished.
        self._queue.extendleft(reversed([s.record for s in in_flight]))
    compiled = sum(s.outcome == BacklogOutcome.COMPILED for s in steps)
    skipped = sum(s.outcome == BacklogOutcome.SKIPPED for s in steps)
    if not self._queue:
      self._template = None
    if compiled:
      check_persistent_executables()
    return BacklogReport(compiled=compiled,
                         skipped=skipped,
                         remaining=len(self._queue))

  @contextlib.contextmanager
  def _window(self, workers: int) -> Iterator[StartFunction]:
    if workers > 1:
      with self._compile_window(workers) as start:
        yield start
    else:
      yield self._start_serially

  def _start_serially(self, args: List[Any]) -> Callable[[], bool]:
    compiled = self._compile_signature(args)
    return lambda: compiled

  def _start(self, item: RecordedSignature, start: StartFunction) -> _Started:
    begin = time.perf_counter()
    _, compile_seconds_before = compile_stats()
    finish, error = None, None
    try:
      finish = start(self._template.rebuild(item, torch_xla.device()))
    except Exception as e:  # pylint: disable=broad-except
      error = e
    return _Started(record=item,
                    start=begin,
                    compile_seconds_before=compile_seconds_before,
                    finish=finish,
                    error=error)

  def _finish(self, started: _Started, number: int, total: int) -> BacklogStep:
    item = started.record
    outcome, reason = BacklogOutcome.COMPILED, ''
    try:
      if started.error is not None:
        raise started.error
      if started.finish():
        increment_counter(COUNTER_PRECOMPILED, 1)
      else:
        outcome = BacklogOutcome.KNOWN
    except record_lib.RecordError as error:
      outcome, reason = BacklogOutcome.SKIPPED, str(error)
    except Exception as error:  # pylint: disable=broad-except
      if config.strict_replay:
        raise
      outcome = BacklogOutcome.SKIPPED
      reason = f'{type(error).__name__}: {error}'
    if outcome == BacklogOutcome.SKIPPED:
      self._skip(item.source or 'a recorded signature', reason)
    _, compile_seconds_after = compile_stats()
    step = BacklogStep(record=item,
                       outcome=outcome,
                       reason=reason,
                       seconds=time.perf_counter() - started.start,
                       compile_seconds=compile_seconds_after -
                       started.compile_seconds_before)
    self._log_step(step, number, total)
    return step

  # -- reporting

  def _skip(self, source: str, reason: str) -> None:
    increment_counter(COUNTER_PRECOMPILE_SKIPPED, 1)
    if self._warned_skip:
      logger.debug('torch_xla_patches: graph %d skipped %s: %s', self.graph_id,
                   source, reason)
      return
    self._warned_skip = True
    logger.warning(
        'torch_xla_patches: graph %d skipped a recorded signature from %s: '
        '%s. It will be compiled when a call needs it; later skips of this '
        'graph are counted in %s.', self.graph_id, source, reason,
        COUNTER_PRECOMPILE_SKIPPED)

  def _log_step(self, step: BacklogStep, number: int, total: int) -> None:
    if not config.precompile_progress:
      return
    width = len(str(total))
    what = f'graph {self.graph_id} {step.record.describe()}'
    if step.outcome == BacklogOutcome.SKIPPED:
      detail = f'skipped: {step.reason}'
    else:
      detail = (f'{step.seconds:6.2f} s (xla compile '
                f'{step.compile_seconds:5.2f} s)')
    progress_logger.info('[precompile %*d/%d] %-28s %s', width, number, total,
                         what, detail)


_warned_no_executable_loading = False


def check_persistent_executables() -> None:
  """Says once, plainly, when persisted XLA executables did not load (see
  config.persistent_executables): a replay then compiled programs again."""
  global _warned_no_executable_loading
  if not config.persistent_executables or _warned_no_executable_loading:
    return
  failures = metrics.counter_value('PersistentCacheDeserializeFailure') or 0
  if not failures:
    return
  _warned_no_executable_loading = True
  import torch_xla.runtime as xr
  logger.warning(
      'torch_xla_patches: torch_xla %s could not load %d persisted XLA '
      'executable(s) on %s (PersistentCacheDeserializeFailure). Nothing was '
      'loaded from disk: the signature index made this process compile '
      'those programs again.', torch_xla.__version__, failures,
      xr.device_type())
