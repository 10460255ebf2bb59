"""The look-ahead's fallback probe: which ops of a graph's run fall back to
the CPU on this thread (see [Note: Fallback ops of this thread]), and which
would read values, which a look-ahead on placeholders must not run (see
[Note: Look-ahead on placeholders] in dynamo_bridge.py).
"""
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Set, Tuple)

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _pop_mode,
                                          _push_mode)

import torch_xla.debug.metrics as metrics

from torch_xla_patches import placeholder_trace
from torch_xla_patches.tracing import graph_draws_random_numbers

# [Note: Fallback ops of this thread]
# torch_xla counts the ops that fall back to the CPU in counters of the
# process, which every thread bumps. A node of a graph is unsupported when
# its look-ahead run bumped one itself, which another thread's fallback (a
# server thread's `.item()` while a new graph is looked at) must not pass
# for: the graph would be split around a node that never fell back. So a
# node is unsupported when a fallback counter changed during its run and
#   * the counter names an op the node ran on this thread (a dispatch mode
#     is the thread's own, and names the ops that reach torch_xla's
#     kernels), or
#   * the counter changes again when the node runs a second time: a
#     fallback the mode does not name (an op one of torch_xla's kernels runs
#     inside another: `logcumsumexp` falls back as `_logcumsumexp`,
#     `median.dim` as `median.dim_values`).
# A change of neither kind is another thread's.
#
# The mode goes on this thread's dispatch stack and nowhere else.
# `TorchDispatchMode.__enter__` also sets `_is_in_torch_dispatch_mode`, a
# flag of the whole process that each mode saves on entry and puts back on
# exit: two threads' look-aheads that overlap can put it back set, and
# while it is set dynamo skips every frame it has no code for (runs it
# eagerly), on every thread, for the rest of the process. Nothing in a
# look-ahead runs dynamo, so nothing needs the flag.


class FallbackCounterWatch:
  """Tells which fallback counters changed since the last look."""

  def __init__(self):
    self._seen = self._snapshot()

  @staticmethod
  def _snapshot() -> Dict[str, int]:
    return {
        name: metrics.counter_value(name)
        for name in metrics.executed_fallback_ops()
    }

  def changed(self) -> Set[str]:
    now = self._snapshot()
    names = {
        name for name, value in now.items() if self._seen.get(name) != value
    }
    self._seen = now
    return names


class NeedsValues(Exception):
  """A look-ahead on placeholders met an op that would read values (see
  [Note: Look-ahead on placeholders] in dynamo_bridge.py)."""


# Ops without an XLA kernel that read only their inputs' metadata (views
# too).
_METADATA_OPS = frozenset(
    ('aten::new_zeros', 'aten::new_ones', 'aten::new_empty', 'aten::new_full',
     'aten::zeros_like', 'aten::ones_like', 'aten::empty_like',
     'aten::full_like', 'aten::lift_fresh', 'aten::detach', 'aten::alias'))

# Ops whose XLA kernels read the values of boolean or byte index tensors
# (they turn a mask into indices on the host).
_MASK_INDEXING_OPS = frozenset(
    ('aten::index', 'aten::_unsafe_index', 'aten::index_put',
     'aten::index_put_', 'aten::_index_put_impl_'))


def _scalar_arg(args: Sequence[Any], kwargs: Dict[str, Any], position: int,
                name: str, default: Any) -> Any:
  return kwargs.get(name, args[position] if len(args) > position else default)


def _not_strided_or_pinned(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
  layout = kwargs.get('layout')
  return ((layout is not None and layout != torch.strided) or
          bool(kwargs.get('pin_memory')))


def _long_integral(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
  tensors = [a for a in args if isinstance(a, torch.Tensor)]
  return any(
      not t.is_floating_point() and not t.is_complex() and t.element_size() == 8
      for t in tensors)


def _scaled(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
  return (_scalar_arg(args, kwargs, 3, 'beta', 1) != 1 or
          _scalar_arg(args, kwargs, 4, 'alpha', 1) != 1)


def _reduces_other_than_add(args: Sequence[Any], kwargs: Dict[str,
                                                              Any]) -> bool:
  return _scalar_arg(args, kwargs, 4, 'reduce', None) not in (None, 'add')


def _unsupported_strides(stride: Sequence[Any]) -> bool:
  """Whether torch_xla's as_strided kernels fall back for `stride`: unless
  it is empty or its smallest stride is 1."""
  return bool(stride) and min(int(s) for s in stride) != 1


# Ops whose XLA kernels fall back to the CPU for some arguments, by name:
# whether these arguments are such (torch_xla 2.9's aten_xla_type.cpp; the
# kernels that fall back whatever the arguments are in
# placeholder_trace.VALUE_READING_OPS).
_FALLS_BACK_FOR_SOME_ARGUMENTS: Dict[str, Callable[
    [Sequence[Any], Dict[str, Any]], bool]] = {
        'aten::addmm':
            _scaled,
        'aten::scatter':
            _reduces_other_than_add,
        'aten::full':
            _not_strided_or_pinned,
        'aten::linspace':
            _not_strided_or_pinned,
        'aten::dot':
            _long_integral,
        'aten::as_strided':
            lambda args, kwargs: _unsupported_strides(
                _scalar_arg(args, kwargs, 2, 'stride', ())),
        'aten::as_strided_':
            lambda args, kwargs: _unsupported_strides(
                _scalar_arg(args, kwargs, 2, 'stride', ())),
        'aten::as_strided_scatter':
            lambda args, kwargs: _unsupported_strides(
                _scalar_arg(args, kwargs, 3, 'stride', ())),
    }


def _is_mask(value: Any) -> bool:
  return isinstance(value,
                    torch.Tensor) and value.dtype in (torch.bool, torch.uint8)


def _op_reads_values(name: str, overload_name: str) -> Optional[bool]:
  """What the aten op's name alone tells of _reads_values: True or False,
  or None when it depends on the arguments."""
  if name.split('::')[-1] in placeholder_trace.VALUE_READING_OPS:
    return True
  if (name in _MASK_INDEXING_OPS or name in _FALLS_BACK_FOR_SOME_ARGUMENTS or
      name in ('aten::_to_copy', 'aten::to', 'aten::copy_')):
    return None
  if name in _METADATA_OPS:
    return False
  overload = f'{name}.{overload_name}' if overload_name else name
  has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
  if has_kernel(overload, 'XLA') or has_kernel(overload,
                                               'CompositeImplicitAutograd'):
    return False
  return None


def _reads_values(func: Any, args: Sequence[Any], kwargs: Dict[str,
                                                               Any]) -> bool:
  """Whether the aten op `func` on these arguments may run an XLA program on
  its inputs or read their buffers: a CPU fallback (no XLA kernel: one that
  only a backend-free kernel implements may still reach a fallback inside
  it), a kernel that reads values or falls back for some arguments
  (indexing with a mask), or a copy off the device."""
  schema = getattr(func, '_schema', None)
  if schema is None:
    return False
  name = schema.name
  known = _op_reads_values(name, schema.overload_name)
  if known is not None:
    return known
  if name in _MASK_INDEXING_OPS:
    return any(
        _is_mask(a) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
  if name in _FALLS_BACK_FOR_SOME_ARGUMENTS:
    return _FALLS_BACK_FOR_SOME_ARGUMENTS[name](args, kwargs)
  if name in ('aten::_to_copy', 'aten::to', 'aten::copy_'):
    device = kwargs.get('device')
    return device is not None and torch.device(device).type != 'xla'
  if getattr(func, 'is_view', False):
    return False
  leaves = torch.utils._pytree.tree_leaves((args, kwargs))
  if not any(isinstance(a, torch.Tensor) for a in leaves):
    return False
  overload = (f'{name}.{schema.overload_name}'
              if schema.overload_name else name)
  if not torch._C._dispatch_has_kernel_for_dispatch_key(
      overload, 'CompositeExplicitAutograd'):
    return True
  return _falls_back(func, args, kwargs)


def graph_reads_values(graph: torch.fx.Graph) -> bool:
  """Whether a node of `graph` is known from its target alone to read
  values (see [Note: Look-ahead on placeholders] in dynamo_bridge.py): one
  named in placeholder_trace.VALUE_READING_OPS (`torch.nonzero`, `.item()`),
  a copy to the CPU, or an aten op _reads_values says so for any arguments.
  Ops it cannot tell are left to the look-ahead's dispatch-time check."""
  if placeholder_trace.graph_reads_values(graph):
    return True
  return any(
      _op_reads_values(op._schema.name, op._schema.overload_name)
      for op in _aten_overloads(graph))


def _aten_overloads(graph: torch.fx.Graph) -> Iterator[torch._ops.OpOverload]:
  """The aten overload each node of `graph` calls, where it calls one (a
  packet calls its default)."""
  for node in graph.nodes:
    if node.op != 'call_function':
      continue
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
      target = target.default
    if isinstance(target, torch._ops.OpOverload):
      yield target


# Backend-free ops without an XLA kernel, by overload: whether a probe on
# small tensors reached a CPU fallback (see _falls_back).
_falls_back_by_op: Dict[Any, bool] = {}


def _falls_back(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
  """Whether the backend-free kernel of `func` reaches a CPU fallback on
  XLA tensors (logcumsumexp's does, _safe_softmax's does not): found once
  per op by running it on zeros of the same dtypes and ranks, every size 1,
  moved to the device from the host (device data: a fallback on them
  copies them back and compiles nothing, and nothing of the probe is
  synced, so the probe compiles no program); a probe that raises, or sees
  another thread's fallback meanwhile, says it does."""
  known = _falls_back_by_op.get(func)
  if known is not None:
    return known

  def small(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == 'xla':
      return torch.zeros((1,) * value.dim(), dtype=value.dtype).to(value.device)
    return value

  watch = FallbackCounterWatch()
  try:
    probe_args, probe_kwargs = torch.utils._pytree.tree_map(
        small, (tuple(args), dict(kwargs)))
    func(*probe_args, **probe_kwargs)
    falls_back = bool(watch.changed())
  except Exception as error:  # pylint: disable=broad-except
    if 'Unexpected execution' in str(error):
      # The caller refuses execution (torch_xla.compile(full_graph=True)):
      # the probe tells nothing of the op.
      return True
    falls_back = True
  _falls_back_by_op[func] = falls_back
  return falls_back


class OpsOfThisThread(TorchDispatchMode):
  """Names each aten op this thread runs while the mode is on (see [Note:
  Fallback ops of this thread]); with `placeholders`, raises NeedsValues
  before an op that would read values (see [Note: Look-ahead on
  placeholders] in dynamo_bridge.py)."""

  def __init__(self, placeholders: bool = False):
    super().__init__()
    self.names: Set[str] = set()
    self.placeholders = placeholders

  def __enter__(self):
    _push_mode(self)
    return self

  def __exit__(self, exc_type, exc_value, traceback):
    _pop_mode()

  def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    schema = getattr(func, '_schema', None)
    if schema is not None:
      self.names.add(schema.name)
    if self.placeholders and _reads_values(func, args, kwargs or {}):
      raise NeedsValues(schema.name)
    return func(*args, **(kwargs or {}))


def all_on_xla(value: Any) -> bool:
  if isinstance(value, torch.Tensor):
    return value.device.type == 'xla'
  if isinstance(value, (list, tuple)):
    return all(all_on_xla(v) for v in value)
  return True


def look_ahead_specs(
    xla_model: torch.fx.GraphModule, xla_args: Sequence[Any]
) -> Optional[List[Optional[Tuple[torch.Size, torch.dtype]]]]:
  """The shape and dtype of each tensor argument (None for the others), for
  a look-ahead on placeholders; None where one cannot tell what the
  arguments would (see [Note: A hand-over's look-ahead on placeholders] in
  dynamo_bridge.py).
  Under execution_lock: it reads the arguments' metadata."""
  if (not placeholder_trace.graph_runs_on_placeholders(xla_model) or
      graph_reads_values(xla_model.graph) or
      graph_draws_random_numbers(xla_model.graph)):
    return None
  specs = []
  for arg in xla_args:
    if not isinstance(arg, torch.Tensor):
      specs.append(None)
    elif arg.device.type != 'xla':
      return None
    else:
      specs.append((arg.shape, arg.dtype))
  return specs
