"""The backlog: one budget per first call, one meaning per mode, damaged
records skipped and counted, and replay bugs raised in strict mode."""
import gc
import logging
import weakref

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

from torch_xla_patches import backlog as backlog_lib
from torch_xla_patches import config, record
from torch_xla_patches.signature import ArgKind, ArgLayout

LAYOUT = ArgLayout(kinds=(ArgKind.SHAPE, ArgKind.DYNAMIC_TENSOR,
                          ArgKind.TENSOR))


def specs_of(batch):
  return ({'value': batch}, {'shape': [batch, 4], 'dtype': 'float32'}, None)


def make_record(batch, specs=None):
  specs = specs_of(batch) if specs is None else specs
  return record.RecordedSignature(record_id=record.record_id_of(specs, None),
                                  specs=specs,
                                  shardings=None,
                                  source=f'record {batch}')


def live_args(batch=2):
  device = torch_xla.device()
  return [batch, torch.zeros(batch, 4, device=device), torch.ones(3).to(device)]


class Compiler:
  """Stands in for the bridge: notes the batch of every signature."""

  def __init__(self, error=None):
    self.batches = []
    self.error = error

  def __call__(self, args):
    if self.error is not None:
      raise self.error
    assert args[1].shape == (args[0], 4)
    self.batches.append(args[0])
    return True


@pytest.fixture
def quiet(monkeypatch):
  monkeypatch.setattr(config, 'precompile_progress', False)
  met.clear_all()


def counters():
  return (met.counter_value(backlog_lib.COUNTER_PRECOMPILED) or
          0, met.counter_value(backlog_lib.COUNTER_PRECOMPILE_SKIPPED) or 0)


def test_one_budget_is_shared_by_everything_queued_before_the_first_call(
    quiet, monkeypatch):
  monkeypatch.setattr(config, 'precompile_mode', 'sync')
  monkeypatch.setattr(config, 'replay_sync_max_signatures', 3)
  compiler = Compiler()
  backlog = backlog_lib.Backlog(0, LAYOUT, compiler)
  args = live_args()
  # The live call's own record is not queued again.
  assert backlog.queue([make_record(b) for b in (2, 5, 6)], args) == 2
  backlog.drain_for_first_call()
  # A second source (an artifact) in the same first call: one budget.
  assert backlog.queue([make_record(b) for b in (5, 7, 8, 9)], args) == 3
  backlog.drain_for_first_call()
  assert compiler.batches == [5, 6, 7]
  backlog.after_served_call()  # the first call waited already
  assert compiler.batches == [5, 6, 7]
  backlog.after_served_call()
  backlog.drain_for_first_call()  # the first call is over: no budget left
  assert compiler.batches == [5, 6, 7, 8]
  assert len(backlog) == 1
  assert counters() == (4, 0)


@pytest.mark.parametrize('mode, after_first_call', [('interleaved', [5]),
                                                    ('off', [])])
def test_other_modes_compile_after_served_calls_or_on_demand(
    quiet, monkeypatch, mode, after_first_call):
  monkeypatch.setattr(config, 'precompile_mode', mode)
  compiler = Compiler()
  backlog = backlog_lib.Backlog(0, LAYOUT, compiler)
  backlog.queue([make_record(b) for b in (5, 6, 7)], live_args())
  backlog.drain_for_first_call()
  assert compiler.batches == []
  backlog.after_served_call()
  assert compiler.batches == after_first_call
  report = backlog.drain_all()
  assert compiler.batches == [5, 6, 7]
  assert (report.compiled, report.skipped,
          report.remaining) == (3 - len(after_first_call), 0, 0)


def test_zero_means_no_bound(quiet, monkeypatch):
  monkeypatch.setattr(config, 'precompile_mode', 'sync')
  monkeypatch.setattr(config, 'replay_sync_max_signatures', 0)
  monkeypatch.setattr(config, 'replay_sync_seconds', 0.0)
  compiler = Compiler()
  backlog = backlog_lib.Backlog(0, LAYOUT, compiler)
  backlog.queue([make_record(b) for b in range(3, 20)], live_args())
  backlog.drain_for_first_call()
  assert compiler.batches == list(range(3, 20))


def test_damaged_records_are_skipped_in_strict_mode_too(quiet, monkeypatch,
                                                        caplog):
  monkeypatch.setattr(config, 'strict_replay', True)
  compiler = Compiler()
  backlog = backlog_lib.Backlog(7, LAYOUT, compiler)
  damaged = make_record(9,
                        specs=({
                            'value': 9
                        }, {
                            'shape': [-1, 4],
                            'dtype': 'float32'
                        }, None))
  backlog.queue([damaged, make_record(5)], live_args())
  with caplog.at_level(logging.WARNING, logger='torch_xla_patches'):
    report = backlog.drain_all()
  assert (report.compiled, report.skipped) == (1, 1)
  assert compiler.batches == [5]
  assert counters() == (1, 1)
  (warning,) = [r.getMessage() for r in caplog.records]
  assert warning.startswith('torch_xla_patches: graph 7 skipped a recorded '
                            'signature from record 9: input 1 '
                            '(dynamic_tensor): sizes must be non-negative')


def test_a_replay_bug_raises_in_strict_mode(quiet, monkeypatch):
  monkeypatch.setattr(config, 'strict_replay', True)
  backlog = backlog_lib.Backlog(0, LAYOUT, Compiler(KeyError('bug')))
  backlog.queue([make_record(5)], live_args())
  with pytest.raises(KeyError, match='bug'):
    backlog.drain_all()


def test_a_replay_bug_is_a_counted_skip_otherwise(quiet, monkeypatch, caplog):
  monkeypatch.setattr(config, 'strict_replay', False)
  backlog = backlog_lib.Backlog(0, LAYOUT, Compiler(KeyError('bug')))
  backlog.queue([make_record(5), make_record(6)], live_args())
  with caplog.at_level(logging.WARNING, logger='torch_xla_patches'):
    report = backlog.drain_all()
  assert (report.compiled, report.skipped) == (0, 2)
  assert counters() == (0, 2)
  assert "KeyError: 'bug'" in caplog.records[0].getMessage()


def test_the_backlog_lets_go_of_the_live_call_once_empty(quiet):
  args = live_args()
  static = weakref.ref(args[2])
  backlog = backlog_lib.Backlog(0, LAYOUT, Compiler())
  backlog.queue([make_record(5)], args)
  del args
  gc.collect()
  assert static() is not None  # replay needs the static tensor
  backlog.drain_all()
  gc.collect()
  assert static() is None
