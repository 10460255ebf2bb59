"""Shared test set-up: the CPU PJRT device, hypothesis profiles, and the
`requires` marker for tests that need a feature of one release."""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
# A replay failure that no check of a record explains raises in the suite
# (config.strict_replay), here and in the processes tests start.
os.environ.setdefault('XLA_PATCHES_STRICT_REPLAY', '1')
# serve() returns once its buckets are compiled (config.serve_wait), here and
# in the processes tests start, so that tests read the counters of a finished
# warm-up; the tests of serving in the background pass wait=False.
os.environ.setdefault('XLA_PATCHES_SERVE_WAIT', '1')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
from hypothesis import HealthCheck, settings

# ci: derandomized, so CI is reproducible; dev: quick; debug: thorough.
settings.register_profile('ci',
                          derandomize=True,
                          max_examples=12,
                          deadline=None,
                          print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('dev',
                          max_examples=8,
                          deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('debug',
                          max_examples=100,
                          deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'dev'))

# [Note: Tests that need one release]
# The suite runs on every supported release (`make test TORCH_XLA=2.8.1`, see
# torch_xla_patches/versions.py). A test that needs what only some releases
# have says so with `@pytest.mark.requires(FEATURE)` (or a module-level
# `pytestmark`), and is skipped elsewhere with the reason below. The features
# are decided here, from versions.py; test bodies never compare versions.


def _has_torch_aot_compile() -> bool:
  from torch_xla_patches import versions
  return versions.has_torch_aot_compile()


def _lacks_torch_aot_compile() -> bool:
  return not _has_torch_aot_compile()


def _installed_torch_xla_is_2_9_0() -> bool:
  from torch_xla_patches import versions
  return versions.installed().torch_xla == '2.9.0'


def _xla_errors_are_exceptions() -> bool:
  from torch_xla_patches import versions
  return versions.xla_errors_are_exceptions()


# feature -> (test, reason to skip where the test is False)
FEATURES = {
    'torch_aot_compile':
        (_has_torch_aot_compile,
         'needs torch 2.9 (torch._dynamo.aot_compile: save and load)'),
    'no_torch_aot_compile':
        (_lacks_torch_aot_compile,
         'checks how releases without torch aot_compile refuse save and load'),
    'xla_errors_are_exceptions':
        (_xla_errors_are_exceptions,
         'torch_xla 2.8 aborts the process on this XLA error status instead '
         'of raising'),
    'torch_xla_2.9.0':
        (_installed_torch_xla_is_2_9_0,
         'tools/make_upstream_patch.py renders against torch_xla 2.9.0 only'),
}


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'requires(feature): skip unless this release has the '
      f'feature; one of {sorted(FEATURES)} (see conftest.py)')


def pytest_collection_modifyitems(config, items):
  verdicts = {}
  installed = None
  for item in items:
    for marker in item.iter_markers('requires'):
      (feature,) = marker.args
      if feature not in FEATURES:
        raise pytest.UsageError(f'{item.nodeid}: unknown feature {feature!r}; '
                                f'known: {sorted(FEATURES)}')
      if feature not in verdicts:
        verdicts[feature] = FEATURES[feature][0]()
      if not verdicts[feature]:
        if installed is None:
          from torch_xla_patches import versions
          installed = versions.installed().describe()
        item.add_marker(
            pytest.mark.skip(
                reason=f'{FEATURES[feature][1]}; installed: {installed}'))


@pytest.fixture
def patched_bridge():
  """The patch applied, dynamo reset and metrics zeroed; reverted after."""
  import torch_xla_patches
  from bridge_testing import fresh
  torch_xla_patches.apply()
  fresh()
  yield
  torch_xla_patches.revert()


_DISPATCH_MODE_FLAGS = ('_is_in_torch_dispatch_mode',
                        '_is_in_non_infra_torch_dispatch_mode',
                        '_is_in_any_mode_without_ignore_compile_internals')


@pytest.fixture(autouse=True)
def no_dispatch_mode_flag_left():
  """Fails the test that leaves one of torch's process-wide dispatch mode
  flags set with no mode on: dynamo would then run every later test's new
  frames eagerly (see [Note: Fallback ops of this thread]). The flags are
  cleared, so only that test fails."""
  yield
  from torch.utils import _python_dispatch
  import torch
  if torch._C._len_torch_dispatch_stack():
    return
  left = [
      name for name in _DISPATCH_MODE_FLAGS
      if getattr(_python_dispatch, name, False)
  ]
  for name in left:
    setattr(_python_dispatch, name, False)
  assert not left, f'dispatch mode flags left set: {left}'


@pytest.fixture(scope='session', autouse=True)
def native_fast_path():
  """The native module loaded (make setup builds it) before any test, so that
  the whole suite runs one implementation of the per-call work; tests that
  take `python_twins` run the Python one (test_native.py holds the two to
  the same answers)."""
  from torch_xla_patches import native
  native.helpers()


@pytest.fixture
def python_twins(monkeypatch):
  """The Python twins of the native module's functions, for one test."""
  from torch_xla_patches import config
  monkeypatch.setattr(config, 'native_fast_path', False)
