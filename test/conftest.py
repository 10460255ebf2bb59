"""Shared test set-up: the CPU PJRT device and hypothesis profiles."""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
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


@pytest.fixture
def patched_bridge():
  """The patch applied, dynamo reset and metrics zeroed; reverted after."""
  import torch_xla_patches
  from bridge_testing import fresh
  torch_xla_patches.apply()
  fresh()
  yield
  torch_xla_patches.revert()
