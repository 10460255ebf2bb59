"""Warm-up: compile shape signatures before requests need them.

`precompile(compiled_fn, specs)` runs a torch.compile'd callable once per
signature, so dynamo traces once (dynamic=True) and the bridge compiles one
XLA program per signature. `precompile_backlog` does the same for the
signatures the persistent index recorded (see persistent.py), without dynamo
and without running anything.

Compiles run one after another. XLA's compile releases the GIL, but on the CPU
client one compile already keeps ~1.6 of this machine's 2 cores busy, and the
lazy tracer's pending-IR state is process wide (extract_graph_helper syncs
and clears it), so two signatures cannot be traced at once safely.
"""
import dataclasses
import sys
import time
import warnings
from typing import Any, Callable, List, Optional, Sequence, TextIO, Tuple

import torch

import torch_xla
import torch_xla.debug.metrics as metrics

from torch_xla_patches import config


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """A tensor argument given by shape and dtype; precompile makes zeros."""
  shape: Tuple[int, ...]
  dtype: torch.dtype = torch.float32

  def materialize(self, device) -> torch.Tensor:
    from torch_xla_patches import persistent
    return persistent.zeros_on_device(self.shape, self.dtype, device)


@dataclasses.dataclass(frozen=True)
class PrecompiledSignature:
  description: str
  # Wall seconds of the call (trace + compile + one run on zeros).
  seconds: float
  # Seconds XLA spent compiling during the call (0 if it was cached).
  compile_seconds: float
  xla_compiles: int


def _compile_stats() -> Tuple[int, float]:
  data = metrics.metric_data('CompileTime')
  if not data:
    return 0, 0.0
  count, total_ns = data[0], data[1]
  return count, total_ns / 1e9


def _describe(args: Sequence[Any]) -> str:
  parts = []
  for arg in args:
    if isinstance(arg, torch.Tensor):
      parts.append(f'{tuple(arg.shape)}:{str(arg.dtype).replace("torch.", "")}')
    else:
      parts.append(repr(arg))
  return ' '.join(parts)


class _Progress:
  """One line per signature: what, how long, how long XLA compiled, ETA."""

  def __init__(self, total: int, enabled: bool, stream: TextIO):
    self.total = total
    self.enabled = enabled
    self.stream = stream
    self.start = time.perf_counter()
    self.done = 0

  def step(self, item: PrecompiledSignature) -> None:
    self.done += 1
    if not self.enabled:
      return
    elapsed = time.perf_counter() - self.start
    eta = elapsed / self.done * (self.total - self.done)
    width = len(str(self.total))
    self.stream.write(f'[precompile {self.done:>{width}}/{self.total}] '
                      f'{item.description:<28} {item.seconds:6.2f} s '
                      f'(xla compile {item.compile_seconds:5.2f} s)  '
                      f'ETA {eta:5.1f} s\n')
    self.stream.flush()


def _materialize(spec: Any, device) -> Tuple[Any, ...]:
  items = spec if isinstance(spec, (tuple, list)) else (spec,)
  args = []
  for item in items:
    if isinstance(item, TensorSpec):
      args.append(item.materialize(device))
    elif isinstance(item, torch.Tensor):
      args.append(item.to(device))
    else:
      args.append(item)
  return tuple(args)


def precompile(compiled_fn: Callable,
               specs: Sequence[Any],
               progress: bool = True,
               stream: Optional[TextIO] = None) -> List[PrecompiledSignature]:
  """Compiles one XLA program per signature in `specs`.

  Args:
    compiled_fn: a callable made by torch.compile(..., backend='openxla'),
      ideally with dynamic=True so dynamo traces once.
    specs: one entry per signature: a tuple of positional arguments, each a
      tensor, a TensorSpec, or a Python number (a single non-tuple item is a
      one-argument call).
    progress: print a line per signature (signature, seconds, ETA).
  Returns:
    One PrecompiledSignature per spec, in order.
  """
  device = torch_xla.device()
  bar = _Progress(len(specs), progress, stream or sys.stderr)
  report = []
  for spec in specs:
    args = _materialize(spec, device)
    compiles_before, compile_seconds_before = _compile_stats()
    start = time.perf_counter()
    compiled_fn(*args)
    torch_xla.sync()
    seconds = time.perf_counter() - start
    compiles_after, compile_seconds_after = _compile_stats()
    item = PrecompiledSignature(description=_describe(args),
                                seconds=seconds,
                                compile_seconds=compile_seconds_after -
                                compile_seconds_before,
                                xla_compiles=compiles_after - compiles_before)
    report.append(item)
    bar.step(item)
  return report


def precompile_backlog(cache, live_args: Sequence[Any]) -> int:
  """Compiles every signature the index recorded for `cache`'s graph."""
  bar = _Progress(len(cache.backlog), config.precompile_progress, sys.stderr)
  compiled = 0
  while cache.backlog:
    compiles_before, seconds_before = _compile_stats()
    start = time.perf_counter()
    specs = cache.backlog[0]
    if not cache.precompile_next(live_args):
      break
    compiled += 1
    compiles_after, seconds_after = _compile_stats()
    bar.step(
        PrecompiledSignature(description=f'graph {cache.graph_id} ' + ' '.join(
            str(s.get('value', s.get('shape')))
            for s in specs
            if s is not None),
                             seconds=time.perf_counter() - start,
                             compile_seconds=seconds_after - seconds_before,
                             xla_compiles=compiles_after - compiles_before))
  check_persistent_executables()
  return compiled


_warned_no_executable_loading = False


def check_persistent_executables() -> Optional[bool]:
  """Whether persisted executables really load: True, False, or None when
  nothing was tried. Says so once, plainly, when they do not."""
  global _warned_no_executable_loading
  if not config.persistent_executables:
    return None
  failures = metrics.counter_value('PersistentCacheDeserializeFailure') or 0
  hits = metrics.counter_value('PersistentCacheHit') or 0
  if failures and not _warned_no_executable_loading:
    _warned_no_executable_loading = True
    import torch_xla.runtime as xr
    warnings.warn(
        f'torch_xla_patches: torch_xla {torch_xla.__version__} could not load '
        f'{failures} persisted XLA executable(s) on {xr.device_type()} '
        '(PersistentCacheDeserializeFailure). Nothing was loaded from disk: '
        'the signature index made this process compile those programs again.')
  if failures:
    return False
  return True if hits else None
