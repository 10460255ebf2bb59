"""One run of a compiled signature's program and its write-back, for every
run of the bridge.

[Note: One run of a compiled program]
The bridge's callable (extract_internal in dynamo_bridge.py), its recovery
after a refusal, and a bound program (serving's fast path, see [Note: Bound
programs] in bound_program.py) run a signature's program the same way, in
`run_entry`; a program that updates no argument and has no pending input to
sync (CompiledGraphEntry.writes_nothing_back) they run with
execution.run_program alone, all that run_entry would do for it. Every run
goes through execution.run_program:
  * inputs with pending IR are synced first, counted, unless upstream's
    config.skip_input_data_check says not to (see [Note: Input
    materialization check] in dynamo_bridge.py);
  * the caller builds the XLA inputs then, readying donated buffers (see
    [Note: Donating in-place updates] in donation.py);
  * the program runs (execution.run_program: a refusal before the run
    raises RefusedBeforeRun, and nothing is written back);
  * the arguments the program updates in place take their results: a
    donated one takes its result over (take_results, see [Note: Taking a
    result] in donation.py), any other copies it.
A graph that computes nothing runs nothing.
"""
from typing import Callable, List, Sequence

import torch

from torch_xla._dynamo import config as upstream_config
from torch_xla_patches.donation import take_results
from torch_xla_patches import execution
from torch_xla_patches.execution import sync_pending_inputs
from torch_xla_patches.tracing import CompiledGraphEntry


def run_entry(entry: CompiledGraphEntry, pending: Sequence[torch.Tensor],
              inputs: Callable[[], List[torch.Tensor]],
              argument: Callable[[int], torch.Tensor],
              drop_update_log: bool) -> List[torch.Tensor]:
  """Runs `entry`'s program and writes its updates back; returns its results
  (see [Note: One run of a compiled program]).

  Args:
    entry: the signature's compiled entry.
    pending: the inputs that may have pending IR, synced before the run.
    inputs: makes the XLA input list, after that sync.
    argument: the tensor at an argument position, to write an update to.
    drop_update_log: whether a donated argument's update log is dropped
      (see [Note: Taking a result] in donation.py).
  """
  if not entry.output_plan.num_results:
    return []
  if pending and not upstream_config.skip_input_data_check:
    sync_pending_inputs(pending)
  results = execution.run_program(entry.graph_hash, inputs())
  write_back(entry, results, argument, drop_update_log)
  return results


def write_back(entry: CompiledGraphEntry, results: List[torch.Tensor],
               argument: Callable[[int],
                                  torch.Tensor], drop_update_log: bool) -> None:
  """The arguments the program updates in place take their results: the
  copied ones first, then the donated ones, in one take_results."""
  split = entry.update_split
  for position, result_index in split.copied:
    argument(position).copy_(results[result_index])
  if split.taken:
    take_results([argument(position) for position, _ in split.taken],
                 [results[result_index] for _, result_index in split.taken],
                 drop_update_log)
