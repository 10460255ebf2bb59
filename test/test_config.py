"""Flags are validated where they are read: a bad environment value fails the
import, a bad apply() argument fails apply(), each naming the variable, the
value and what it accepts."""
import pytest

import torch_xla_patches
from torch_xla_patches import config
from bridge_testing import run_python


@pytest.mark.parametrize('env_var, value, message', [
    ('XLA_PATCHES_PRECOMPILE', 'snyc',
     "XLA_PATCHES_PRECOMPILE (config.precompile_mode) is 'snyc'; it accepts "
     "'sync' or 'interleaved' or 'off'"),
    ('XLA_PATCHES_REPLAY_SYNC_MAX', '-1',
     "XLA_PATCHES_REPLAY_SYNC_MAX (config.replay_sync_max_signatures) is "
     "'-1'; it accepts an integer >= 0 (0: no bound)"),
    ('XLA_PATCHES_REPLAY_SYNC_SECONDS', 'nan',
     "XLA_PATCHES_REPLAY_SYNC_SECONDS (config.replay_sync_seconds) is 'nan'; "
     "it accepts a number of seconds >= 0 (0: no bound)"),
    ('XLA_PATCHES_EXPLAIN_MISSES', 'ture',
     "XLA_PATCHES_EXPLAIN_MISSES (config.explain_misses) is 'ture'; it "
     "accepts 1, true, yes, on, 0, false, no, off"),
])
def test_a_bad_environment_value_fails_the_import(env_var, value, message):
  proc = run_python('import torch_xla_patches', env={env_var: value})
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1] == (
      f'torch_xla_patches.config.FlagError: {message}')


def test_good_environment_values_are_parsed():
  proc = run_python(
      'from torch_xla_patches import config\n'
      'print(config.precompile_mode, config.replay_sync_max_signatures, '
      'config.replay_sync_seconds, config.explain_misses)',
      env={
          'XLA_PATCHES_PRECOMPILE': 'off',
          'XLA_PATCHES_REPLAY_SYNC_MAX': '0',
          'XLA_PATCHES_REPLAY_SYNC_SECONDS': '2.5',
          'XLA_PATCHES_EXPLAIN_MISSES': 'Yes',
      })
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ['off', '0', '2.5', 'True']


def test_apply_refuses_a_bad_argument_before_changing_anything():
  assert not torch_xla_patches.is_applied()
  with pytest.raises(config.FlagError) as info:
    torch_xla_patches.apply(precompile_mode='snyc')
  assert str(info.value) == (
      "XLA_PATCHES_PRECOMPILE (config.precompile_mode) is 'snyc'; it accepts "
      "'sync' or 'interleaved' or 'off'")
  with pytest.raises(config.FlagError, match='automatic_dynamic_shapes'):
    torch_xla_patches.apply(automatic_dynamic_shapes='yes')
  assert not torch_xla_patches.is_applied()
  assert config.precompile_mode == 'sync'
