"""Warm-up: compile shape signatures before requests need them.

`precompile(compiled_fn, specs)` calls a torch.compile'd callable once per
signature in compile-only mode (see [Note: Compile-only calls] in
execution.py): dynamo traces once (dynamic=True), the bridge traces each
signature on the calling thread and compiles it on the compile pool (see
[Note: The compile pool] in compile_window.py), and no program runs.
(Signatures recorded by the persistent index or an artifact are replayed by
the bridge itself, see backlog.py.)
"""
import atexit
import concurrent.futures
import dataclasses
import logging
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

import torch_xla

from torch_xla_patches import call_spec, config, execution, io_utils
from torch_xla_patches.call_spec import CallSpec
from torch_xla_patches.io_utils import TensorSpec

logger = logging.getLogger('torch_xla_patches.precompile')


@dataclasses.dataclass(frozen=True)
class PrecompiledSignature:
  description: str
  # Wall seconds from the start of the call to the end of its compile
  # (compiles of several signatures overlap).
  seconds: float
  # Seconds its compile took on the compile pool (0 if none was needed).
  compile_seconds: float
  xla_compiles: int


def _describe(args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
  if kwargs or not all(
      isinstance(a, (torch.Tensor, bool, int, float)) for a in args):
    return call_spec.spec_of_call(args, kwargs).describe()
  return ' '.join(
      io_utils.describe_arg_spec(io_utils.arg_spec(a)) for a in args)


class _Progress:
  """One log line per signature: what, how long, how long XLA compiled, ETA."""

  def __init__(self, total: int, enabled: bool):
    self.total = total
    self.enabled = enabled
    self.start = time.perf_counter()
    self.done = 0

  def step(self, item: PrecompiledSignature) -> None:
    self.done += 1
    if not self.enabled:
      return
    elapsed = time.perf_counter() - self.start
    eta = elapsed / self.done * (self.total - self.done)
    logger.info(
        '[precompile %*d/%d] %-28s %6.2f s (xla compile %5.2f s)  '
        'ETA %5.1f s', len(str(self.total)), self.done, self.total,
        item.description, item.seconds, item.compile_seconds, eta)


def _materialize(spec: Any,
                 device,
                 pool: Dict[Any, torch.Tensor],
                 for_trace: bool = True) -> Tuple[tuple, Dict[str, Any]]:
  """(args, kwargs) of one entry of precompile's specs, on placeholders
  with `for_trace`; CallSpec tensors are shared between entries through
  `pool` (see CallSpec.materialize)."""
  if isinstance(spec, CallSpec):
    return spec.materialize(device, pool, for_trace=for_trace)
  items = spec if isinstance(spec, (tuple, list)) else (spec,)
  args = []
  for item in items:
    if isinstance(item, TensorSpec):
      args.append(
          item.for_trace(device) if for_trace else item.materialize(device))
    elif isinstance(item, torch.Tensor):
      args.append(item.to(device))
    else:
      args.append(item)
  return tuple(args), {}


def precompile(
    compiled_fn: Callable,
    specs: Sequence[Any],
    progress: bool = True,
    tensor_pool: Optional[Dict[Any, torch.Tensor]] = None
) -> List[PrecompiledSignature]:
  """Compiles one XLA program per signature in `specs`, without running
  them: the model, its state and the arguments are left as they were (see
  [Note: Compile-only calls] in execution.py).

  Args:
    compiled_fn: a callable made by torch.compile(..., backend='openxla'),
      ideally with dynamic=True so dynamo traces once.
    specs: one entry per signature: a CallSpec (keyword and nested
      arguments, see [Note: Served call structure]), or a tuple of
      positional arguments, each a tensor, a TensorSpec, or a Python number
      (a single non-tuple item is a one-argument call).
    progress: log a line per signature (signature, seconds, ETA) on the
      `torch_xla_patches.precompile` logger.
    tensor_pool: tensors CallSpec entries may reuse (see
      CallSpec.materialize), e.g. those a capture was made with.
  Returns:
    One PrecompiledSignature per spec, in order, once every one is
    compiled. A compile that raises is raised here, after the compiles of
    the specs before it are done.
  """
  device = torch_xla.device()
  bar = _Progress(len(specs), progress)
  pool = tensor_pool if tensor_pool is not None else {}
  started = []
  for spec in specs:
    start = time.perf_counter()
    args, kwargs, compiles = _start_placeholder_call(compiled_fn, spec, device,
                                                     pool)
    started.append((_describe(args, kwargs), start, compiles))
    # The compiles hold the graphs they compile, not the tensors.
    del args, kwargs
  report = []
  reported: Set[int] = set()
  for description, start, compiles in started:
    report.append(_finished(description, start, compiles, reported))
    bar.step(report[-1])
  return report


def _start_placeholder_call(
    compiled_fn: Callable, spec: Any, device: Any,
    pool: Dict[Any, torch.Tensor]) -> Tuple[tuple, Dict[str, Any], List[Any]]:
  """(args, kwargs, compiles) of one warm-up call of `spec` on placeholders,
  in flight until its compiles are done (see [Note: Syncs wait for
  placeholder graphs] in io_utils.py)."""
  import torch_xla.runtime as xr
  if xr.is_spmd():
    # No placeholders on a mesh (see [Note: Placeholder tensors] in
    # io_utils.py): nothing for a sync to wait for.
    args, kwargs = _materialize(spec, device, pool)
    return args, kwargs, compile_without_running(compiled_fn, args, kwargs)
  failure = None
  io_utils.placeholder_traces.begin()
  try:
    args, kwargs = _materialize(spec, device, pool)
    compiles = compile_without_running(compiled_fn, args, kwargs)
  except Exception as error:  # pylint: disable=broad-except
    io_utils.placeholder_traces.end()
    failure = f'{type(error).__name__}: {error}'
  except BaseException:
    io_utils.placeholder_traces.end()
    raise
  finally:
    io_utils.placeholder_traces.traced()
  if failure is not None:
    # An op that read a placeholder's buffer raised (a CPU fallback the
    # look-ahead did not foresee, in a graph run eagerly): the call is made
    # again, out of flight, on tensors of its own, which cost their memory.
    logger.info(
        'a warm-up call on placeholders raised %s; warming it up on '
        'zeros', failure)
    args, kwargs = _materialize(spec, device, {}, for_trace=False)
    return args, kwargs, compile_without_running(compiled_fn, args, kwargs)
  io_utils.placeholder_traces.end_when_done(compiles)
  return args, kwargs, compiles


def compile_without_running(compiled_fn: Callable, args: Sequence[Any],
                            kwargs: Dict[str, Any]) -> List[Any]:
  """Makes the call `compiled_fn(*args, **kwargs)` compile its first graph's
  signature and stop before anything runs (see [Note: Compile-only calls]);
  returns the futures of the compiles it started or found in flight (each
  gives a signature_cache.SignatureCompiled)."""
  with execution.compile_only() as compiles:
    try:
      compiled_fn(*args, **kwargs)
    except execution.CompiledNotRun:
      pass
  return compiles


def _finished(description: str, start: float, compiles: Sequence[Any],
              reported: Set[int]) -> PrecompiledSignature:
  """The report of one spec, once its compiles are done; a compile counts
  for the first spec whose call found it (its id joins `reported`)."""
  compile_seconds, xla_compiles = 0.0, 0
  for future in compiles:
    if future.cancelled():
      continue
    compiled = future.result()
    if id(future) in reported:
      continue
    reported.add(id(future))
    compile_seconds += compiled.seconds
    xla_compiles += compiled.xla_compiles
  return PrecompiledSignature(description=description,
                              seconds=time.perf_counter() - start,
                              compile_seconds=compile_seconds,
                              xla_compiles=xla_compiles)


@dataclasses.dataclass(frozen=True)
class Readiness:
  """How far a served model's background warm-up is (see [Note: Ready at
  once] in serving.py)."""
  # Buckets whose programs are compiled.
  ready: int
  # Buckets in all.
  total: int
  # 'bucket N <description>: <error>' for each bucket whose compile raised.
  failed: Tuple[str, ...]

  @property
  def done(self) -> bool:
    """Whether every bucket is compiled or has failed."""
    return self.ready + len(self.failed) == self.total


class CaptureGate:
  """When a first start's warm-up may make the captures its buckets need.

  [Note: Captures after the first request]
  On a first start, serve() captures the model on one bucket; a bucket the
  captures made so far refuse (a one-token decode step beside a prompt, see
  [Note: One capture per guard set] in serving.py) needs a capture of its
  own, which is seconds of dynamo on the host and holds the bridge's lock.
  Made in front of the first request, it would delay that request by as
  much. So the warm-up first compiles the buckets some capture accepts, in
  order, then waits at this gate before the others, which opens once the
  first request made of the served model is answered (whatever it was, a
  raise included), once something waits for every bucket
  (served.wait_ready(), serve(wait=True)) or the warm-up stops, or, with no
  request in flight, config.serve_capture_delay seconds after the other
  buckets are compiled. A first request thus waits for its own capture and
  compile alone: a request needing a capture no bucket made yet makes it
  itself, and the warm-up then finds it made. The warm-up makes each
  capture (ServedModel.capture_for) before its compile-only call of the
  bucket, outside the placeholder call, so a device sync never waits for a
  capture (see [Note: Syncs wait for placeholder graphs] in io_utils.py).
  A restart loads every capture (serve() checks that they accept every
  bucket), so no bucket needs one; there the whole warm-up waits at this
  gate (after_first_request): its compiles hold the device (a sync of a
  request waits for the warm-up's graphs in flight, see [Note: Syncs wait
  for placeholder graphs] in io_utils.py), and a first request needs its
  own compile alone. The served model tells the gate of its
  first request (ServedModel's first_request), once; the warm-up's own
  calls are not requests.
  """

  def __init__(self):
    self._condition = threading.Condition()
    self._open = False
    self._requests = 0

  @property
  def is_open(self) -> bool:
    return self._open

  def request_started(self) -> None:
    with self._condition:
      self._requests += 1

  def request_answered(self) -> None:
    with self._condition:
      self._requests -= 1
      self._open = True
      self._condition.notify_all()

  def open(self) -> None:
    with self._condition:
      self._open = True
      self._condition.notify_all()

  def wait(self, delay: float) -> None:
    """Returns once open, or once `delay` seconds have passed with no
    request in flight."""
    deadline = time.monotonic() + delay
    with self._condition:
      while not self._open:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          if not self._requests:
            return
          remaining = None
        self._condition.wait(remaining)


class BackgroundWarmUp:
  """Compiles a served model's buckets on a daemon thread, without running
  them (see [Note: Compile-only calls] in execution.py), and tells how far
  it is.

  Args:
    call: the served model's call.
    specs: the buckets, as CallSpecs.
    tensor_pool: tensors the buckets may reuse (see CallSpec.materialize).
    then: called on the warm-up thread once every bucket is compiled or
      has failed (serve() saves its artifact there).
    needs_capture: whether the call (args, kwargs) of a bucket needs a
      capture no capture made so far accepts; such buckets are compiled
      after the others, once `gate` opens (see [Note: Captures after the
      first request]). None: every bucket in order.
    capture: makes the capture such a bucket needs, before its
      compile-only call (so a sync never waits for a capture, see [Note:
      Syncs wait for placeholder graphs] in io_utils.py).
    capture_first: the index of the bucket whose capture is made first
      among those that need one (serve()'s example, see [Note: The first
      capture] in serving.py); the others follow in order.
    after_first_request: every bucket waits at `gate` (a restart's warm-up,
      see [Note: Captures after the first request]).
  """

  def __init__(self,
               call: Callable[..., Any],
               specs: Sequence[CallSpec],
               tensor_pool: Optional[Dict[Any, torch.Tensor]],
               then: Optional[Callable[[], None]],
               needs_capture: Optional[Callable[[tuple, Dict[str, Any]],
                                                bool]] = None,
               capture: Optional[Callable[[tuple, Dict[str, Any]],
                                          None]] = None,
               capture_first: Optional[int] = None,
               after_first_request: bool = False):
    self._call = call
    self._after_first_request = after_first_request
    self._capture_first = capture_first
    self._specs = list(specs)
    self._tensor_pool = tensor_pool
    self._then = then
    self._needs_capture = needs_capture
    self._capture = capture
    self.gate = CaptureGate()
    # The compiles counted for a bucket (see _finished).
    self._reported: Set[int] = set()
    self._condition = threading.Condition()
    self._ready = 0
    self._failed: List[str] = []
    self._stopped = False
    # Set once the thread is done, `then` included.
    self._over = False
    self._bar = _Progress(len(self._specs), config.precompile_progress)
    self._thread = threading.Thread(target=self._run,
                                    name='xla-serve-warm-up',
                                    daemon=True)
    with _live_lock:
      _live.add(self)
    self._thread.start()

  def readiness(self) -> Readiness:
    with self._condition:
      return Readiness(ready=self._ready,
                       total=len(self._specs),
                       failed=tuple(self._failed))

  def wait(self, timeout: Optional[float] = None) -> bool:
    """Waits until every bucket is compiled or has failed and `then` has
    run, or `timeout` seconds; returns whether every bucket is compiled.
    Opens the gate of the buckets that need a capture of their own."""
    self.gate.open()
    with self._condition:
      self._condition.wait_for(lambda: self._over or self._stopped, timeout)
      return self._ready == len(self._specs)

  def stop(self) -> None:
    """Starts no more compiles and cancels its queued ones (revert()); waits
    until its thread has stopped."""
    with self._condition:
      self._stopped = True
      self._condition.notify_all()
    self.gate.open()
    if threading.current_thread() is not self._thread:
      self._thread.join()

  def _run(self) -> None:
    try:
      if self._after_first_request and not self._stopped:
        self.gate.wait(config.serve_capture_delay)
      deferred = self._deferred()
      self._finish_compiles(
          self._start_compiles(
              [i for i in range(len(self._specs)) if i not in deferred]))
      # Not held while the gate is shut (sharded bucket tensors are real).
      self._tensor_pool = None
      if deferred and not self._stopped:
        self.gate.wait(config.serve_capture_delay)
        self._finish_compiles(self._start_compiles(deferred, capture=True))
      self._tensor_pool = None
      if self._then is not None and not self._stopped:
        self._then()
    finally:
      with _live_lock:
        _live.discard(self)
      with self._condition:
        self._over = True
        self._condition.notify_all()

  def _start_compiles(
      self,
      indices: Sequence[int],
      capture: bool = False) -> List[Tuple[int, str, float, List[Any]]]:
    """Traces each of these buckets on this thread (with `capture`, after
    making the capture it needs); its compile goes to the pool."""
    device = torch_xla.device()
    started: List[Tuple[int, str, float, List[Any]]] = []
    for index in indices:
      if self._stopped:
        break
      spec = self._specs[index]
      if capture and self._capture is not None:
        try:
          args, kwargs = _materialize(spec, device, self._pool())
          self._capture(args, kwargs)
          del args, kwargs
        except Exception as error:  # pylint: disable=broad-except
          self._fail(index, _describe_spec(spec), error)
          continue
      self._start(index, spec, device, self._pool(), started)
    return started

  def _pool(self) -> Dict[Any, torch.Tensor]:
    if self._tensor_pool is None:
      self._tensor_pool = {}
    return self._tensor_pool

  def _deferred(self) -> List[int]:
    """The buckets that need a capture of their own (see [Note: Captures
    after the first request])."""
    device = torch_xla.device()
    deferred = [
        index for index, spec in enumerate(self._specs)
        if self._needs_a_capture(spec, device, self._pool())
    ]
    return sorted(deferred, key=lambda index: index != self._capture_first)

  def _needs_a_capture(self, spec: Any, device: Any,
                       pool: Dict[Any, torch.Tensor]) -> bool:
    if self._needs_capture is None or self.gate.is_open:
      return False
    try:
      args, kwargs = _materialize(spec, device, pool)
      return self._needs_capture(args, kwargs)
    except Exception:  # pylint: disable=broad-except
      # Its compile-only call says what is wrong, in order.
      return False

  def _start(self, index: int, spec: Any, device: Any, pool: Dict[Any,
                                                                  torch.Tensor],
             started: List[Tuple[int, str, float, List[Any]]]) -> None:
    description = _describe_spec(spec)
    start = time.perf_counter()
    try:
      args, kwargs, compiles = _start_placeholder_call(self._call, spec, device,
                                                       pool)
      del args, kwargs
    except Exception as error:  # pylint: disable=broad-except
      self._fail(index, description, error)
      return
    started.append((index, description, start, compiles))

  def _finish_compiles(
      self, started: List[Tuple[int, str, float, List[Any]]]) -> None:
    """Waits for each bucket's compiles, in order, and counts it ready."""
    reported = self._reported
    for index, description, start, compiles in started:
      while not self._stopped:
        _, waiting = concurrent.futures.wait(compiles, timeout=0.1)
        if not waiting:
          break
      if self._stopped:
        for _, _, _, others in started:
          for future in others:
            future.cancel()
        return
      try:
        item = _finished(description, start, compiles, reported)
      except Exception as error:  # pylint: disable=broad-except
        self._fail(index, description, error)
        continue
      with self._condition:
        self._ready += 1
        self._condition.notify_all()
      self._bar.step(item)

  def _fail(self, index: int, description: str, error: BaseException) -> None:
    message = (f'bucket {index} {description}: {type(error).__name__}: '
               f'{error}')
    logger.warning(
        'torch_xla_patches.serve: the background compile of %s raised; calls '
        'of that bucket compile it again and raise what it raises', message)
    with self._condition:
      self._failed.append(message)
      self._condition.notify_all()


def _describe_spec(spec: Any) -> str:
  if isinstance(spec, CallSpec):
    return spec.describe()
  return repr(spec)


_live: 'weakref.WeakSet[BackgroundWarmUp]' = weakref.WeakSet()
_live_lock = threading.Lock()


@atexit.register
def stop_background_warm_ups() -> None:
  """Stops every background warm-up from starting more compiles (revert(),
  interpreter exit, before the compile pool stops)."""
  with _live_lock:
    warm_ups = list(_live)
  for warm_up in warm_ups:
    warm_up.stop()
