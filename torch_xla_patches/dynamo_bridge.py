"""The XLA dynamo bridge with one compiled program per shape signature.

`extract_compiled_graph` -> `extract_compiled_graph_helper` ->
`extract_internal` -> `extract_graph_helper`, with `GraphInputMatcher`
building the XLA inputs of a call. The bridge's other jobs have modules of
their own: tracing.py (input matching, output plans, entries), donation.py,
execution.py (the execution lock, runs, syncs), program_run.py (one run of a
compiled program), fallback_probe.py (the look-ahead's fallback and
value-reading ops), compile_window.py, signature_cache.py, bound_program.py
and counters.py. The Notes state what each part guarantees.
"""
import contextlib
import logging
import operator
import warnings

import itertools
import os
from typing import (Any, Dict, Hashable, List, Optional, Sequence, Set, Tuple)

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport
from torch.fx.passes.utils.fuser_utils import topo_sort

# Defined by torch_xla's bridge; its callers (torch_xla/stablehlo.py, tests)
# find them in the bridge module, so this one offers them too.
from torch_xla._dynamo.dynamo_bridge import (NoneRemover,
                                             XLAConstructorMoverPass,
                                             get_fallback_ops)

from torch_xla._dynamo import config as upstream_config
from torch_xla_patches import (compile_window, fallback_probe, io_utils,
                               placeholder_trace, tracing)
from torch_xla_patches.counters import (COUNTER_DONATION_FALLBACK,
                                        COUNTER_CPU_FALLBACK_EAGER,
                                        COUNTER_CPU_FALLBACK_PARTITION,
                                        COUNTER_EVICTED_RETRACE,
                                        increment_counter)
from torch_xla_patches.donation import (apply_view_updates,
                                        count_epilogue_updates, donor_aliasing,
                                        prepare_donating_run,
                                        sync_alone_noting_reads)
from torch_xla_patches.handover_sync import (take_twins,
                                             twins_of_pending_arguments)
from torch_xla_patches import execution
from torch_xla_patches import graph_updates
from torch_xla_patches.execution import (RefusedBeforeRun,
                                         refused_for_pending_ir)
from torch_xla_patches.program_run import run_entry
from torch_xla_patches.signature import (ArgKind, ArgLayout, check_scalar_input,
                                         describe_arg, tuple_getter)
from torch_xla_patches.signature_cache import SignatureCache
# Upstream's callers and tests build matchers from the bridge module.
from torch_xla_patches.tracing import (CompiledGraphEntry, GraphInputMatcher,
                                       pending_ir_restored)

import torch_xla
import torch_xla.debug.metrics as metrics
import torch_xla.runtime as xr
# Upstream's test_dynamo_aliasing takes it from the bridge module.
from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

logger = logging.getLogger('torch_xla_patches.bridge')

dynamo_debug = int(os.environ.get('XLA_DYNAMO_DEBUG', '0')) == 1
ptxla_debug = int(os.environ.get('PT_XLA_DEBUG', '0')) == 1


def extract_graph_helper(xla_model: torch.fx.GraphModule, args: Sequence[Any],
                         layout: ArgLayout) -> tracing.TracedGraph:
  """Lazily traces `xla_model` on `args` and leaves the arguments as they
  were. A program whose graph holds arguments (one that updates them in
  place: its graph is their pending IR, which the restore drops; one that
  returns them) is compiled here; any other is returned with its tensors to
  compile (see [Note: Compiles outside the lock] in signature_cache.py)."""
  tensors = [args[i] for i in layout.tensor_positions]
  # The arguments enter the graph as device data (see [Note: Threads] in
  # execution.py: not a sync of every live tensor, which races with other
  # threads' tensors).
  sync_alone_noting_reads(tensors)
  # A trace or compile that raises must still leave the arguments as they
  # were and no pending IR behind: replaying a recorded signature skips
  # such a failure and the caller's call goes on.
  with pending_ir_restored(tensors +
                           tracing.graph_constants(xla_model)) as restore:
    count_epilogue_updates(xla_model)
    traced = tracing.trace_graph(xla_model, args, layout)
    if (not traced.entry.output_plan.inplace_updates and
        tracing.compilable_elsewhere(traced)):
      return traced
    traced = tracing.trace_donating(xla_model, args, layout, restore, traced)
    if traced.graph_tensors:
      with donor_aliasing():
        compile_window.compile_graph(traced.graph_tensors)
  return tracing.TracedGraph(entry=traced.entry, graph_tensors=[])


def _thread_state_not_shared() -> bool:
  """Whether this thread runs under autocast (on any device type) or in
  inference mode, which a trace on another thread would not see."""
  return (torch.is_inference_mode_enabled() or any(
      torch.is_autocast_enabled(device_type)
      for device_type in ('cpu', 'cuda', 'xla')))


def detached_trace(
    xla_model: torch.fx.GraphModule, args: Sequence[Any], layout: ArgLayout,
    copy_views_off_the_lock: bool) -> Optional[placeholder_trace.DetachedTrace]:
  """A trace and compile of the signature of `args` on placeholders for
  them, which it neither reads nor writes, to run later with no lock (see
  [Note: Traces on placeholders] in placeholder_trace.py); None where the
  arguments must be traced themselves. The caller holds execution_lock;
  with `copy_views_off_the_lock` (the signature is marked compiling) the
  copies of view arguments are made with it let go (see [Note: View copies
  off the lock] in placeholder_trace.py)."""
  if not placeholder_trace.can_trace_on_placeholders(xla_model, args, layout):
    return None
  if _thread_state_not_shared():
    # The trace may run on the compile pool, whose thread has none of this
    # thread's autocast or inference mode; grad mode alone is carried over.
    return None

  with (execution.execution_lock_released()
        if copy_views_off_the_lock else contextlib.nullcontext()):
    view_copies = placeholder_trace.copies_of_views(args,
                                                    layout.tensor_positions)
  # Made now, under execution_lock, as a trace of the arguments would read
  # them (see [Note: Stand-ins that hold buffers] in placeholder_trace.py).
  aliases = placeholder_trace.BufferAliases.of(args, layout.tensor_positions,
                                               view_copies)

  def trace_and_compile(on_pool: bool) -> Optional[CompiledGraphEntry]:
    """The compiled entry; None if the trace on placeholders raised or could
    not begin: the caller traces the arguments themselves. A compile's error
    is raised."""
    try:
      return _trace_and_compile_on_stand_ins(xla_model, args, layout, aliases,
                                             on_pool)
    finally:
      with execution.execution_lock:
        aliases.release(args)

  return trace_and_compile


def _trace_and_compile_on_stand_ins(
    xla_model: torch.fx.GraphModule, args: Sequence[Any], layout: ArgLayout,
    aliases: placeholder_trace.BufferAliases,
    on_pool: bool) -> Optional[CompiledGraphEntry]:
  """detached_trace's trace and compile, in flight (see [Note: Traces on
  placeholders] in placeholder_trace.py)."""
  placeholders = io_utils.placeholder_traces
  try:
    placeholders.begin(on_pool)
  except io_utils.PlaceholderWaitTimeout:
    return None
  # In flight until every placeholder of the trace is gone, every alias is
  # left a placeholder and every donor mark it left is cleared: the end of
  # this block, a failed trace's included.
  try:
    return _trace_and_compile_in_flight(xla_model, args, layout, aliases)
  finally:
    aliases.drop()
    placeholders.traced()
    placeholders.end()


def _trace_and_compile_in_flight(
    xla_model: torch.fx.GraphModule, args: Sequence[Any], layout: ArgLayout,
    aliases: placeholder_trace.BufferAliases) -> Optional[CompiledGraphEntry]:
  """_trace_and_compile_on_stand_ins's trace and compile."""
  try:
    count_epilogue_updates(xla_model)
    traced = placeholder_trace.trace_on_placeholders(xla_model, args, layout,
                                                     aliases)
  except Exception as error:  # pylint: disable=broad-except
    # Leaving this block drops the error, whose traceback holds the
    # trace's frames and so its placeholders.
    logger.debug(
        'a trace on placeholders raised %s: %s; tracing the '
        'arguments',
        type(error).__name__, error)
    return None
  entry = traced.entry
  graph_tensors = traced.graph_tensors
  del traced
  try:
    if graph_tensors:
      # Emptied, whether or not the compile raises.
      compile_window.compile_traced(graph_tensors)
  finally:
    aliases.let_go_marks()
  return entry


def extract_internal(xla_model: torch.fx.GraphModule):
  """Compiles the first signature now; returns the per-call function."""
  first_args = xla_model.xla_args
  layout = ArgLayout.from_graph(xla_model, first_args, spmd=xr.is_spmd())
  cache = SignatureCache(xla_model, layout, extract_graph_helper,
                         detached_trace)
  if dynamo_debug:
    print(f'[torch_xla_patches] graph {cache.graph_id} layout: {layout.kinds}')
  # The first signature compiles on the compile pool, as a warm-up's do
  # (see [Note: Compiles outside the lock] in signature_cache.py): the graph
  # is handed over before it is compiled, and the call that made it waits
  # for that compile in the bridge's callable, where no lock is held; so do
  # other threads' calls of that signature, and calls of other signatures
  # go on (see execution.extracted_once).
  cache.compile_only(cache.key_of(first_args), first_args)
  cache.queue_index_records(first_args)
  del xla_model.xla_args

  key_of = cache.key_of
  all_tensors = tuple_getter(layout.tensor_positions)
  # [Note: Input materialization check]
  # `_run_cached_graph` needs device data, not pending IR, as input.
  # Non-parameter tensors (activations, user inputs, tangents) are often
  # pending, so they are checked up front, in one C++ call. Lifted parameters
  # are rarely pending (only after an eager update with no sync), and there
  # are many of them, so they are not checked: `_run_cached_graph` refuses
  # pending IR before it runs anything, and the refusal is handled in
  # run_after_refusal.
  checked_tensors = tuple_getter(
      layout.positions(ArgKind.TENSOR, ArgKind.DYNAMIC_TENSOR))

  def run(entry: CompiledGraphEntry, args: Sequence[Any],
          pending: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """One run of `entry` on `args` (see [Note: One run of a compiled
    program] in program_run.py)."""
    if entry.writes_nothing_back and not pending:
      # run_entry's other steps have nothing to do.
      return execution.run_program(entry.graph_hash,
                                   entry.graph_input_matcher(args))
    return run_entry(entry,
                     pending,
                     inputs=lambda: entry.graph_input_matcher(
                         prepare_donating_run(entry, args)
                         if entry.donated_positions else args),
                     argument=args.__getitem__,
                     drop_update_log=True)

  def run_after_refusal(refusal: RefusedBeforeRun, key: Hashable,
                        entry: CompiledGraphEntry, args: Sequence[Any]):
    # `_run_cached_graph` refuses pending-IR inputs (see [Note: Input
    # materialization check]) and evicted programs before running anything;
    # sync the inputs, or re-trace the evicted signature, and run again.
    for _ in range(3):
      if refused_for_pending_ir(refusal):
        if upstream_config.skip_input_data_check:
          # The user turned the input check off: report, don't sync.
          raise refusal.__cause__ or refusal
        pending = all_tensors(args)
      else:
        increment_counter(COUNTER_EVICTED_RETRACE, 1)
        entry = cache.trace(key, args)
        pending = ()
      try:
        return entry, run(entry, args, pending)
      except RefusedBeforeRun as next_refusal:
        refusal = next_refusal
    raise refusal.__cause__ or refusal

  def optimized_mod(*args, key: Optional[Hashable] = None):
    """Runs the graph on `args`. `key` is their signature key
    (`optimized_mod.signature_cache.key_of(args)`) when the caller has
    computed it already (serve()'s full path, which records it), else None
    and computed here."""
    if key is None:
      key = key_of(args)
    synced = ()
    # The call's own inputs are synced before the lock: a sync of inputs of
    # a new size (a cache just reset) compiles a graph of its own, which
    # then keeps no other thread's call waiting. Pending IR another thread
    # gives them meanwhile is refused by the run and synced after (see
    # [Note: Input materialization check]).
    if not upstream_config.skip_input_data_check:
      synced = execution.sync_before_the_lock(checked_tensors(args))
    with execution.execution_lock:
      if synced:
        execution.note_synced_inputs(synced)
      if execution.compiling_only():
        # See [Note: Compile-only calls] in execution.py.
        cache.compile_only(key, args)
        raise execution.CompiledNotRun(key)
      entry = cache.look_up(key)
      if entry is None:
        entry = cache.on_miss(key, args)
      try:
        results = run(entry, args, ())
      except RefusedBeforeRun as refusal:
        entry, results = run_after_refusal(refusal, key, entry, args)
      outputs = entry.output_plan.assemble(results, args)
      cache.served(key)
      return outputs

  optimized_mod.signature_cache = cache
  return optimized_mod


class UnsupportedNodesCollector(torch.fx.Interpreter):
  """Runs the graph node by node, noting nodes XLA cannot compile: CPU
  fallback ops of this thread (see [Note: Fallback ops of this thread] in
  fallback_probe.py) and nodes with non-XLA tensor inputs or outputs.

  It compares fallback counters between nodes without clearing them, so
  user-visible counters survive the first call.
  """

  def __init__(self, module: torch.fx.GraphModule, placeholders: bool = False):
    super().__init__(module)
    self._unsupported_nodes: List[torch.fx.Node] = []
    # The arguments the look-ahead ran on (see _look_ahead).
    self.arguments: Sequence[Any] = ()
    self._watch = fallback_probe.FallbackCounterWatch()
    self._ops = fallback_probe.OpsOfThisThread(placeholders)
    # Whether a node updated an input in place (the `copy_` updates at the
    # graph's end are not run; see [Note: Input updates in a partitioned
    # graph]).
    self.updates_inputs_before_end = False

  def run(self, *args, **kwargs):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # The arguments enter as device data: one updated in place has pending
    # IR after the run. Off the device, its version counter moved (an
    # inference tensor keeps none).
    on_xla = [t for t in tensors if t.device.type == 'xla']
    others = [
        t for t in tensors if t.device.type != 'xla' and not t.is_inference()
    ]
    versions = [t._version for t in others]
    with self._ops:
      result = super().run(*args, **kwargs)
    self.updates_inputs_before_end = (
        versions != [t._version for t in others] or
        (bool(on_xla) and
         any(torch_xla._XLAC._check_tensor_need_materialization(on_xla))))
    return result

  def run_node(self, n: torch.fx.Node):
    if graph_updates.is_input_update(n):
      # See [Note: Input updates in a partitioned graph]: this run only
      # looks, and an update of a CPU input could not be undone.
      args, _ = self.fetch_args_kwargs_from_env(n)
      if not fallback_probe.all_on_xla(args):
        self._unsupported_nodes.append(n)
      return args[0]
    self._ops.names.clear()
    result = super().run_node(n)
    if n.op in ('placeholder', 'output'):
      return result
    changed = self._watch.changed()
    args, kwargs = self.fetch_args_kwargs_from_env(n)
    if (not fallback_probe.all_on_xla(result) or not fallback_probe.all_on_xla(
        list(itertools.chain(args, kwargs.values()))) or
        self._fell_back(n, args, kwargs, changed)):
      self._unsupported_nodes.append(n)
    return result

  def _fell_back(self, n: torch.fx.Node, args: Any, kwargs: Any,
                 changed: Set[str]) -> bool:
    """Whether `n`, just run on XLA inputs while the fallback counters
    `changed` changed, fell back to the CPU on this thread (see [Note:
    Fallback ops of this thread] in fallback_probe.py)."""
    if not changed or changed & self._ops.names:
      return bool(changed)
    # Another thread's, or one run inside a kernel: a second run tells.
    getattr(self, n.op)(n.target, args, kwargs)
    return bool(self._watch.changed() & changed)

  def get_unsupported_nodes(self) -> List[torch.fx.Node]:
    return self._unsupported_nodes


class InputCollector(torch.fx.Interpreter):
  """Records, on each fused submodule, the arguments it is first called with."""

  def call_module(self, target, args, kwargs):
    if 'fused_' in target:
      self.fetch_attr(target).xla_args = args
    return super().call_module(target, args, kwargs)

  def run_node(self, n: torch.fx.Node):
    if graph_updates.is_input_update(n):
      # This run only records (see [Note: Input updates in a partitioned
      # graph]).
      return self.fetch_args_kwargs_from_env(n)[0][0]
    return super().run_node(n)


def extract_compiled_graph(xla_model: torch.fx.GraphModule, xla_args):
  torch_xla._XLAC._xla_increment_counter('DynamoExtractCompiledGraph', 1)
  # Make CPU tensor constructors in the graph create XLA tensors.
  XLAConstructorMoverPass()(xla_model.graph)
  # What reads the arguments holds the lock; the look-ahead on placeholders
  # made from their metadata does not (see [Note: A hand-over's look-ahead
  # on placeholders]), nor does the sync of twins of the arguments that
  # have pending IR (see [Note: A hand-over's sync before the lock] in
  # handover_sync.py).
  with execution.execution_lock:
    specs = fallback_probe.look_ahead_specs(xla_model, xla_args)
    twins = ([] if xr.is_spmd() or tracing.graph_draws_random_numbers(
        xla_model.graph) else twins_of_pending_arguments(xla_args))
  execution.sync_pending([pending.twin for pending in twins])
  xla_only = False
  if specs is not None:
    with torch_xla.experimental.eager_mode_context(False):
      xla_only = _look_ahead_on_placeholders(xla_model, xla_args,
                                             specs) is False
  with execution.execution_lock, torch_xla.experimental.eager_mode_context(
      False):
    take_twins(twins)
    del twins
    return extract_compiled_graph_helper(xla_model, xla_args, xla_only)


def partition_fx_graph_for_cpu_fallback(
    xla_model: torch.fx.GraphModule, xla_args: Sequence[Any],
    unsupported_nodes: List[torch.fx.Node]) -> torch.fx.GraphModule:
  """Splits the graph around unsupported nodes; each XLA part gets its own
  signature cache, the unsupported nodes run eagerly on every call.

  [Note: CPU fallback with dynamic shapes]
  Graphs with int inputs are partitioned too: a fallback op left inside a
  traced graph would run once, at trace time, and its output would be a
  constant of the compiled program, stale for every later call of the
  signature. Int inputs are passed to each fused part like any other input
  and enter its signature.
  """
  if ptxla_debug or dynamo_debug:
    print(f'Dynamo fallback ops are {unsupported_nodes}. Please open a GitHub '
          'issue with the above op lowering requests.')
  # See [Note: Input updates in a partitioned graph].
  input_updates = graph_updates.input_updates(xla_model.graph)
  if input_updates:
    increment_counter(COUNTER_DONATION_FALLBACK, len(input_updates))
  unsupported = set(unsupported_nodes) | set(input_updates)

  class XlaOperatorSupport(OperatorSupport):

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
      return node.op in ('call_function', 'call_module',
                         'call_method') and (node not in unsupported or
                                             node.target == operator.getitem)

  partitioner = CapabilityBasedPartitioner(xla_model,
                                           XlaOperatorSupport(),
                                           allows_single_node_partition=True)
  partitions = partitioner.propose_partitions()
  # propose_partitions() does not guarantee topological order.
  for partition in partitions:
    partition.nodes = topo_sort(partition.nodes)
  partitioned_graph = partitioner.fuse_partitions(partitions)
  graph_updates.run_last(partitioned_graph.graph,
                         [node.name for node in input_updates])
  tensor_args = [a for a in xla_args if isinstance(a, torch.Tensor)]
  with pending_ir_restored(tensor_args + tracing.graph_constants(xla_model)):
    InputCollector(partitioned_graph).run(*xla_args)

  fused_parts = 0
  for node in list(partitioned_graph.graph.nodes):
    if node.op == 'call_module' and 'fused_' in node.name:
      fused_parts += 1
      fused_module = getattr(partitioned_graph, node.name)
      partitioned_graph.delete_submodule(node.target)
      with partitioned_graph.graph.inserting_after(node):
        new_node = partitioned_graph.graph.call_function(
            extract_internal(fused_module), node.args, None)
        node.replace_all_uses_with(new_node)
      partitioned_graph.graph.erase_node(node)
  partitioned_graph.recompile()
  if fused_parts:
    # Counted only when some part runs on XLA: a graph on CPU tensors alone
    # is not an XLA graph at all.
    increment_counter(COUNTER_CPU_FALLBACK_PARTITION, 1)
  return partitioned_graph


def _look_ahead(xla_model: torch.fx.GraphModule,
                xla_args: Sequence[Any]) -> UnsupportedNodesCollector:
  """Runs `xla_model` on `xla_args` node by node, leaving the arguments as
  they were; the collector tells what the run found, and the arguments it
  ran on (its `arguments`), which the graph's partition runs on too."""
  return _look_ahead_on(xla_model, xla_args)


def _look_ahead_on(xla_model: torch.fx.GraphModule,
                   xla_args: Sequence[Any],
                   on_zeros: bool = True) -> UnsupportedNodesCollector:
  """_look_ahead's work (its retry on zeros calls this one, not whatever
  stands in for _look_ahead). `on_zeros` False: where placeholders would be
  replaced by zeros, fallback_probe.NeedsValues is raised instead."""
  tensor_args = [a for a in xla_args if isinstance(a, torch.Tensor)]
  # A sharded stand-in holds data (see [Note: Placeholder tensors] in
  # io_utils.py): it can be read.
  placeholders = any(
      io_utils.is_placeholder(t) and not io_utils.is_stand_in(t)
      for t in tensor_args)
  # [Note: Look-ahead on placeholders]
  # The look-ahead runs the graph node by node, and a CPU fallback op or a
  # kernel that reads values runs a program on its inputs or reads their
  # buffers, which crashes the process on a placeholder (see [Note:
  # Placeholder tensors] in io_utils.py). So on placeholders:
  #   * a graph with a node known from its target alone to read values
  #     (fallback_probe.graph_reads_values) is looked at on zeros from the
  #     start;
  #   * otherwise the look-ahead's dispatch mode, on this thread alone,
  #     stops it before any op that may read values runs (_reads_values in
  #     fallback_probe.py: no XLA kernel, unless it takes no tensor, is a
  #     view, or its backend-free kernel reached no fallback in a probe on
  #     size-1 zeros;
  #     a kernel of torch_xla that reads values or falls back for some
  #     arguments: placeholder_trace.VALUE_READING_OPS, indexing with a mask),
  #     and it starts again on zeros.
  # The zeros have the placeholders' sizes and are made for the look-ahead
  # alone; the partition around such ops then runs on them too (the parts'
  # example inputs): only a graph that has such an op pays that memory.
  # Nothing here changes what other threads may do: their eager reads and
  # their programs run as ever (a device sync waits for the placeholder
  # call: [Note: Syncs wait for placeholder graphs] in io_utils.py). What
  # this rests on: every torch_xla kernel that runs a program or reads a
  # buffer for some arguments (each `call_fallback_fn` of torch_xla 2.9's
  # aten_xla_type.cpp, its values-reading kernels) is in
  # placeholder_trace.VALUE_READING_OPS, _MASK_INDEXING_OPS or
  # _FALLS_BACK_FOR_SOME_ARGUMENTS (fallback_probe.py).
  if placeholders and fallback_probe.graph_reads_values(xla_model.graph):
    if not on_zeros:
      raise fallback_probe.NeedsValues()
    return _look_ahead_on(xla_model, io_utils.zeros_for_placeholders(xla_args))
  collector = UnsupportedNodesCollector(xla_model, placeholders)
  try:
    with pending_ir_restored(tensor_args + tracing.graph_constants(xla_model)):
      collector.run(*xla_args)
  except fallback_probe.NeedsValues:
    if not on_zeros:
      raise
    return _look_ahead_on(xla_model, io_utils.zeros_for_placeholders(xla_args))
  collector.arguments = xla_args
  return collector


def _look_ahead_on_placeholders(
    xla_model: torch.fx.GraphModule, xla_args: Sequence[Any],
    specs: Sequence[Optional[Tuple[torch.Size,
                                   torch.dtype]]]) -> Optional[bool]:
  """Whether the graph has a node XLA does not compile, told by a look-ahead
  on a placeholder of each tensor argument's shape and dtype (`specs`, from
  fallback_probe.look_ahead_specs), with no lock held and no tensor
  argument read; None where it cannot tell so, and the look-ahead on the
  arguments must.

  [Note: A hand-over's look-ahead on placeholders]
  A call's hand-over of a new graph runs the graph node by node to find
  fallback ops (_look_ahead): on the arguments, under execution_lock, which
  calls of compiled programs then wait for. Run on placeholders of the
  arguments' shapes and dtypes, it reads and writes nothing another thread
  holds, so it runs with the lock let go: the metadata is read under the
  lock (fallback_probe.look_ahead_specs: a module's tensors are arguments
  too, and another thread's donating run may be taking one over, when even
  its size cannot be read), the look-ahead runs after, in flight as a trace
  on placeholders (a sync of the device waits for it: [Note: Syncs wait for
  placeholder graphs] in io_utils.py), and the rest of the hand-over takes
  the lock again. The graph's first-call lock (execution.extracted_once, the
  serializable backend's) keeps other calls of the graph out meanwhile; it
  comes before execution_lock in the lock order ([Note: Threads] in
  execution.py). It tells only where the answer cannot differ from the
  arguments': a graph with no constant tensors (whose in-place updates the
  look-ahead on the arguments sets back), no node known to read values and
  no op its dispatch mode stops (each would be run on zeros: see [Note:
  Look-ahead on placeholders]), no op that draws random numbers (each moves
  the device generator's seed on, which the look-ahead on the arguments
  does under the lock, in the order the calls come), every tensor on the
  XLA device, no SPMD. Where it finds a fallback op, the look-ahead on the
  arguments runs as before, as it does for the partition's example
  inputs."""
  try:
    io_utils.placeholder_traces.begin()
  except io_utils.PlaceholderWaitTimeout:
    return None
  collector = None
  try:
    collector = _look_ahead_on(xla_model, [
        arg if spec is None else io_utils.placeholder(*spec)
        for arg, spec in zip(xla_args, specs)
    ],
                               on_zeros=False)
    return bool(collector.get_unsupported_nodes())
  except Exception:  # fallback_probe.NeedsValues among them
    # The look-ahead on the arguments tells, and raises what it raises.
    return None
  finally:
    # The IR on placeholders goes with the collector, before the flight ends.
    collector = None
    io_utils.placeholder_traces.traced()
    io_utils.placeholder_traces.end()


# [Note: Graphs that cannot be split]
# A graph dynamo hands over without AOTAutograd (serve()'s captures) keeps
# its in-place updates where the model makes them: a StaticCache's
# `cumulative_length.add_` between the reads of it that place the new keys.
# The partitioner orders nodes by their data dependencies alone, so a part
# could read a tensor after another part has updated it. A graph with nodes
# XLA does not compile (CPU fallback ops, a CPU input moved to the device)
# that updates a tensor in place before its end (an input its look-ahead
# run updated, or a node that updates in place,
# `graph_updates.updates_in_place`) is therefore not split: it runs eagerly,
# node by node on lazy tensors, as the model would without torch.compile
# (counted as COUNTER_CPU_FALLBACK_EAGER; logged once per graph). Its
# answers are right; it compiles one XLA program per call. A compile-only
# call (see [Note: Compile-only calls] in execution.py) stops before running
# it: nothing of it is compiled ahead.


def _check_args(xla_args: Sequence[Any]) -> None:
  """Fails, or warns, with the argument named, before any tracing.

  A tensor on another device is allowed: the nodes that touch it are left
  out of the XLA graph and run eagerly (see `UnsupportedNodesCollector`), so
  the result stays correct, only slower.
  """
  for index, arg in enumerate(xla_args):
    if isinstance(arg, torch.Tensor):
      if arg.device.type != 'xla':
        # torch_xla's tests match the message's opening words.
        warnings.warn(
            f'Found tensor with shape {arg.size()} on {arg.device}: '
            f'{describe_arg(index, arg)} is not on the XLA device; the ops '
            'that use it run eagerly. Move all inputs to torch_xla.device() '
            'to run them in the compiled XLA graph.')
    else:
      check_scalar_input(index, arg)


def _run_eagerly(xla_model: torch.fx.GraphModule):
  """`xla_model` run node by node on each call (see [Note: Graphs that
  cannot be split])."""

  def run_eagerly(*args):
    if execution.compiling_only():
      raise execution.CompiledNotRun(None)
    with execution.execution_lock:
      return xla_model(*args)

  return run_eagerly


def extract_compiled_graph_helper(xla_model: torch.fx.GraphModule,
                                  xla_args,
                                  xla_only: bool = False):
  """The hand-over of a graph, under execution_lock, once its CPU tensor
  constructors make XLA tensors (extract_compiled_graph); `xla_only`: a
  look-ahead on placeholders found no node XLA does not compile (see
  _look_ahead_on_placeholders), so none runs here."""
  # Sync functional wrappers so each argument's value reference is current.
  for arg in xla_args:
    if isinstance(arg, torch.Tensor) and torch._is_functional_tensor(arg):
      apply_view_updates(arg)
  _check_args(xla_args)
  # Materialize the arguments so their ids show up as graph inputs (only
  # them: see [Note: Threads] in execution.py).
  sync_alone_noting_reads([
      arg for arg in xla_args
      if isinstance(arg, torch.Tensor) and arg.device.type == 'xla'
  ])
  if xla_only:
    xla_model.xla_args = xla_args
    return extract_internal(xla_model)

  look_ahead = _look_ahead(xla_model, xla_args)
  xla_args = look_ahead.arguments
  unsupported_nodes = look_ahead.get_unsupported_nodes()
  if unsupported_nodes and (look_ahead.updates_inputs_before_end or any(
      graph_updates.updates_in_place(node) for node in xla_model.graph.nodes)):
    # See [Note: Graphs that cannot be split].
    increment_counter(COUNTER_CPU_FALLBACK_EAGER, 1)
    logger.warning(
        'torch_xla_patches: a graph with nodes XLA does not compile (%s) '
        'updates tensors in place before its end; it runs eagerly, without '
        'a compiled program',
        ', '.join(f'{n.name}: {n.target}' for n in unsupported_nodes[:3]))
    return _run_eagerly(xla_model)
  if unsupported_nodes:
    return partition_fx_graph_for_cpu_fallback(xla_model, xla_args,
                                               unsupported_nodes)
  xla_model.xla_args = xla_args
  return extract_internal(xla_model)
