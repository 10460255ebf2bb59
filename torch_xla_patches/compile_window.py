"""Compiles: every compile of the bridge (compile_graph), compiles on worker
threads while the calling thread traces (CompileWindow), and precompile()'s
calls stopped at their new signatures to compile them so (PrecompileCalls).
"""
import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import (Any, Callable, Deque, Hashable, Iterator, List, Optional,
                    Sequence, Tuple)

import torch
import torch_xla
import torch_xla.debug.metrics as metrics
from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

from torch_xla_patches.counters import (COUNTER_HIT, COUNTER_MISS,
                                        increment_counter)
from torch_xla_patches.donation import (count_epilogue_updates, sets_own_donors,
                                        sync_alone_noting_reads)
from torch_xla_patches import execution
from torch_xla_patches.signature import ArgLayout
from torch_xla_patches.tracing import (ArgumentsRestore, CompiledGraphEntry,
                                       trace_donating, trace_graph)


def compile_graph(graph_tensors: List[torch.Tensor]) -> None:
  """Compiles the XLA graph whose outputs are `graph_tensors` (their pending
  IR) into XLA's computation cache, without running it. Every compile of the
  bridge goes through here, on the main thread or on a compile worker."""
  torch_xla._XLAC._xla_warm_up_cache(graph_tensors, [])


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
    sync_alone_noting_reads(tensors)

  def trace(
      self, xla_model: torch.fx.GraphModule, args: Sequence[Any],
      layout: ArgLayout
  ) -> Tuple[CompiledGraphEntry, Optional[concurrent.futures.Future]]:
    """Traces one signature; returns its entry and the future of its compile
    (None when it is compiled already, or has nothing to compile)."""
    tensors = [args[i] for i in layout.tensor_positions]
    self._begin_trace(tensors)
    restore = ArgumentsRestore.of(
        tensors, clear_donor_marks=not sets_own_donors(xla_model))
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
            _compile_on_worker,
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
    cache.precompiled[key] = None
    self._claims.append(_Claim(cache=cache, key=key, args=list(args)))
    raise _ClaimedMiss(len(self._claims) - 1)

  def compile(self) -> ClaimsCompiled:
    """Traces every claim here and compiles it on the workers, in order,
    stopping at the first that raises."""
    with execution.execution_lock:
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
        if claim.key in claim.cache.precompiled:
          claim.cache.precompiled[claim.key] = entry
      except Exception as e:  # pylint: disable=broad-except
        error = e

    with window.opened():
      for claim in self._claims:
        if error is not None:
          break
        if (claim.key in claim.cache.entries or
            claim.key not in claim.cache.precompiled):
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
      increment_counter(COUNTER_MISS, 1)
    for claim in self._claims[ready:]:
      # Serially these calls never came: nothing of theirs is kept.
      claim.cache.precompiled.pop(claim.key, None)
    self._claims = []
    return ClaimsCompiled(ready=ready,
                          error=error,
                          compile_seconds=tuple(seconds),
                          compiled=tuple(compiled))


def claim_if_precompiling(cache: 'SignatureCache', key: Hashable,
                          args: Sequence[Any]) -> None:
  """On a miss: stops the call if a precompile() collects its calls and the
  signature can wait (see [Note: Parallel precompile])."""
  if _precompile_calls is not None:
    _precompile_calls.claim(cache, key, args)
