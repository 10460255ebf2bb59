"""Warm-up: compile shape signatures before requests need them.

`precompile(compiled_fn, specs)` runs a torch.compile'd callable once per
signature, so dynamo traces once (dynamic=True) and the bridge compiles one
XLA program per signature. (Signatures recorded by the persistent index or an
artifact are replayed by the bridge itself: SignatureCache.drain_backlog.)

Compiles run one after another: the lazy tracer's pending-IR state is process
wide (extract_graph_helper syncs and clears it), so two signatures cannot be
traced at once safely.
"""
import dataclasses
import sys
import time
from typing import Any, Callable, List, Optional, Sequence, TextIO, Tuple

import torch

import torch_xla
import torch_xla.debug.metrics as metrics

from torch_xla_patches import io_utils


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """A tensor argument given by shape and dtype; precompile makes zeros."""
  shape: Tuple[int, ...]
  dtype: torch.dtype = torch.float32

  def materialize(self, device) -> torch.Tensor:
    return io_utils.zeros_on_device(self.shape, self.dtype, device)


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
      parts.append(f'{tuple(arg.shape)}:{io_utils.dtype_name(arg.dtype)}')
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
