"""File and tensor helpers shared by the index, warm-up and serialization.

A tensor is described by a `TensorSpec` (sizes and dtype), and an argument by
an `ArgSpec` (a TensorSpec's JSON form, or a number); `canonical_json` is the
one way a record is frozen to a string (for identities and de-duplication).
"""
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import stat
import tempfile
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

# What syncs waiting for placeholder traces say (see [Note: Syncs wait for
# placeholder graphs]); the bridge's part.
_logger = logging.getLogger('torch_xla_patches.bridge')


def dtype_name(dtype: torch.dtype) -> str:
  return str(dtype).replace('torch.', '')


def dtype_from_name(name: Any) -> torch.dtype:
  dtype = getattr(torch, name, None) if isinstance(name, str) else None
  if not isinstance(dtype, torch.dtype):
    raise ValueError(f'unknown dtype {name!r}')
  return dtype


# Tensors of at least this many bytes are made on the device (see
# zeros_on_device).
DEVICE_ZEROS_BYTES = 64 << 20


def zeros_on_device(shape: Sequence[int], dtype: torch.dtype,
                    device: Any) -> torch.Tensor:
  """Zeros on `device`, as device data (no pending IR).

  Small tensors are made on the host and copied: made on the device, each
  would be a small XLA program of its own, compiled once per shape. Large
  ones (a KV cache) are made on the device by such a program: a host copy
  would need the tensor's memory twice at the peak."""
  shape = tuple(shape)
  nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
  if nbytes < DEVICE_ZEROS_BYTES or torch.device(device).type != 'xla':
    return torch.zeros(shape, dtype=dtype).to(device)
  import torch_xla
  tensor = torch.zeros(shape, dtype=dtype, device=device)
  torch_xla._XLAC._xla_sync_multi([tensor],
                                  devices=[],
                                  wait=True,
                                  sync_xla_data=True)
  return tensor


# [Note: Placeholder tensors]
# A trace needs its arguments' sizes, dtypes and shardings, never their
# values: what a warm-up traces with, and what a new signature is traced on
# (see [Note: Traces on placeholders] in placeholder_trace.py), is made by
# `placeholder()`, the one maker of them: device data with a shape and no
# buffer (torch_xla's placeholder tensor), so a bucket's KV cache costs no
# device memory and a trace touches no tensor another thread runs. Lazy
# tracing, graph hashes and XLA compiles (`_xla_warm_up_cache`) read only the
# shape of such data; but a compile of a graph with a placeholder among its
# inputs holds torch_xla's device lock throughout (see [Note: Threads] in
# execution.py), and runs of other threads wait for it. Running a program
# that reads it crashes the process (torch_xla does not check), so whatever
# holds a placeholder's IR must
# never be run: the trace's restore gives a placeholder a fresh one instead
# of syncing it (ArgumentsRestore in tracing.py), and every trace on
# placeholders is in flight in the one registry (placeholder_traces) until
# its compiles are done, which keeps its graphs out of every sync of the
# device (see [Note: Syncs wait for placeholder graphs]). With that sync's
# guard not installed (no apply(), or after revert()) or
# config.trace_on_placeholders off, nothing traces on placeholders
# (TensorSpec.for_trace makes zeros). A placeholder cannot be sharded
# (`mark_sharding` copies the tensor's data, and a sharding annotation on
# its IR is a node of the program), so a sharded TensorSpec is a sharded
# stand-in (`sharded_stand_in`): zeros made on the device already split
# (one copy over the mesh, never a replicated one), which a trace treats as
# a placeholder too. It keeps a second tensor on the same data (its
# keeper, which nothing traces): the restore gives the stand-in the
# keeper's data back instead of copying a clone into it and syncing, so
# nothing runs and no second copy is made.
_placeholders: Dict[int, Any] = {}
# id(stand-in) -> its keeper (see sharded_stand_in).
_keepers: Dict[int, torch.Tensor] = {}


def placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
  """A tensor of `shape` and `dtype` on the XLA device that holds no
  buffer (see [Note: Placeholder tensors])."""
  import torch_xla.core.xla_builder as xb
  return _noted(
      xb.create_placeholder_tensor(tuple(int(s) for s in shape), dtype))


def _noted(tensor: torch.Tensor) -> torch.Tensor:
  key = id(tensor)

  def forget(_):
    _placeholders.pop(key, None)
    _keepers.pop(key, None)

  _placeholders[key] = weakref.ref(tensor, forget)
  return tensor


def is_placeholder(tensor: Any) -> bool:
  """Whether `tensor` was made by placeholder() or sharded_stand_in() (its
  data may since have been replaced by another placeholder's, or its
  keeper's, never by a buffer of its own)."""
  ref = _placeholders.get(id(tensor))
  return ref is not None and ref() is tensor


def is_stand_in(tensor: Any) -> bool:
  """Whether `tensor` is a sharded stand-in (a placeholder with data: see
  [Note: Placeholder tensors])."""
  return is_placeholder(tensor) and id(tensor) in _keepers


def reset_placeholder(tensor: torch.Tensor) -> None:
  """Gives a placeholder the data of a fresh one, a stand-in its keeper's:
  whatever IR a trace left on it is dropped, and nothing runs."""
  import torch_xla
  keeper = _keepers.get(id(tensor))
  if keeper is None:
    keeper = placeholder(tensor.shape, tensor.dtype)
  torch_xla._XLAC._replace_xla_tensor(tensor, keeper)


def zeros_for_placeholders(xla_args: Sequence[Any]) -> List[Any]:
  """`xla_args` with each placeholder replaced by zeros of its size (see
  [Note: Look-ahead on placeholders] in dynamo_bridge.py)."""
  return [
      zeros_on_device(a.shape, a.dtype, a.device)
      if is_placeholder(a) and not is_stand_in(a) else a for a in xla_args
  ]


def sharded_stand_in(shape: Sequence[int], dtype: torch.dtype,
                     sharding: 'Sharding', device: Any) -> torch.Tensor:
  """A placeholder for a sharded tensor (see [Note: Placeholder tensors]):
  zeros split as `sharding` says, and a keeper on the same data."""
  import torch_xla
  tensor = sharded_zeros(shape, dtype, sharding, device)
  keeper = torch.empty(tuple(shape), dtype=dtype, device=device)
  torch_xla._XLAC._replace_xla_tensor(keeper, tensor)
  _noted(tensor)
  _keepers[id(tensor)] = keeper
  return tensor


def sharded_zeros(shape: Sequence[int], dtype: torch.dtype,
                  sharding: 'Sharding', device: Any) -> torch.Tensor:
  """Zeros on `device` split as `sharding` says, as device data: the
  sharding is set on the zeros' IR before the sync, so the sync makes each
  shard on its device and no device ever holds the whole tensor."""
  import torch_xla
  tensor = torch.zeros(tuple(shape), dtype=dtype, device=device)
  sharding.apply(tensor)
  torch_xla._XLAC._xla_sync_multi([tensor],
                                  devices=[],
                                  wait=True,
                                  sync_xla_data=True)
  return tensor


class PlaceholderWaitTimeout(RuntimeError):
  """A sync or a placeholder trace waited longer than
  config.placeholder_wait_timeout for the other (see [Note: Syncs wait for
  placeholder graphs])."""


class PlaceholderTraces:
  """The one registry of traces on placeholders in flight (a warm-up's
  compile-only calls, a new signature's trace and compile, see [Note:
  Traces on placeholders] in placeholder_trace.py), and the guard of torch_xla's
  step marker that makes a sync of the device wait for them.

  [Note: Syncs wait for placeholder graphs]
  A trace on placeholders (see [Note: Placeholder tensors]) leaves the graph
  it traced pending on tensors until its compile is done. A sync of every
  live tensor of the device (torch_xla.sync(), xm.mark_step(),
  torch_xla.step(), on any thread) would run that graph, and running a
  placeholder crashes the process. So apply() wraps torch_xla's step marker
  (`_XLAC._xla_step_marker`, which all of them call) through the patch
  registry (guarding; revert() puts it back): a sync waits until no
  placeholder trace is in flight, and holds new ones off while it runs.
  Without that guard (guarded() is False) nothing traces on placeholders.
  A trace is in flight from the making of its placeholders until its
  compiles are done (begin() to end()).
  Who waits for whom, so that no wait closes a cycle:
    * a sync waits for the traces in flight, holding no lock of the bridge
      (nothing of the package syncs every live tensor under a lock; the
      SPMD donating run's `_xla_sync_live_tensors` runs where no
      placeholder is ever made, see TensorSpec.for_trace);
    * a trace about to begin waits while a sync runs (the step marker
      itself waits for nothing of ours). It also waits while a sync waits,
      so that a sync is not starved by a warm-up tracing bucket after
      bucket, unless it begins on the compile pool (`on_pool`) or on a
      thread already in a trace: the traces the sync waits for may be
      queued behind it, or be its own;
    * a sync inside a trace on placeholders raises instead of waiting for
      itself.
  Every wait is bounded by config.placeholder_wait_timeout: a sync that
  waited that long raises PlaceholderWaitTimeout (logged; nothing ran, the
  caller may sync again), and so does a trace that could not begin (its
  caller then traces the real arguments, or fails the bucket with that
  error). Nothing in flight, the guard costs a lock and a check. A
  signature a restart replays from its records inside a placeholder call
  (on_this_thread) is traced on placeholders too, and its compile is one of
  the call's.
  """

  def __init__(self):
    self._condition = threading.Condition()
    self._in_flight = 0
    self._syncs_waiting = 0
    self._syncs_running = 0
    self._guarded = False
    # How many traces this thread is in.
    self._depth = threading.local()

  def guarded(self) -> bool:
    """Whether traces may use placeholders: the step marker is guarded and
    config.trace_on_placeholders is on."""
    from torch_xla_patches import config
    return self._guarded and config.trace_on_placeholders

  def guarding(self, step_marker: Callable[..., Any]) -> Callable[..., Any]:
    """`step_marker` (torch_xla's), made to wait for the traces in flight;
    from now on, guarded() (see [Note: Syncs wait for placeholder
    graphs])."""

    @functools.wraps(step_marker)
    def waiting_step_marker(*args, **kwargs):
      if self.on_this_thread():
        raise RuntimeError(
            'torch_xla_patches: a sync of the device inside a trace on '
            'placeholders would run them (see [Note: Syncs wait for '
            'placeholder graphs] in io_utils.py); such a trace cannot sync')
      self._wait_for_traces()
      try:
        return step_marker(*args, **kwargs)
      finally:
        with self._condition:
          self._syncs_running -= 1
          self._condition.notify_all()

    self._guarded = True
    return waiting_step_marker

  def unguarded(self) -> None:
    """revert() took the guard away: nothing traces on placeholders."""
    self._guarded = False

  def begin(self, on_pool: bool = False) -> None:
    """A trace on placeholders starts on this thread (see [Note: Syncs wait
    for placeholder graphs] for what it waits for); raises
    PlaceholderWaitTimeout if it could not."""
    from torch_xla_patches import config
    nested = self.on_this_thread()
    with self._condition:
      if not nested:
        defer = not on_pool
        if not self._condition.wait_for(
            lambda: not self._syncs_running and
            (not defer or not self._syncs_waiting),
            config.placeholder_wait_timeout):
          raise self._timeout(
              f'a trace on placeholders waited '
              f'{config.placeholder_wait_timeout:g} s for a sync of the '
              f'device ({self._syncs_running} running, '
              f'{self._syncs_waiting} waiting)')
      self._in_flight += 1
    self._depth.value = getattr(self._depth, 'value', 0) + 1

  def on_this_thread(self) -> bool:
    """Whether this thread is in a trace on placeholders."""
    return getattr(self._depth, 'value', 0) > 0

  def traced(self) -> None:
    """This thread's trace has handed its graphs over (they stay in flight
    until end())."""
    self._depth.value -= 1

  def end(self) -> None:
    with self._condition:
      self._in_flight -= 1
      self._condition.notify_all()

  def end_when_done(self, compiles: Sequence[Any]) -> None:
    """Ends a call once `compiles` (its futures) are done."""
    pending = [f for f in compiles if not f.done()]
    if not pending:
      self.end()
      return
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_):
      with lock:
        left[0] -= 1
        last = left[0] == 0
      if last:
        self.end()

    for future in pending:
      future.add_done_callback(one_done)

  def in_flight(self) -> int:
    """How many traces on placeholders are in flight."""
    with self._condition:
      return self._in_flight

  def syncs_waiting(self) -> int:
    """How many syncs wait for placeholder traces in flight."""
    with self._condition:
      return self._syncs_waiting

  def _wait_for_traces(self) -> None:
    """Waits until no trace is in flight, then counts this sync running."""
    from torch_xla_patches import config
    limit = config.placeholder_wait_timeout
    warn_after = min(_SYNC_WARN_AFTER_S, limit)
    with self._condition:
      self._syncs_waiting += 1
      try:
        if not self._condition.wait_for(lambda: not self._in_flight,
                                        warn_after):
          _logger.warning(
              'torch_xla_patches: a sync of the device has waited %g s for '
              '%d trace(s) on placeholders in flight (see [Note: Syncs wait '
              'for placeholder graphs] in io_utils.py)', warn_after,
              self._in_flight)
          if not self._condition.wait_for(lambda: not self._in_flight,
                                          limit - warn_after):
            raise self._timeout(
                f'a sync of the device waited {limit:g} s for '
                f'{self._in_flight} trace(s) on placeholders in flight; it '
                f'did not run (sync again, or raise '
                f'XLA_PATCHES_PLACEHOLDER_WAIT_TIMEOUT)')
      finally:
        self._syncs_waiting -= 1
        self._condition.notify_all()
      self._syncs_running += 1

  @staticmethod
  def _timeout(message: str) -> PlaceholderWaitTimeout:
    _logger.error('torch_xla_patches: %s', message)
    return PlaceholderWaitTimeout('torch_xla_patches: ' + message)


# A sync that waits this long for placeholder traces says so in the log.
_SYNC_WARN_AFTER_S = 10.0

placeholder_traces = PlaceholderTraces()


@dataclasses.dataclass(frozen=True)
class Sharding:
  """How an SPMD tensor is split over a mesh, as `mark_sharding(tensor,
  mesh, partition_spec)` takes it, in values that compare and hash.

  Args:
    mesh_shape, device_ids, axis_names: the mesh's.
    partition_spec: per dimension, a mesh axis name or index, a tuple of
      them, or None (replicated along that dimension).
  """
  mesh_shape: Tuple[int, ...]
  device_ids: Tuple[int, ...]
  axis_names: Optional[Tuple[str, ...]]
  partition_spec: Tuple[Any, ...]

  @classmethod
  def of(cls, mesh: Any, partition_spec: Sequence[Any]) -> 'Sharding':
    names = getattr(mesh, 'axis_names', None)
    return cls(
        mesh_shape=tuple(int(n) for n in mesh.mesh_shape),
        device_ids=tuple(int(i) for i in mesh.device_ids),
        axis_names=tuple(names) if names is not None else None,
        partition_spec=tuple(
            tuple(p) if isinstance(p, list) else p for p in partition_spec))

  def apply(self, tensor: torch.Tensor) -> None:
    import numpy as np
    import torch_xla.distributed.spmd as xs
    mesh = xs.Mesh(np.array(self.device_ids), self.mesh_shape, self.axis_names)
    xs.mark_sharding(tensor, mesh, self.partition_spec)

  def to_json(self) -> Dict[str, Any]:
    return json_round_trip(dataclasses.asdict(self))

  def describe(self) -> str:
    return '{' + ','.join(str(p) for p in self.partition_spec) + '}'


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """A tensor described by its sizes and dtype; `materialize` makes zeros.

  Records and artifacts hold it as JSON, `to_json()`:
  {"shape": [...], "dtype": "float32"}; a sharding (SPMD) is not recorded:
  recorded signatures are replayed with the live call's shardings.

  Args:
    shape, dtype: the tensor's.
    sharding: under SPMD, a Sharding, or (mesh, partition_spec) as
      `mark_sharding` takes them: the zeros are sharded so.
  """
  shape: Tuple[int, ...]
  dtype: torch.dtype = torch.float32
  sharding: Optional[Sharding] = None

  def __post_init__(self):
    if self.sharding is not None and not isinstance(self.sharding, Sharding):
      try:
        mesh, partition_spec = self.sharding
      except (TypeError, ValueError):
        raise TypeError(
            'TensorSpec: sharding is a Sharding or a (mesh, '
            f'partition_spec) pair, not {self.sharding!r}') from None
      object.__setattr__(self, 'sharding', Sharding.of(mesh, partition_spec))

  @classmethod
  def of(cls, tensor: torch.Tensor) -> 'TensorSpec':
    return cls(tuple(int(s) for s in tensor.shape), tensor.dtype)

  @classmethod
  def from_json(cls, spec: Dict[str, Any]) -> 'TensorSpec':
    return cls(tuple(spec['shape']), dtype_from_name(spec['dtype']))

  def to_json(self) -> Dict[str, Any]:
    return {'shape': list(self.shape), 'dtype': dtype_name(self.dtype)}

  def materialize(self, device: Any) -> torch.Tensor:
    tensor = zeros_on_device(self.shape, self.dtype, device)
    if self.sharding is not None:
      self.sharding.apply(tensor)
    return tensor

  def for_trace(self, device: Any) -> torch.Tensor:
    """A tensor of this spec for a trace that runs nothing (see [Note:
    Placeholder tensors]): a placeholder, or, sharded, a sharded
    stand-in; zeros where placeholders are not used."""
    if torch.device(device).type != 'xla':
      return self.materialize(device)
    if self.sharding is not None:
      # Real data: a sync that runs its IR reads a buffer.
      return sharded_stand_in(self.shape, self.dtype, self.sharding, device)
    import torch_xla.runtime as xr
    if xr.is_spmd() or not placeholder_traces.guarded():
      # A donating run on a mesh syncs the device's pending IR (see [Note:
      # Threads] in execution.py), which would run a placeholder's graph;
      # and without the sync's guard nothing may hold a placeholder.
      return self.materialize(device)
    return placeholder(self.shape, self.dtype)

  def describe(self) -> str:
    sharding = self.sharding.describe() if self.sharding is not None else ''
    return f'{dtype_name(self.dtype)}{list(self.shape)}{sharding}'


# An argument as records and artifacts hold it: a TensorSpec's JSON form, or
# {"value": number}.
ArgSpec = Dict[str, Any]


def arg_spec(arg: Any) -> ArgSpec:
  if isinstance(arg, torch.Tensor):
    return TensorSpec.of(arg).to_json()
  return {'value': arg}


def arg_from_spec(spec: ArgSpec, device: Any, for_trace: bool = False) -> Any:
  """The argument `arg_spec` described: zeros of its sizes (with
  `for_trace`, see TensorSpec.for_trace), or the number."""
  if 'value' in spec:
    return spec['value']
  tensor_spec = TensorSpec.from_json(spec)
  if for_trace:
    return tensor_spec.for_trace(device)
  return tensor_spec.materialize(device)


def describe_arg_spec(spec: ArgSpec) -> str:
  if 'value' in spec:
    return repr(spec['value'])
  return TensorSpec.from_json(spec).describe()


def canonical_json(value: Any) -> str:
  return json.dumps(value, sort_keys=True, separators=(',', ':'))


def json_round_trip(value: Any) -> Any:
  """`value` as JSON gives it back (tuples as lists), so that it compares
  equal to the same value read from a file."""
  return json.loads(canonical_json(value))


_FILE_KINDS = ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO'),
               (stat.S_ISCHR, 'a character device'),
               (stat.S_ISBLK, 'a block device'), (stat.S_ISSOCK, 'a socket'))


def _check_regular(path: str, mode: int) -> None:
  if not stat.S_ISREG(mode):
    kind = next((name for test, name in _FILE_KINDS if test(mode)),
                'not a file')
    raise OSError(f'not a regular file ({kind})')


def read_regular_file(path: str, max_bytes: Optional[int] = None) -> bytes:
  """The bytes of `path` (at most max_bytes + 1 of them, so a caller can
  tell a file over its bound), if it is a regular file; OSError otherwise.

  [Note: Reading a cache directory never blocks]
  A FIFO, a device node or a socket (or a symlink to one) in a cache
  directory would block or never end a plain read. The path is stat'ed
  before it is opened, opened without blocking, and checked again on the
  open descriptor, so nothing but a regular file is ever read.
  """
  _check_regular(path, os.stat(path).st_mode)
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  with os.fdopen(fd, 'rb') as f:
    _check_regular(path, os.fstat(f.fileno()).st_mode)
    return f.read() if max_bytes is None else f.read(max_bytes + 1)


def atomic_write_bytes(path: str, data: bytes, prefix: str = '.tmp-') -> None:
  """Writes `data` to a temp file beside `path`, fsyncs it, renames it over
  `path`: readers see the old file or the new one, never a part."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=prefix)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp_path, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp_path)
    raise


def atomic_write_json(path: str, payload: Any) -> None:
  atomic_write_bytes(path,
                     json.dumps(payload, indent=1, sort_keys=True).encode())
