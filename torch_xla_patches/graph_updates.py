"""Which nodes of a captured FX graph update tensors in place: the updates
of the graph's inputs that AOTAutograd writes at its end, and any other;
and how a graph partitioned around CPU fallback ops runs the former last
(see [Note: Input updates in a partitioned graph]).
"""
import operator
from typing import List, Sequence

import torch


def input_updates(graph: torch.fx.Graph) -> List[torch.fx.Node]:
  """The nodes of `graph` that write a graph input in place (`copy_`), in
  order.

  [Note: Input updates in a partitioned graph]
  AOTAutograd, keeping an inference graph's updates of its inputs in the
  graph (keep_inference_input_mutations), writes them with `copy_` at the
  graph's end. The partitioner orders nodes by their data dependencies
  alone, which do not say that an update must follow every read of the
  input it writes, so a fused part could read an input another part has
  already written. So in a graph partitioned around CPU fallback ops, the
  updates are left out of the fused parts and run, in their order, after
  everything else, as AOTAutograd's epilogue would run them: eagerly, with
  no donation (counted as COUNTER_DONATION_FALLBACK). The runs that find
  the unsupported nodes and record the parts' arguments only look: they
  skip the updates, since one of a CPU input could not be undone.
  """
  return [node for node in graph.nodes if is_input_update(node)]


def is_input_update(node: torch.fx.Node) -> bool:
  return (node.op == 'call_function' and
          node.target is torch.ops.aten.copy_.default and
          isinstance(node.args[0], torch.fx.Node) and
          node.args[0].op == 'placeholder')


# Python's in-place operators, as dynamo records `x += y` and `x[i] = y`.
IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.imatmul
})


def updates_in_place(node: torch.fx.Node) -> bool:
  """Whether `node` updates a tensor in place, other than the updates of
  the graph's inputs at its end (see [Note: Graphs that cannot be split]
  in dynamo_bridge.py): a tensor method or torch function named with a
  trailing underscore (`add_`, `index_copy_`), an aten op whose schema
  mutates, or an in-place operator."""
  if node.op not in ('call_method', 'call_function') or is_input_update(node):
    return False
  target = node.target
  if node.op == 'call_method':
    return target.endswith('_') and not target.startswith('_')
  if target in IN_PLACE_OPERATORS:
    return True
  schema = getattr(target, '_schema', None)
  if schema is not None:
    return schema.is_mutable
  name = getattr(target, '__name__', '')
  return name.endswith('_') and not name.startswith('_')


def run_last(graph: torch.fx.Graph, names: Sequence[str]) -> None:
  """Moves the nodes named `names` (fuse_partitions makes a new graph), in
  order, then the output node, to the end of `graph`.
  fuse_partitions orders the nodes topologically, and an output that
  depends on nothing (a graph whose only effects are updates of its inputs:
  an optimizer step) can come first, where no node after it would run."""
  by_name = {node.name: node for node in graph.nodes}
  output = next(node for node in graph.nodes if node.op == 'output')
  for node in [by_name[name] for name in names] + [output]:
    last = next(iter(reversed(graph.nodes)))
    if last is not node:
      last.append(node)
