"""Records: every field is checked before anything is allocated, the byte
bound is one rule for the index and the artifact, and a rebuild takes the
live parameters and pins no user input."""
import math

import pytest
import torch

from torch_xla_patches import config, io_utils, record
from torch_xla_patches.signature import ArgKind, ArgLayout

LAYOUT = ArgLayout(kinds=(ArgKind.SHAPE, ArgKind.DYNAMIC_TENSOR,
                          ArgKind.PARAMETER, ArgKind.SCALAR))
SPECS = ({
    'value': 4
}, {
    'shape': [4, 8],
    'dtype': 'float32'
}, None, {
    'value': 0.5
})


def live_args():
  return [7, torch.ones(7, 8), torch.nn.Parameter(torch.ones(3)), 0.25]


def make_record(specs=SPECS):
  return record.RecordedSignature(record_id=record.record_id_of(specs, None),
                                  specs=specs,
                                  shardings=None)


def with_spec(position, spec):
  specs = list(SPECS)
  specs[position] = spec
  return tuple(specs)


@pytest.mark.parametrize('specs, reason', [
    (with_spec(0, {'value': -1}), 'input 0 (shape): a size must be a '
     'non-negative integer, found -1'),
    (with_spec(0, {'value': True}), 'input 0 (shape): a size must be a '
     'non-negative integer, found True'),
    (with_spec(1, {'shape': [4, 8]}), 'input 1 (dynamic_tensor): expected a '
     "tensor spec, found {'shape': [4, 8]}"),
    (with_spec(2, {'value': 1}), "input 2 (parameter): expected null, found "
     "{'value': 1}"),
    (with_spec(3, {'value': math.nan}), 'input 3 (scalar): expected a finite '
     'number, found nan'),
    (with_spec(3, {'value': 'x'}), "input 3 (scalar): expected a finite "
     "number, found 'x'"),
    (SPECS[:3], 'expected a list of 4 input specs, found'),
])
def test_parse_specs_names_what_is_wrong(specs, reason):
  with pytest.raises(record.RecordError) as info:
    record.parse_specs(LAYOUT.kinds, specs)
  assert str(info.value).startswith(reason), str(info.value)


def test_template_bounds_the_bytes_a_record_would_allocate(monkeypatch):
  big = make_record(with_spec(1, {'shape': [1024, 1024], 'dtype': 'float32'}))
  template = record.ReplayTemplate.of(LAYOUT, live_args())
  # The automatic bound: 256 MiB, or 8 times the live call's tensor bytes.
  assert template.max_bytes == 256 << 20
  template.check(big)
  monkeypatch.setattr(config, 'replay_max_bytes', (4 << 20) - 1)
  template = record.ReplayTemplate.of(LAYOUT, live_args())
  with pytest.raises(record.RecordError) as info:
    template.check(big)
  assert str(info.value) == ('its tensors would take 4194304 bytes, over the '
                             'bound of 4194303 (config.replay_max_bytes)')


def test_the_automatic_bound_grows_with_the_live_call():
  args = live_args()
  args[2] = torch.nn.Parameter(torch.ones(64 << 20))  # 256 MiB of float32
  template = record.ReplayTemplate.of(LAYOUT, args)
  assert template.max_bytes == 8 * ((256 << 20) + 7 * 8 * 4)


@pytest.mark.parametrize('spec, reason', [
    ({
        'shape': [4, 8],
        'dtype': 'int64'
    }, 'input 1 has dtype int64, the live input float32'),
    ({
        'shape': [4, 8, 1],
        'dtype': 'float32'
    }, 'input 1 has rank 3, the live input rank 2'),
])
def test_template_refuses_another_dtype_or_rank(spec, reason):
  template = record.ReplayTemplate.of(LAYOUT, live_args())
  with pytest.raises(record.RecordError, match=reason):
    template.check(make_record(with_spec(1, spec)))


def test_rebuild_uses_live_parameters_and_recorded_sizes():
  live = live_args()
  template = record.ReplayTemplate.of(LAYOUT, live)
  args = template.rebuild(make_record(), 'cpu')
  assert args[0] == 4 and args[3] == 0.5
  assert args[1].shape == (4, 8) and args[1].dtype == torch.float32
  assert args[2] is live[2]


def test_template_keeps_no_user_input_of_dynamic_size():
  live = live_args()
  template = record.ReplayTemplate.of(LAYOUT, live)
  kept = [tensor for _, tensor in template.fixed]
  assert len(kept) == 1 and kept[0] is live[2]
  assert not any(live[1] is value for value in vars(template).values())


def test_rebuild_call_checks_an_example_call_with_the_same_rules():
  params = [torch.ones(4)]
  args = record.rebuild_call([{
      'shape': [2, 3],
      'dtype': 'int64'
  }, {
      'value': 3
  }], params, 'cpu')
  assert args[0].shape == (2, 3) and args[0].dtype == torch.int64
  assert args[1] == 3
  for raw, reason in [
      ('abc', "the example call is 'abc'"),
      ([{
          'value': math.nan
      }], 'argument 0: expected a finite number'),
      ([{
          'shape': [2**40, 8],
          'dtype': 'float32'
      }], 'over the bound of 268435456'),
      ([{
          'shape': [-1],
          'dtype': 'float32'
      }], 'argument 0: sizes must be non-negative integers'),
  ]:
    with pytest.raises(record.RecordError) as info:
      record.rebuild_call(raw, params, 'cpu')
    assert reason in str(info.value), str(info.value)


def test_records_round_trip_through_the_artifact_form():
  records = (make_record(), make_record(with_spec(0, {'value': 6})))
  state = record.records_to_json(LAYOUT.kinds, records)
  loaded = record.records_from_json(state, source='an artifact')
  assert [r.record_id for r in loaded] == [r.record_id for r in records]
  assert [r.specs for r in loaded] == [r.specs for r in records]
  assert {r.source for r in loaded} == {'an artifact'}


def test_damaged_artifact_records_fail_their_check_not_the_load():
  (damaged,) = record.records_from_json({'specs': 12}, source='f')
  template = record.ReplayTemplate.of(LAYOUT, live_args())
  with pytest.raises(record.RecordError,
                     match='expected a list of 4 input specs, found 12'):
    template.check(damaged)
  assert record.records_from_json(None, source='f') == ()


def test_tensor_bytes_cannot_overflow():
  spec = io_utils.TensorSpec((2**40, 2**40), torch.float64)
  assert record.tensor_bytes(spec) == 2**83
