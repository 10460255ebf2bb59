"""Compiles: every compile of the bridge (compile_graph), the process's
pool of compile workers (compile_pool), and compiles on worker threads while
the calling thread traces recorded signatures (CompileWindow).
"""
import atexit
import collections
import concurrent.futures
import contextlib
import threading
from typing import (Any, Callable, Deque, Iterator, List, Optional, Sequence,
                    Tuple)

import torch
import torch_xla

from torch_xla_patches import config
from torch_xla_patches.donation import (count_epilogue_updates, donor_aliasing,
                                        sync_alone_noting_reads)
from torch_xla_patches.signature import ArgLayout
from torch_xla_patches.tracing import (ArgumentsRestore, CompiledGraphEntry,
                                       graph_constants, trace_donating,
                                       trace_graph)


def compile_graph(graph_tensors: List[torch.Tensor]) -> None:
  """Compiles the XLA graph whose outputs are `graph_tensors` (their pending
  IR) into XLA's computation cache, without running it. Every compile of the
  bridge goes through here, on the main thread or on a compile worker."""
  torch_xla._XLAC._xla_warm_up_cache(graph_tensors, [])


def compile_traced(graph_tensors: List[torch.Tensor]) -> None:
  """Compiles the outputs `graph_tensors` of a trace that left its arguments
  as they were, on any thread, holding no lock (see [Note: Compiles outside
  the lock] in signature_cache.py). The list is emptied, so the pending IR
  of the graph goes with the compile, whether or not it raises."""
  try:
    with donor_aliasing():
      compile_graph(graph_tensors)
  finally:
    # A raised exception keeps this frame in its traceback: let the tensors,
    # and the pending IR of the graph, go now.
    del graph_tensors[:]


class CompileWindow:
  """Compiles in flight on worker threads while the main thread traces the
  next signatures of one graph.

  [Note: Parallel compiles]
  Replaying recorded signatures (see [Note: Replaying recorded signatures] in
  backlog.py) with config.compile_workers > 1 traces each signature on the
  calling
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
      is done (`compile_traced` drops them even when the compile raises);
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
    sync_alone_noting_reads(tensors)

  def trace(
      self, xla_model: torch.fx.GraphModule, args: Sequence[Any],
      layout: ArgLayout
  ) -> Tuple[CompiledGraphEntry, Optional[concurrent.futures.Future]]:
    """Traces one signature; returns its entry and the future of its compile
    (None when it is compiled already, or has nothing to compile)."""
    tensors = [args[i] for i in layout.tensor_positions]
    self._begin_trace(tensors)
    restore = ArgumentsRestore.of(tensors + graph_constants(xla_model))
    restoring = True
    try:
      count_epilogue_updates(xla_model)
      traced = trace_graph(xla_model, args, layout)
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
            compile_traced,
            [t for t, flag in zip(traced.graph_tensors, computed) if flag])
        self._in_flight.append(future)
        return traced.entry, future
      # An in-place update: the serial path, after the compiles in flight.
      self.wait()
      traced = trace_donating(xla_model, args, layout, restore, traced)
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
      with donor_aliasing():
        try:
          yield self
        finally:
          self.wait()
    finally:
      self._pool.shutdown(wait=True)


class CompilePool:
  """Daemon threads that run compiles handed to them, first in first out,
  or at the front when asked.

  [Note: The compile pool]
  Background compiles (serve()'s buckets, precompile()'s signatures, see
  [Note: Compile-only calls] in execution.py) run here, config.compile_workers
  of them at once (at least one), as the flag is when a worker takes a job:
  a worker started while it was higher takes none while it is lower. The
  workers are daemon threads, and what
  is still queued when the interpreter exits or revert() runs is cancelled
  (its future says so), so neither waits for compiles nobody will call; a
  compile already running is waited for by revert(), not at exit.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._queue: Deque[Tuple[concurrent.futures.Future,
                             Callable[[], Any]]] = (collections.deque())
    self._wakeup = threading.Condition(self._lock)
    self._threads: List[threading.Thread] = []
    self._running = 0

  def submit(self,
             job: Callable[[], Any],
             first: bool = False) -> concurrent.futures.Future:
    """Queues `job` (at the front with `first`); returns its future."""
    future = concurrent.futures.Future()
    with self._lock:
      if first:
        self._queue.appendleft((future, job))
      else:
        self._queue.append((future, job))
      self._start_workers()
      # Every worker looks: one past the flag's count takes no job.
      self._wakeup.notify_all()
    return future

  def promote(self, future: concurrent.futures.Future) -> None:
    """Moves the job of `future` to the front, if it is still queued."""
    with self._lock:
      for index, (queued, job) in enumerate(self._queue):
        if queued is future:
          del self._queue[index]
          self._queue.appendleft((queued, job))
          return

  def _start_workers(self) -> None:
    self._threads = [t for t in self._threads if t.is_alive()]
    while len(self._threads) < max(1, config.compile_workers):
      index = len(self._threads)
      thread = threading.Thread(target=self._work,
                                args=(index,),
                                name=f'xla-compile-{index}',
                                daemon=True)
      thread.start()
      self._threads.append(thread)

  def _work(self, index: int) -> None:
    while True:
      with self._lock:
        while not self._queue or index >= max(1, config.compile_workers):
          self._wakeup.wait()
        future, job = self._queue.popleft()
        if not future.set_running_or_notify_cancel():
          continue
        self._running += 1
      try:
        result = job()
      except BaseException as error:  # pylint: disable=broad-except
        future.set_exception(error)
      else:
        future.set_result(result)
      finally:
        # What the job holds (a call's arguments) goes now, not when the
        # next job comes.
        job = None
        with self._lock:
          self._running -= 1
          self._wakeup.notify_all()

  def cancel_queued(self) -> int:
    """Cancels every job not started yet; returns how many."""
    with self._lock:
      queued = list(self._queue)
      self._queue.clear()
    for future, _ in queued:
      future.cancel()
    return len(queued)

  def wait_running(self, timeout: Optional[float] = None) -> bool:
    """Waits until no job runs and none is queued; False on timeout."""
    with self._lock:
      return self._wakeup.wait_for(
          lambda: not self._running and not self._queue, timeout)


_pool: Optional[CompilePool] = None
_pool_lock = threading.Lock()


def compile_pool() -> CompilePool:
  """The process's compile pool (see [Note: The compile pool])."""
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = CompilePool()
    return _pool


def stop_background_compiles() -> None:
  """Cancels the queued compiles and waits for the running ones (revert())."""
  pool = _pool
  if pool is not None:
    pool.cancel_queued()
    pool.wait_running()


@atexit.register
def _cancel_at_exit() -> None:
  # A compile still running when the interpreter tears XLA down aborts the
  # process: it is waited for (one per worker at most); nothing queued runs.
  stop_background_compiles()
