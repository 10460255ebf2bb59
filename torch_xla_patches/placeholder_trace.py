"""Traces on placeholders: a new signature traced and compiled on
placeholders for its arguments, touching none of them, so that it can run
with no lock held (see [Note: Traces on placeholders]); which graphs can be,
and the ops that read values while traced.
"""
import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch_xla
import torch_xla.runtime as xr

from torch_xla_patches import config, io_utils
from torch_xla_patches.counters import COUNTER_DONATED, increment_counter
from torch_xla_patches.donation import (data_id_of, donatable_positions,
                                        sets_own_donors)
from torch_xla_patches.signature import ArgLayout, UnsupportedGraphInput
from torch_xla_patches import tracing
from torch_xla_patches.tracing import (CompiledGraphEntry, TracedGraph,
                                       donation_peers, graph_constants)

# [Note: Traces on placeholders]
# A trace needs the shapes and dtypes of its arguments, never their values
# (nothing runs; CPU fallback ops were split off by the look-ahead before).
# So a new signature of a graph is traced on a placeholder for every tensor
# argument (trace_on_placeholders): io_utils.placeholder, device data of the
# argument's shape and dtype with no buffer (see [Note: Placeholder
# tensors] in io_utils.py). The trace then reads and writes no tensor anyone
# else holds, needs no restore, and runs, with its compile, without
# execution_lock, while other threads run programs that read or donate the
# very tensors it stands for (a parameter, a cache the model holds). The
# program is the one a trace on the arguments makes, with the same hash:
# each placeholder is a parameter of the graph at its argument's position,
# matched to it by the placeholder's id, and at each run the argument's
# buffer is passed there. A donated argument's placeholder carries the donor
# mark (see [Note: Donating in-place updates] in donation.py), which then
# never sits on a buffer anyone holds, and the run takes the argument's
# buffer over. Invariants:
#   * a placeholder never leaves its trace and compile (trace_and_compile in
#     dynamo_bridge.py: both in flight in io_utils.placeholder_traces,
#     begin() to end(), and every placeholder is dropped before the end, a
#     failed trace's included): its IR reads a buffer that does not exist, so
#     nothing may run it. The bridge never syncs it, and a sync of every live
#     tensor waits until no placeholder trace is in flight (see [Note: Syncs
#     wait for placeholder graphs] in io_utils.py);
#   * a trace that fails on placeholders, or cannot start (a sync held it
#     off too long), is made again on the arguments, which raises the
#     trace's own error where it has one.
# Where a placeholder cannot say what the argument is, the arguments
# themselves are traced, under the lock (can_trace_on_placeholders is
# False):
#   * two arguments that share data, or a view: the graph would lose that
#     they are one buffer;
#   * tensors the graph reads as attributes of its module (graph_constants),
#     which are not arguments;
#   * under SPMD (shardings), and a graph that marks its own donors;
#   * a graph with an op that reads values while it is traced (an item(),
#     a CPU copy, an op whose output's shape depends on values:
#     VALUE_READING_OPS): running a placeholder's IR reads a buffer that
#     does not exist, and the process dies;
#   * the flag config.trace_on_placeholders is off, or apply() did not
#     install the sync's guard (io_utils.placeholder_traces.guarded).

# Bare names of ops, functions and tensor methods that read their inputs'
# values on the host, or whose torch_xla kernels run on the CPU for some
# arguments: a trace or a look-ahead through one runs the graph before it.
VALUE_READING_OPS = frozenset({
    'item', '_local_scalar_dense', 'tolist', 'numpy', 'cpu', '__bool__',
    '__int__', '__float__', 'nonzero', 'nonzero_static', 'argwhere',
    'masked_select', 'unique', '_unique', '_unique2', 'unique_consecutive',
    'unique_dim', 'repeat_interleave', 'bincount', 'histc', 'equal',
    'is_nonzero', 'allclose', 'multinomial', 'randperm', 'bernoulli',
    'bernoulli_', 'normal', 'normal_', 'uniform_', 'random_', 'exponential_',
    'rrelu_with_noise', '_linalg_eigh', 'linalg_inv_ex', '_adaptive_avg_pool2d',
    '_adaptive_avg_pool3d', 'adaptive_max_pool2d', 'max_pool2d_with_indices',
    'max_pool3d_with_indices', '_embedding_bag_forward_only', 'cumprod', 'norm',
    'scatter_reduce'
})


def _op_name(node: torch.fx.Node) -> str:
  """The bare name of the op a node calls (`nonzero` for `torch.nonzero`,
  `aten.nonzero.default` and the method `x.nonzero()`)."""
  target = node.target
  if isinstance(target, str):
    return target
  schema = getattr(target, '_schema', None)
  if schema is not None:
    return schema.name.split('::')[-1]
  return getattr(target, '__name__', '')


def graph_reads_values(graph: torch.fx.Graph) -> bool:
  """Whether a node of the graph may read tensor values while traced (see
  [Note: Traces on placeholders]); a copy to the CPU among them."""
  for node in graph.nodes:
    if node.op not in ('call_function', 'call_method'):
      continue
    if _op_name(node) in VALUE_READING_OPS:
      return True
    device = node.kwargs.get('device')
    if device is not None and 'cpu' in str(device):
      return True
  return False


# A trace and compile made ready on placeholders, to run with no lock: gives
# the compiled entry, or None where the arguments must be traced after all
# (see [Note: Traces on placeholders]). Its argument: whether it runs on
# the compile pool, where it must never wait for a sync that waits (see
# [Note: Syncs wait for placeholder graphs] in io_utils.py).
DetachedTrace = Callable[[bool], Optional[CompiledGraphEntry]]


def can_trace_on_placeholders(xla_model: torch.fx.GraphModule,
                              args: Sequence[Any], layout: ArgLayout) -> bool:
  """Whether the signature of `args` may be traced on placeholders (see
  [Note: Traces on placeholders])."""
  if (not io_utils.placeholder_traces.guarded() or xr.is_spmd() or
      sets_own_donors(xla_model) or graph_constants(xla_model) or
      graph_reads_values(xla_model.graph)):
    return False
  tensors = [args[i] for i in layout.tensor_positions]
  if any(t.device.type != 'xla' or t._is_view() for t in tensors):
    return False
  return len({data_id_of(t) for t in tensors}) == len(tensors)


def _with_placeholders(args: Sequence[Any],
                       positions: Sequence[int]) -> List[Any]:
  replaced = list(args)
  for position in positions:
    replaced[position] = io_utils.placeholder(args[position].shape,
                                              args[position].dtype)
  return replaced


def _holds_no_buffer(tensor: torch.Tensor) -> bool:
  """Whether `tensor` is device data with no buffer (a placeholder's, which
  is_placeholder cannot tell of a graph input's value: another tensor)."""
  return 'Data Handle: None' in torch_xla._XLAC._get_xla_tensor_debug_info(
      tensor)


def trace_on_placeholders(xla_model: torch.fx.GraphModule, args: Sequence[Any],
                          layout: ArgLayout) -> TracedGraph:
  """Traces the signature of `args` on placeholders for them, with donated
  buffers where the graph updates arguments (see [Note: Donating in-place
  updates] in donation.py), touching no argument (see [Note: Traces on
  placeholders]; can_trace_on_placeholders said so). The graph's tensors
  are those computed. Call it in flight (io_utils.placeholder_traces)."""
  positions = layout.tensor_positions
  traced = tracing.trace_graph(xla_model, _with_placeholders(args, positions),
                               layout, positions)
  updated = [
      position for position, _ in traced.entry.output_plan.inplace_updates
  ]
  donated = (donatable_positions(args, updated, layout)
             if config.donate_inplace_updates and updated else ())
  peers: Tuple[int, ...] = ()
  if donated:
    # The first trace updated its placeholders: trace again on fresh ones.
    del traced
    replaced = _with_placeholders(args, positions)
    for position in donated:
      torch_xla._XLAC._set_buffer_donation(replaced[position], True)
    traced = tracing.trace_graph(xla_model, replaced, layout, positions)
    del replaced
    # See trace_donating: an argument written without being read is no
    # input of the program.
    inputs = set(traced.entry.graph_input_matcher.arg_idxs)
    donated = tuple(position for position in donated if position in inputs)
  # A placeholder the matching did not find would be a constant of the
  # program, passed to every run: a buffer that does not exist.
  if any(value is not None and _holds_no_buffer(value)
         for value in traced.entry.graph_input_matcher.graph_input_xla_values):
    raise UnsupportedGraphInput(
        'a placeholder was not matched to its argument; tracing the '
        'arguments')
  if donated:
    # Counted once the trace is kept (the arguments' trace counts its own).
    increment_counter(COUNTER_DONATED, len(donated))
    peers = donation_peers(args, donated, inputs)
  computed = torch_xla._XLAC._check_tensor_need_materialization(
      traced.graph_tensors) if traced.graph_tensors else []
  # What a trace with collectives left for the next one; the compile does
  # not need it.
  torch_xla._XLAC._set_all_reduce_token(str(torch_xla.device()), None)
  return TracedGraph(
      entry=dataclasses.replace(traced.entry,
                                signature=layout.signature_of(args),
                                donated_positions=tuple(donated),
                                donation_peers=peers),
      graph_tensors=[
          t for t, flag in zip(traced.graph_tensors, computed) if flag
      ],
  )
