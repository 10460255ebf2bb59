"""A hand-over's sync before the lock: twins of a new dynamo graph's
arguments that have pending IR, synced with execution_lock let go and taken
back under it. See [Note: A hand-over's sync before the lock].
"""
import dataclasses
from typing import Any, List, Sequence

import torch
import torch_xla

from torch_xla_patches.donation import (apply_view_updates, inner_value,
                                        is_functional, replace_functional_value)
from torch_xla_patches.execution import note_data, pending_of


@dataclasses.dataclass(frozen=True)
class PendingTwin:
  """`twin`, a lazy tensor on the pending IR of `tensor` (a functional
  wrapper) made under execution_lock, to be synced with the lock let go and
  taken back by `tensor` under it (see [Note: A hand-over's sync before the
  lock]); `value_id` names the lazy tensor inside
  `tensor` when the twin was made."""
  tensor: torch.Tensor
  value_id: int
  twin: torch.Tensor


def pending_twins(tensors: Sequence[torch.Tensor]) -> List[PendingTwin]:
  """Under execution_lock: a twin of each functional wrapper among `tensors`
  that has pending IR. A twin shares its tensor's IR (torch_xla's clone
  copies no data and adds no node) and nothing else: syncing it writes no
  state another thread may read."""
  twins = []
  for tensor in tensors:
    if is_functional(tensor):
      value = inner_value(tensor)
      twins.append(
          PendingTwin(tensor=tensor,
                      value_id=torch_xla._XLAC._xla_get_tensor_id(value),
                      twin=value.clone()))
  return twins


def take_twins(twins: Sequence[PendingTwin]) -> None:
  """Under execution_lock: each tensor whose value is still the one its twin
  was made from takes the twin's synced data as its value (the same value,
  which its views need not replay), noted as given in the data ledger; one
  updated since keeps its own value, for the hand-over's sync under the
  lock."""
  for pending in twins:
    value = inner_value(pending.tensor)
    if torch_xla._XLAC._xla_get_tensor_id(value) != pending.value_id:
      continue
    replace_functional_value(pending.tensor, pending.twin)
    note_data(pending.tensor, given=True)


def twins_of_pending_arguments(xla_args: Sequence[Any]) -> List[PendingTwin]:
  """Under execution_lock: twins of a hand-over's XLA tensor arguments that
  have pending IR, each functional wrapper's value first brought up to date
  with its views' updates, as the hand-over does.

  [Note: A hand-over's sync before the lock]
  A hand-over makes its arguments device data before it traces them; those
  of a shape no program had (a new batch size's inputs, a cache of a new
  size just reset) take an XLA compile of their own, tens of ms, which
  other threads' calls of compiled programs would wait for under
  execution_lock. A sync writes the tensors it syncs (their IR goes, their
  buffer comes later), and other threads read module state under the lock
  (a guard check reads a module's buffers), so the arguments themselves are
  not synced off it: under the lock, each one with pending IR gets a twin,
  a lazy tensor on the same IR and nothing else (pending_twins);
  the twins are synced with the lock let go; under the lock again, each
  argument whose value is still the one its twin was made from takes the
  twin's data (take_twins). An argument updated meanwhile keeps
  its value, which the hand-over syncs under the lock as before, as it does
  one that is no functional wrapper (XLA_DISABLE_FUNCTIONALIZATION=1). The
  hand-over (dynamo_bridge.extract_compiled_graph) makes no twins under SPMD
  (a twin carries no sharding) nor for a graph that draws random numbers,
  whose hand-over keeps its place among other threads' traces under the
  lock, as its look-ahead does."""
  tensors = [
      arg for arg in xla_args
      if isinstance(arg, torch.Tensor) and arg.device.type == 'xla'
  ]
  for tensor in tensors:
    if is_functional(tensor):
      apply_view_updates(tensor)
  return pending_twins(pending_of(tensors))
