"""A recorded signature: what the signature index and an artifact keep of one
shape signature of a graph, how it is checked, and how its arguments are
rebuilt against a live call of the graph.

A record holds one input spec per graph input: null (a parameter or a static
tensor, taken from the live call), {"value": v} for a number, or a tensor
spec (see io_utils.TensorSpec) for a tensor with symbolic sizes; and, under
SPMD, the sharding spec of each tensor input.

[Note: Records are untrusted]
A record comes from a file another process (or another release, or a bug)
wrote. Everything in it is type-checked here (`parse_specs`,
`parse_shardings`, `parse_arg_spec`) and checked against the live graph
(`ReplayTemplate.check`) before anything is allocated or traced. A record that
fails raises `RecordError` with the reason, and its caller skips it: a record
only chooses which signatures to compile from the live graph, so skipping
costs time, never correctness.
"""
import dataclasses
import hashlib
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import config
from torch_xla_patches import io_utils
from torch_xla_patches.signature import ArgKind, ArgLayout

# What a record holds per graph input: an ArgSpec, or None for a parameter or
# static tensor, taken from the live call.
InputSpec = Optional[io_utils.ArgSpec]

# The automatic bound on the bytes of tensors one replay may make, unless 8
# times the live call's tensor bytes is larger (see config.replay_max_bytes).
MIN_AUTO_REPLAY_BYTES = 256 << 20


class RecordError(ValueError):
  """A record that cannot be used; the message says why."""


@dataclasses.dataclass(frozen=True)
class RecordedSignature:
  """One recorded signature of a graph, with its usage."""
  # Digest of specs and shardings; the index's file is sig-<record_id>.json.
  record_id: str
  # One input spec per graph input (see the module docstring); unchecked
  # when read from an artifact (see [Note: Records are untrusted]).
  specs: Tuple[InputSpec, ...]
  # Sharding spec of each tensor input (None for other inputs) under SPMD;
  # None for a graph without SPMD.
  shardings: Optional[Tuple[Optional[str], ...]]
  # Calls served with this signature, summed over the processes that flushed.
  served: int = 0
  # When it was last served (or recorded), seconds since the epoch.
  last_served: float = 0.0
  # The file or artifact it was read from, for messages.
  source: str = ''

  def describe(self) -> str:
    try:
      parts = [
          f'{position}:{io_utils.describe_arg_spec(spec)}'
          for position, spec in enumerate(self.specs)
          if spec is not None
      ]
    except (TypeError, KeyError, ValueError):
      # An unchecked record (see [Note: Records are untrusted]).
      return short(self.specs)
    return ' '.join(parts) or '(static)'


def short(value: Any) -> str:
  """`value` for a message, cut to 60 characters."""
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def is_count(value: Any) -> bool:
  """A non-negative int (not a bool)."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_finite_number(value: Any) -> bool:
  """An int, or a finite float; not a bool."""
  if isinstance(value, bool):
    return False
  return isinstance(value, int) or (isinstance(value, float) and
                                    math.isfinite(value))


def record_id_of(specs: Sequence[Any],
                 shardings: Optional[Sequence[Any]]) -> str:
  text = io_utils.canonical_json({
      'specs': list(specs),
      'shardings': None if shardings is None else list(shardings)
  })
  return hashlib.sha256(text.encode()).hexdigest()[:24]


def _input_specs(layout: ArgLayout,
                 args: Sequence[Any]) -> Tuple[InputSpec, ...]:
  return tuple(None if kind in (ArgKind.PARAMETER,
                                ArgKind.TENSOR) else io_utils.arg_spec(arg)
               for kind, arg in zip(layout.kinds, args))


def _input_shardings(
    layout: ArgLayout,
    args: Sequence[Any]) -> Optional[Tuple[Optional[str], ...]]:
  """The sharding spec of each tensor input under SPMD, else None."""
  if not layout.spmd:
    return None
  import torch_xla
  positions = layout.tensor_positions
  specs = torch_xla._XLAC._get_xla_sharding_specs([args[i] for i in positions])
  by_position = dict(zip(positions, specs))
  return tuple(by_position.get(i) for i in range(len(layout.kinds)))


def make_record(layout: ArgLayout, args: Sequence[Any]) -> RecordedSignature:
  """The record of a call of a graph with `layout`."""
  specs = _input_specs(layout, args)
  shardings = _input_shardings(layout, args)
  return RecordedSignature(record_id=record_id_of(specs, shardings),
                           specs=specs,
                           shardings=shardings,
                           last_served=time.time())


# -- checks


def parse_tensor_spec(where: str, spec: Any) -> io_utils.TensorSpec:
  """A tensor spec's JSON form, checked."""
  if not isinstance(spec, dict) or set(spec) != {'shape', 'dtype'}:
    raise RecordError(f'{where}: expected a tensor spec, found {short(spec)}')
  shape = spec['shape']
  if not isinstance(shape, list) or not all(is_count(size) for size in shape):
    raise RecordError(f'{where}: sizes must be non-negative integers, found '
                      f'{short(shape)}')
  try:
    return io_utils.TensorSpec(tuple(shape),
                               io_utils.dtype_from_name(spec['dtype']))
  except ValueError as e:
    raise RecordError(f'{where}: {e}') from None


def _parse_value(where: str, kind: ArgKind, spec: Any) -> Dict[str, Any]:
  if not isinstance(spec, dict) or set(spec) != {'value'}:
    raise RecordError(f'{where}: expected {{"value": ...}}, found '
                      f'{short(spec)}')
  value = spec['value']
  if kind == ArgKind.SHAPE and not is_count(value):
    raise RecordError(f'{where}: a size must be a non-negative integer, '
                      f'found {short(value)}')
  if kind == ArgKind.SCALAR and not (isinstance(value, bool) or
                                     is_finite_number(value)):
    raise RecordError(f'{where}: expected a finite number, found '
                      f'{short(value)}')
  return {'value': value}


def parse_arg_spec(where: str, spec: Any) -> io_utils.ArgSpec:
  """One positional argument of a call as an artifact holds it: a tensor
  spec or a number (a bool, or a finite int or float), checked."""
  if isinstance(spec, dict) and 'value' in spec:
    return _parse_value(where, ArgKind.SCALAR, spec)
  return parse_tensor_spec(where, spec).to_json()


def parse_specs(kinds: Sequence[ArgKind], raw: Any) -> Tuple[InputSpec, ...]:
  """Type-checks recorded input specs against a graph's input kinds."""
  if isinstance(raw, tuple):
    raw = list(raw)
  if not isinstance(raw, list) or len(raw) != len(kinds):
    raise RecordError(f'expected a list of {len(kinds)} input specs, found '
                      f'{short(raw)}')
  specs: List[InputSpec] = []
  for position, (kind, spec) in enumerate(zip(kinds, raw)):
    where = f'input {position} ({kind.value})'
    if kind in (ArgKind.PARAMETER, ArgKind.TENSOR):
      if spec is not None:
        raise RecordError(f'{where}: expected null, found {short(spec)}')
      specs.append(None)
    elif kind in (ArgKind.SHAPE, ArgKind.SCALAR):
      specs.append(_parse_value(where, kind, spec))
    else:
      specs.append(parse_tensor_spec(where, spec).to_json())
  return tuple(specs)


def parse_shardings(kinds: Sequence[ArgKind],
                    raw: Any) -> Optional[Tuple[Optional[str], ...]]:
  if raw is None:
    return None
  if isinstance(raw, tuple):
    raw = list(raw)
  if not isinstance(raw, list) or len(raw) != len(kinds) or not all(
      spec is None or isinstance(spec, str) for spec in raw):
    raise RecordError(f'expected {len(kinds)} sharding specs (strings or '
                      f'null), found {short(raw)}')
  return tuple(raw)


def tensor_bytes(spec: io_utils.TensorSpec) -> int:
  # Python ints: a damaged size cannot overflow the product.
  return math.prod(spec.shape) * torch.empty(
      (), dtype=spec.dtype).element_size()


def replay_max_bytes(live_bytes: int) -> int:
  """How many bytes of tensors one replayed record may make, given the bytes
  of the live call's tensors (see config.replay_max_bytes)."""
  if config.replay_max_bytes > 0:
    return config.replay_max_bytes
  return max(MIN_AUTO_REPLAY_BYTES, 8 * live_bytes)


def _check_bytes(total: int, max_bytes: int) -> None:
  if total > max_bytes:
    raise RecordError(f'its tensors would take {total} bytes, over the bound '
                      f'of {max_bytes} (config.replay_max_bytes)')


def _live_bytes(tensors: Sequence[torch.Tensor]) -> int:
  return sum(t.numel() * t.element_size() for t in tensors)


# -- rebuilding


@dataclasses.dataclass(frozen=True)
class _DynamicInput:
  """What a replay needs of a live input with symbolic sizes."""
  position: int
  rank: int
  dtype: torch.dtype
  # The live input's XLA sharding under SPMD (given to the zeros), else None.
  sharding: Any


@dataclasses.dataclass(frozen=True)
class ReplayTemplate:
  """What rebuilding a record needs of a live call of its graph.

  Parameters and static tensors are taken as they are (they hold no size a
  record could change); of each input with symbolic sizes only its rank,
  dtype and sharding are kept, so a template pins no user input of a
  signature.
  """
  layout: ArgLayout
  # (position, tensor) of each parameter and static tensor.
  fixed: Tuple[Tuple[int, torch.Tensor], ...]
  dynamic: Tuple[_DynamicInput, ...]
  # The live sharding spec of each input under SPMD, else None.
  shardings: Optional[Tuple[Optional[str], ...]]
  # Bound on the bytes of new tensors of one record (replay_max_bytes).
  max_bytes: int

  @classmethod
  def of(cls, layout: ArgLayout, live_args: Sequence[Any]) -> 'ReplayTemplate':
    fixed = tuple((i, live_args[i])
                  for i in layout.positions(ArgKind.PARAMETER, ArgKind.TENSOR))
    op_sharding = None
    if layout.spmd:
      import torch_xla
      op_sharding = torch_xla._XLAC._get_xla_op_sharding
    dynamic = tuple(
        _DynamicInput(
            position=i,
            rank=live_args[i].dim(),
            dtype=live_args[i].dtype,
            sharding=op_sharding(live_args[i]) if op_sharding else None)
        for i in layout.dynamic_tensor_positions)
    live = _live_bytes([live_args[i] for i in layout.tensor_positions])
    return cls(layout=layout,
               fixed=fixed,
               dynamic=dynamic,
               shardings=_input_shardings(layout, live_args),
               max_bytes=replay_max_bytes(live))

  def check(self, record: RecordedSignature) -> Tuple[InputSpec, ...]:
    """The record's specs, checked (see [Note: Records are untrusted]):
    specs of the graph's kinds, each tensor of the live input's rank and
    dtype, at most max_bytes of new tensors, and under SPMD the live
    input's sharding at every tensor position. Raises RecordError."""
    specs = parse_specs(self.layout.kinds, record.specs)
    total = 0
    for live in self.dynamic:
      spec = io_utils.TensorSpec.from_json(specs[live.position])
      if len(spec.shape) != live.rank:
        raise RecordError(f'input {live.position} has rank {len(spec.shape)}, '
                          f'the live input rank {live.rank}')
      if spec.dtype != live.dtype:
        raise RecordError(f'input {live.position} has dtype '
                          f'{io_utils.dtype_name(spec.dtype)}, the live '
                          f'input {io_utils.dtype_name(live.dtype)}')
      total += tensor_bytes(spec)
    _check_bytes(total, self.max_bytes)
    shardings = parse_shardings(self.layout.kinds, record.shardings)
    if self.layout.spmd and shardings != self.shardings:
      differing = [
          i for i in self.layout.tensor_positions
          if shardings is None or shardings[i] != self.shardings[i]
      ]
      raise RecordError('recorded input shardings differ from the live ones '
                        f'at inputs {differing}')
    return specs

  def rebuild(self, record: RecordedSignature, device: Any) -> List[Any]:
    """Arguments for tracing the record: live parameters and static tensors,
    zeros of the recorded sizes (with the live input's sharding under SPMD),
    recorded numbers. Raises RecordError if the record fails a check."""
    specs = self.check(record)
    # Replayed inside a warm-up's placeholder call: traced on placeholders
    # (see [Note: Syncs wait for placeholder graphs] in io_utils.py).
    for_trace = io_utils.placeholder_traces.on_this_thread()
    args: List[Any] = [
        None if spec is None else io_utils.arg_from_spec(
            spec, device, for_trace) for spec in specs
    ]
    for position, tensor in self.fixed:
      args[position] = tensor
    for live in self.dynamic:
      if live.sharding is not None:
        import torch_xla
        torch_xla._XLAC._xla_mark_sharding(args[live.position], live.sharding)
    return args


def rebuild_call(raw: Any, live_tensors: Sequence[torch.Tensor],
                 device: Any) -> List[Any]:
  """The positional arguments of an example call an artifact holds (a list of
  arg specs), checked before anything is allocated, as zeros and numbers.
  `live_tensors` (the model's parameters) set the byte bound
  (replay_max_bytes). Raises RecordError."""
  if not isinstance(raw, list):
    raise RecordError(f'the example call is {short(raw)}, expected a list '
                      'of argument specs')
  specs = [
      parse_arg_spec(f'argument {index}', spec)
      for index, spec in enumerate(raw)
  ]
  _check_bytes(
      sum(
          tensor_bytes(io_utils.TensorSpec.from_json(spec))
          for spec in specs
          if 'value' not in spec), replay_max_bytes(_live_bytes(live_tensors)))
  return [io_utils.arg_from_spec(spec, device) for spec in specs]


# -- the form an artifact holds


def records_to_json(kinds: Optional[Sequence[ArgKind]],
                    records: Sequence[RecordedSignature]) -> Dict[str, Any]:
  """The recorded signatures as an artifact saves them."""
  return {
      # Informational: each record is checked against the live graph's kinds.
      'kinds':
          None if kinds is None else [kind.value for kind in kinds],
      'specs': [list(r.specs) for r in records],
      'shardings': [
          None if r.shardings is None else list(r.shardings) for r in records
      ],
  }


def records_from_json(state: Any, source: str) -> Tuple[RecordedSignature, ...]:
  """The recorded signatures an artifact holds, unchecked: each is checked
  when it is replayed (see [Note: Records are untrusted]), so damage is
  reported and counted there, per record, like damage in the index."""
  if state is None:
    return ()
  specs = state.get('specs') if isinstance(state, dict) else state
  shardings = state.get('shardings') if isinstance(state, dict) else None
  if not isinstance(specs, list):
    # One record that fails its check when replayed.
    specs = [specs]
  if not isinstance(shardings, list) or len(shardings) != len(specs):
    shardings = [None] * len(specs)
  records = []
  for index, (raw, raw_shardings) in enumerate(zip(specs, shardings)):
    try:
      record_id = record_id_of(raw, raw_shardings)
    except (TypeError, ValueError):
      record_id = f'unreadable-{index}'
    records.append(
        RecordedSignature(record_id=record_id,
                          specs=tuple(raw) if isinstance(raw, list) else raw,
                          shardings=(tuple(raw_shardings) if isinstance(
                              raw_shardings, list) else raw_shardings),
                          source=source))
  return tuple(records)
