"""Warm-up: compile shape signatures before requests need them.

`precompile(compiled_fn, specs)` runs a torch.compile'd callable once per
signature, so dynamo traces once (dynamic=True) and the bridge compiles one
XLA program per signature. (Signatures recorded by the persistent index or an
artifact are replayed by the bridge itself, see backlog.py.)

Compiles run one after another: the lazy tracer's pending-IR state is process
wide (extract_graph_helper syncs and clears it), so two signatures cannot be
traced at once safely.
"""
import dataclasses
import logging
import time
from typing import Any, Callable, List, Sequence, Tuple

import torch

import torch_xla

from torch_xla_patches.backlog import compile_stats
from torch_xla_patches import io_utils
from torch_xla_patches.io_utils import TensorSpec

logger = logging.getLogger('torch_xla_patches.precompile')


@dataclasses.dataclass(frozen=True)
class PrecompiledSignature:
  description: str
  # Wall seconds of the call (trace + compile + one run on zeros).
  seconds: float
  # Seconds XLA spent compiling during the call (0 if it was cached).
  compile_seconds: float
  xla_compiles: int


def _describe(args: Sequence[Any]) -> str:
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
               progress: bool = True) -> List[PrecompiledSignature]:
  """Compiles one XLA program per signature in `specs`.

  Args:
    compiled_fn: a callable made by torch.compile(..., backend='openxla'),
      ideally with dynamic=True so dynamo traces once.
    specs: one entry per signature: a tuple of positional arguments, each a
      tensor, a TensorSpec, or a Python number (a single non-tuple item is a
      one-argument call).
    progress: log a line per signature (signature, seconds, ETA) on the
      `torch_xla_patches.precompile` logger.
  Returns:
    One PrecompiledSignature per spec, in order.
  """
  device = torch_xla.device()
  bar = _Progress(len(specs), progress)
  report = []
  for spec in specs:
    args = _materialize(spec, device)
    compiles_before, compile_seconds_before = compile_stats()
    start = time.perf_counter()
    compiled_fn(*args)
    torch_xla.sync()
    seconds = time.perf_counter() - start
    compiles_after, compile_seconds_after = compile_stats()
    item = PrecompiledSignature(description=_describe(args),
                                seconds=seconds,
                                compile_seconds=compile_seconds_after -
                                compile_seconds_before,
                                xla_compiles=compiles_after - compiles_before)
    report.append(item)
    bar.step(item)
  return report
