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


def _materialize(spec: Any, device,
                 pool: Dict[Any, torch.Tensor]) -> Tuple[tuple, Dict[str, Any]]:
  """(args, kwargs) of one entry of precompile's specs; CallSpec tensors are
  shared between entries through `pool` (see CallSpec.materialize)."""
  if isinstance(spec, CallSpec):
    return spec.materialize(device, pool)
  items = spec if isinstance(spec, (tuple, list)) else (spec,)
  args = []
  for item in items:
    if isinstance(item, TensorSpec):
      args.append(item.materialize(device))
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
    args, kwargs = _materialize(spec, device, pool)
    start = time.perf_counter()
    compiles = compile_without_running(compiled_fn, args, kwargs)
    started.append((_describe(args, kwargs), start, compiles))
    # The compiles hold the device data their graphs read, not the tensors.
    del args, kwargs
  report = []
  reported: Set[int] = set()
  for description, start, compiles in started:
    report.append(_finished(description, start, compiles, reported))
    bar.step(report[-1])
  return report


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
  """

  def __init__(self, call: Callable[..., Any], specs: Sequence[CallSpec],
               tensor_pool: Optional[Dict[Any, torch.Tensor]],
               then: Optional[Callable[[], None]]):
    self._call = call
    self._specs = list(specs)
    self._tensor_pool = tensor_pool
    self._then = then
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
    run, or `timeout` seconds; returns whether every bucket is compiled."""
    with self._condition:
      self._condition.wait_for(lambda: self._over or self._stopped, timeout)
      return self._ready == len(self._specs)

  def stop(self) -> None:
    """Starts no more compiles and cancels its queued ones (revert()); waits
    until its thread has stopped."""
    with self._condition:
      self._stopped = True
      self._condition.notify_all()
    if threading.current_thread() is not self._thread:
      self._thread.join()

  def _run(self) -> None:
    try:
      started = self._start_compiles()
      self._tensor_pool = None
      self._finish_compiles(started)
      if self._then is not None and not self._stopped:
        self._then()
    finally:
      with _live_lock:
        _live.discard(self)
      with self._condition:
        self._over = True
        self._condition.notify_all()

  def _start_compiles(self) -> List[Tuple[int, str, float, List[Any]]]:
    """Traces each bucket on this thread; its compile goes to the pool."""
    device = torch_xla.device()
    pool = self._tensor_pool if self._tensor_pool is not None else {}
    started = []
    for index, spec in enumerate(self._specs):
      if self._stopped:
        break
      description = _describe_spec(spec)
      start = time.perf_counter()
      try:
        args, kwargs = _materialize(spec, device, pool)
        compiles = compile_without_running(self._call, args, kwargs)
        del args, kwargs
      except Exception as error:  # pylint: disable=broad-except
        self._fail(index, description, error)
        continue
      started.append((index, description, start, compiles))
    return started

  def _finish_compiles(
      self, started: List[Tuple[int, str, float, List[Any]]]) -> None:
    """Waits for each bucket's compiles, in order, and counts it ready."""
    reported: Set[int] = set()
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
