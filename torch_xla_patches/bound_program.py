"""A compiled signature bound to the tensors of a call, run from the free
arguments of later calls alone (serving's fast path). See [Note: Bound
programs].
"""
import dataclasses
import functools
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from torch_xla._dynamo import config as upstream_config
from torch_xla_patches.counters import (COUNTER_DONATION_COPIED_READ,
                                        increment_counter)
from torch_xla_patches.donation import move_to_private_copy, read_donations
from torch_xla_patches import execution
from torch_xla_patches.execution import RefusedBeforeRun
from torch_xla_patches.program_run import run_entry
from torch_xla_patches.tracing import CompiledGraphEntry


@dataclasses.dataclass(frozen=True, eq=False)
class BoundArgument:
  """A graph argument of a bound program: the free argument at `free_index`
  of a call, or else the `bound` tensor."""
  free_index: Optional[int]
  bound: Optional[torch.Tensor]

  def of(self, free_args: Sequence[Any]) -> torch.Tensor:
    return self.bound if self.free_index is None else free_args[self.free_index]


class BoundProgram:
  """One compiled signature, run from the free arguments of a call alone.

  [Note: Bound programs]
  A bound program holds the XLA input list of its signature with every input
  that is not a free argument filled in: the tensors of the bound arguments
  (parameters and buffers, by identity) and the graph's constants. A call
  copies the list, puts the free arguments in their slots and runs the
  program. It checks nothing of what the bound tensors are: the caller
  guarantees that the bound arguments are still what the graph would be
  handed (serving's fast path, through its module watch) and that the free
  arguments have the signature's shapes. The run is the bridge's own (see
  [Note: One run of a compiled program] in program_run.py): free tensors
  with pending IR are synced first, in their graph arguments' order
  (`free_slots` is kept in it), as the bridge's callable syncs a call:
  torch_xla compiles one program per sync, keyed by its tensors in order,
  so a fast call reuses the sync program of the full calls before it
  rather than compiling its own. A donated argument read since its data
  was set is copied for the run, arguments updated in place take their
  results (see [Note: Donating in-place updates] in donation.py; views and
  aliases of them follow); a program that updates no argument has nothing
  to write back, and runs without run_entry's steps around it. The
  signature is looked up and served as every run of the bridge is
  (SignatureCache.look_up and served: LRU order, hit counter, usage,
  backlog), under execution_lock (see [Note: Threads] in execution.py). A
  run that cannot start (its signature dropped from the cache or traced
  again, a bound tensor with pending IR, a program XLA evicted) raises
  RefusedBeforeRun with nothing run; the caller then goes through the
  bridge's callable, which recovers. Any other error is the call's own and
  propagates.

  Args:
    cache: the graph's signature cache.
    key: the signature's key.
    entry: the signature's compiled entry.
    inputs: the XLA inputs, None in the free slots.
    free_slots: (XLA input slot, free argument index) of each free input,
      in the order of their graph arguments.
    updated: the argument at each position the program updates in place.
    donated: (XLA input slot, argument) of each argument whose buffer the
      program takes over.
  """

  def __init__(self,
               cache: 'SignatureCache',
               key: Hashable,
               entry: CompiledGraphEntry,
               inputs: List[Any],
               free_slots: Tuple[Tuple[int, int], ...],
               updated: Optional[Dict[int, BoundArgument]] = None,
               donated: Tuple[Tuple[int, BoundArgument], ...] = ()):
    self.key = key
    self.graph_hash = entry.graph_hash
    self._cache = cache
    self._entry = entry
    self._inputs = inputs
    self._free_slots = free_slots
    self._updated = updated or {}
    self._donated = donated
    self._copy_if_read = [True] * len(donated)
    self._output_plan = entry.output_plan
    self._runs = 0
    self._outputs_are_results = entry.output_plan.outputs_are_results
    self._free_indices = tuple(index for _, index in free_slots)
    # A call then fills in its free inputs and runs the program: run_entry's
    # other steps have nothing to do.
    self._writes_nothing_back = entry.writes_nothing_back

  def __call__(self, free_args: Sequence[torch.Tensor]) -> List[Any]:
    """Runs the program; returns every graph output, in order. Raises
    RefusedBeforeRun if it cannot start."""
    # The call's own inputs, synced before the lock (see [Note: Threads] in
    # execution.py): a new shape's sync compiles.
    synced = None
    if self._free_indices and not upstream_config.skip_input_data_check:
      synced = execution.sync_before_the_lock(
          list(map(free_args.__getitem__, self._free_indices)))
    with execution.execution_lock:
      if synced:
        execution.note_synced_inputs(synced)
      cache = self._cache
      if cache.look_up(self.key) is not self._entry:
        raise RefusedBeforeRun('the signature\'s entry was dropped from the '
                               'cache or traced again')
      if self._writes_nothing_back:
        results = execution.run_program(self.graph_hash,
                                        self._inputs_of(free_args))
      else:
        results = run_entry(
            self._entry,
            pending=(),
            inputs=functools.partial(self._inputs_of, free_args),
            argument=lambda position: self._updated[position].of(free_args),
            drop_update_log=(self._runs + 1) % UPDATE_LOG_RUNS == 0)
        if self._output_plan.num_results:
          self._runs += 1
      outputs = (results if self._outputs_are_results else
                 self._output_plan.outputs(results, ()))
      cache.served(self.key)
      return outputs

  def _inputs_of(self, free_args: Sequence[torch.Tensor]) -> List[Any]:
    """The XLA inputs of a call: the free arguments in their slots, and a
    private copy for a donated argument something else may hold."""
    inputs = self._inputs.copy()
    for slot, index in self._free_slots:
      inputs[slot] = free_args[index]
    if self._donated:
      donated = [argument.of(free_args) for _, argument in self._donated]
      for index in read_donations(donated, None, self._copy_if_read):
        increment_counter(COUNTER_DONATION_COPIED_READ, 1)
        inputs[self._donated[index][0]] = move_to_private_copy(donated[index])
    return inputs


# A bound program drops the update logs of the arguments it updates every
# this many runs (see [Note: Taking a result] in donation.py).
UPDATE_LOG_RUNS = 32
