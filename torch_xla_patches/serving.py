"""serve(): a model compiled for its serving buckets, kept across restarts.

  served = torch_xla_patches.serve(model, buckets, cache_dir='/var/cache/xla')
  served(tokens)               # returns what model(tokens) returns

[Note: Serving restarts]
With a cache directory, serve() keeps one artifact per model and argument
layout in <cache_dir>/serve/, named <model>-<key>.xla_aot, where the key is a
digest of what must match for the artifact to be used: the model's source
(source_digest), the torch, torch_xla and Python versions (runtime.py) and
the argument layout (each argument's dtype and rank). A process that finds
its artifact loads it (no dynamo frame), compiles the buckets, and the
signatures recorded in the artifact and the signature index wait in the
graph's backlog as any restart's do (see [Note: Replaying recorded
signatures]). A process that does not (first start, edited source, other
versions, a damaged file) logs one line with the reason, captures the model
with dynamo once (aot_compile: no AOTAutograd), compiles the buckets and
writes the artifact atomically, so processes sharing the directory see the
old file or the new one, never a part. Nothing in the directory can fail a
call: a file that does not load is a reason to trace, and a failed write is
a warning.

On torch 2.8 there is no aot_compile: serve() compiles through torch.compile
and the signature index, and every restart traces dynamo again (said once in
the log).
"""
import dataclasses
import glob
import hashlib
import json
import logging
import os
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import config
from torch_xla_patches import fast_dispatch
from torch_xla_patches import io_utils
from torch_xla_patches import runtime
from torch_xla_patches import serialization
from torch_xla_patches import source_digest
from torch_xla_patches import versions
from torch_xla_patches import warmup
from torch_xla_patches.io_utils import TensorSpec

logger = logging.getLogger('torch_xla_patches.serving')

SERVE_DIR = 'serve'
ARTIFACT_SUFFIX = '.xla_aot'

_warned_no_aot_compile = False


@dataclasses.dataclass(frozen=True)
class ArgumentLayout:
  """The dtype and rank of each positional argument of the served model."""
  args: Tuple[Tuple[str, int], ...]

  @classmethod
  def of(cls, bucket: Sequence[TensorSpec]) -> 'ArgumentLayout':
    return cls(
        tuple((io_utils.dtype_name(spec.dtype), len(spec.shape))
              for spec in bucket))

  def describe(self) -> str:
    return ', '.join(f'{dtype}[rank {rank}]' for dtype, rank in self.args)


def _buckets(signatures: Iterable[Sequence[TensorSpec]]) -> List[tuple]:
  """The buckets, checked: tuples of TensorSpec of one layout."""
  buckets = [tuple(bucket) for bucket in signatures]
  if not buckets:
    raise ValueError('torch_xla_patches.serve: signatures is empty; give one '
                     'tuple of TensorSpec per serving bucket')
  for index, bucket in enumerate(buckets):
    for position, spec in enumerate(bucket):
      if not isinstance(spec, TensorSpec):
        raise TypeError(f'torch_xla_patches.serve: signature {index}, '
                        f'argument {position} is {type(spec).__name__}, '
                        'expected a TensorSpec')
    if ArgumentLayout.of(bucket) != ArgumentLayout.of(buckets[0]):
      raise ValueError(
          f'torch_xla_patches.serve: signature {index} has arguments '
          f'{ArgumentLayout.of(bucket).describe()}, signature 0 '
          f'{ArgumentLayout.of(buckets[0]).describe()}; every bucket must '
          'have the same dtypes and ranks')
  return buckets


def _check_model(model: Any) -> None:
  if not isinstance(model, torch.nn.Module):
    raise TypeError('torch_xla_patches.serve: model must be an nn.Module, '
                    f'got {type(model).__name__}')
  for name, tensor in list(model.named_parameters()) + list(
      model.named_buffers()):
    if tensor.device.type != 'xla':
      raise ValueError(f'torch_xla_patches.serve: {name} is on '
                       f'{tensor.device}; move the model to '
                       'torch_xla.device() first')


def artifact_path(cache_dir: str, model: torch.nn.Module,
                  layout: ArgumentLayout) -> str:
  """Where serve() keeps the artifact of `model` (see [Note: Serving
  restarts])."""
  found = runtime.runtime_versions()
  key = hashlib.sha256(
      json.dumps(
          {
              'source': source_digest.digest(source_digest.source_parts(model)),
              'versions': dataclasses.asdict(found),
              'layout': layout.args,
          },
          sort_keys=True).encode()).hexdigest()[:16]
  name = source_digest.model_name(model).replace('.', '_')
  return os.path.join(cache_dir, SERVE_DIR, f'{name}-{key}{ARTIFACT_SUFFIX}')


def _why_not_found(path: str, model: torch.nn.Module) -> str:
  """Why no artifact of `model` matches: what the closest one differs in."""
  prefix = os.path.basename(path).rsplit('-', 1)[0]
  others = sorted(
      glob.glob(
          os.path.join(glob.escape(os.path.dirname(path)),
                       f'{glob.escape(prefix)}-*{ARTIFACT_SUFFIX}')))
  reasons = []
  for other in others:
    try:
      serialization.check(other, model)
    except serialization.ArtifactError as e:
      reasons.append(f'{os.path.basename(other)}: {e}')
      continue
    reasons.append(f'{os.path.basename(other)} has another argument layout')
  if not reasons:
    return 'no artifact of this model yet'
  return 'none matches; ' + ' | '.join(reasons[-1:])


class ServedModel:
  """What serve() returns: call it like the model.

  A call takes the fast path (see [Note: Served fast path]) when it can, and
  otherwise the full path: the captured code with dynamo's guards, or, where
  those refuse the call, a re-trace with torch.compile. Calls run without
  autograd whatever the grad mode.

  Args:
    compiled: the compiled callable (an aot_compile'd CompiledModel, or a
      torch.compile'd module on torch 2.8, which has no fast path).
    model: the served module.
    artifact: the artifact path this process loaded or wrote, or None.
    loaded: whether the artifact was loaded (no dynamo frame).
  """

  def __init__(self, compiled: Any, model: torch.nn.Module,
               artifact: Optional[str], loaded: bool):
    self.compiled = compiled
    self.model = model
    self.artifact = artifact
    self.loaded = loaded
    self.fast_path = (fast_dispatch.FastPath(compiled, model) if isinstance(
        compiled, serialization.CompiledModel) else None)
    self._retraced = None

  def __call__(self, *args):
    fast_path = self.fast_path
    if fast_path is not None:
      result = fast_path.run(args)
      if result is not fast_dispatch.NOT_RUN:
        return result
    return self._full_call(args)

  def _full_call(self, args: Sequence[Any]) -> Any:
    compiled = self.compiled
    if self.fast_path is None:
      with torch.no_grad():
        return compiled(*args)
    if not compiled.guard_check(*args):
      return self._retrace(args)
    with compiled.backend_callable.observed_calls() as calls:
      result = compiled.call_checked(*args)
    self.fast_path.learn(args, result, calls)
    return result

  def _retrace(self, args: Sequence[Any]) -> Any:
    """Serves a call the captured code does not apply to (another dtype, a
    changed module, ...) as torch.compile would: dynamo traces it again."""
    fast_dispatch.count_retrace()
    if self._retraced is None:
      logger.info(
          'torch_xla_patches.serve: dynamo\'s guards refused a call of %s; '
          'such calls are traced again with torch.compile (said once)',
          type(self.model).__name__)
      self._retraced = torch.compile(self.model,
                                     backend='openxla',
                                     dynamic=True)
    with torch.no_grad():
      return self._retraced(*args)


def _compile_buckets(served: ServedModel, buckets: Sequence[tuple]) -> None:
  warmup.precompile(served, buckets, progress=config.precompile_progress)


def _save(compiled: Any, path: str) -> None:
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    serialization.save(compiled, path)
  except OSError as e:
    logger.warning(
        'torch_xla_patches.serve: could not write %s (%s); the next restart '
        'traces again', path, e)


def _example(buckets: Sequence[tuple]) -> tuple:
  """The bucket to capture with: its smallest size largest, so that no size
  of 1 is captured (dynamo specializes 1)."""
  return max(buckets,
             key=lambda b: min((min(s.shape, default=2) for s in b), default=2))


def serve(model: torch.nn.Module,
          signatures: Iterable[Sequence[TensorSpec]],
          *,
          cache_dir: Optional[str] = None) -> ServedModel:
  """See torch_xla_patches.serve."""
  import torch_xla
  _check_model(model)
  buckets = _buckets(signatures)
  cache_dir = os.fspath(cache_dir) if cache_dir else config.cache_dir
  if not versions.has_torch_aot_compile():
    return _serve_without_aot_compile(model, buckets)
  layout = ArgumentLayout.of(buckets[0])
  path = artifact_path(cache_dir, model, layout) if cache_dir else None
  if path is not None:
    reason = None
    if not os.path.lexists(path):
      reason = _why_not_found(path, model)
    else:
      try:
        compiled = serialization.load(path, model=model, precompile=False)
      except serialization.ArtifactError as e:
        reason = str(e)
    if reason is None:
      served = ServedModel(compiled, model, path, loaded=True)
      _compile_buckets(served, buckets)
      return served
    logger.info('torch_xla_patches.serve: tracing %s (%s)',
                source_digest.model_name(model), reason)
  device = torch_xla.device()
  example = tuple(spec.materialize(device) for spec in _example(buckets))
  compiled = serialization.aot_compile(model, example)
  served = ServedModel(compiled, model, path, loaded=False)
  _compile_buckets(served, buckets)
  if path is not None:
    _save(compiled, path)
  return served


def _serve_without_aot_compile(model: torch.nn.Module,
                               buckets: Sequence[tuple]) -> ServedModel:
  global _warned_no_aot_compile
  if not _warned_no_aot_compile:
    _warned_no_aot_compile = True
    logger.info(
        'torch_xla_patches.serve: torch %s has no aot_compile, so every '
        'restart traces the model with dynamo again; the signature index '
        'still compiles the recorded signatures first.', torch.__version__)
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  served = ServedModel(compiled, model, None, loaded=False)
  _compile_buckets(served, buckets)
  return served
