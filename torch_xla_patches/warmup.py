"""Warm-up: compile shape signatures before requests need them.

`precompile(compiled_fn, specs)` runs a torch.compile'd callable once per
signature, so dynamo traces once (dynamic=True) and the bridge compiles one
XLA program per signature. (Signatures recorded by the persistent index or an
artifact are replayed by the bridge itself, see backlog.py.)

With config.compile_workers > 1 the calls go through the bridge in two passes
and the XLA compiles run on worker threads, overlapping the traces (see
[Note: Parallel precompile] in compile_window.py); traces themselves run one
after another, on the calling thread.
"""
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import torch_xla

from torch_xla_patches.backlog import compile_stats
from torch_xla_patches import call_spec, compile_window, config, io_utils
from torch_xla_patches.call_spec import CallSpec
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
  """Compiles one XLA program per signature in `specs`.

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
    One PrecompiledSignature per spec, in order.
  """
  device = torch_xla.device()
  bar = _Progress(len(specs), progress)
  pool = tensor_pool if tensor_pool is not None else {}
  if config.compile_workers > 1 and len(specs) > 1:
    return _precompile_in_parallel(compiled_fn, specs, bar, pool,
                                   config.compile_workers)
  report = []
  for spec in specs:
    args, kwargs = _materialize(spec, device, pool)
    item = _timed_call(compiled_fn, args, kwargs)
    # One signature's tensors alive at a time.
    del args, kwargs
    report.append(item)
    bar.step(item)
  return report


def _timed_call(compiled_fn: Callable, args: Tuple[Any, ...],
                kwargs: Dict[str, Any]) -> PrecompiledSignature:
  compiles_before, compile_seconds_before = compile_stats()
  start = time.perf_counter()
  compiled_fn(*args, **kwargs)
  torch_xla.sync()
  seconds = time.perf_counter() - start
  compiles_after, compile_seconds_after = compile_stats()
  return PrecompiledSignature(description=_describe(args, kwargs),
                              seconds=seconds,
                              compile_seconds=compile_seconds_after -
                              compile_seconds_before,
                              xla_compiles=compiles_after - compiles_before)


def _precompile_in_parallel(compiled_fn: Callable, specs: Sequence[Any],
                            bar: _Progress, pool: Dict[Any, torch.Tensor],
                            workers: int) -> List[PrecompiledSignature]:
  """precompile() in two passes (see [Note: Parallel precompile]). A call
  whose signature compiled on a worker reports the wall seconds of its two
  calls and of its trace and compile, which overlap others'."""
  device = torch_xla.device()
  calls = compile_window.PrecompileCalls(workers)
  report: List[Optional[PrecompiledSignature]] = [None] * len(specs)
  # (spec index, claim number, args, kwargs, seconds of the first pass)
  stopped = []
  for index, spec in enumerate(specs):
    args, kwargs = _materialize(spec, device, pool)
    compiles_before, compile_seconds_before = compile_stats()
    start = time.perf_counter()
    claim = calls.call(functools.partial(compiled_fn, **kwargs), args)
    if claim is None:
      torch_xla.sync()
      compiles_after, compile_seconds_after = compile_stats()
      report[index] = PrecompiledSignature(
          description=_describe(args, kwargs),
          seconds=time.perf_counter() - start,
          compile_seconds=compile_seconds_after - compile_seconds_before,
          xla_compiles=compiles_after - compiles_before)
      bar.step(report[index])
    else:
      stopped.append((index, claim, args, kwargs, time.perf_counter() - start))
  compiled = calls.compile()
  first_of_claim = set()
  for index, claim, args, kwargs, first_seconds in stopped:
    if claim >= compiled.ready:
      # Where the serial precompile would have raised it.
      raise compiled.error
    item = _timed_call(compiled_fn, args, kwargs)
    # Its claimed signature's compile (a later graph of the call may have
    # compiled during the call itself).
    first = claim not in first_of_claim
    first_of_claim.add(claim)
    worker_seconds = compiled.compile_seconds[claim] if first else 0.0
    report[index] = PrecompiledSignature(
        description=item.description,
        seconds=first_seconds + worker_seconds + item.seconds,
        compile_seconds=worker_seconds + item.compile_seconds,
        xla_compiles=int(first and compiled.compiled[claim]) +
        item.xla_compiles)
    bar.step(report[index])
  return report
