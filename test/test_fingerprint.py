"""Each fingerprint part on its own: same input, same key; one change, a
different key, and the explanation names that part."""
import os
import re
import sys

import pytest
import torch

from torch_xla_patches import config, fingerprint, versions
from torch_xla_patches.signature import ArgKind, ArgLayout


def graph_of(fn):
  return torch.fx.symbolic_trace(fn)


def add(x, y):
  return x + y


def mul(x, y):
  return x * y


LAYOUT = ArgLayout(kinds=(ArgKind.DYNAMIC_TENSOR, ArgKind.DYNAMIC_TENSOR))


def test_same_graph_same_key():
  a = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  b = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  assert a.key == b.key
  assert a.differing_parts(b.as_dict()) == []


def test_graph_code_change_is_named():
  a = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  b = fingerprint.graph_fingerprint(graph_of(mul), LAYOUT)
  assert a.key != b.key
  assert b.differing_parts(a.as_dict()) == ['graph_code']


def test_input_metadata_change_is_named():
  a = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  other_layout = ArgLayout(kinds=(ArgKind.DYNAMIC_TENSOR, ArgKind.PARAMETER))
  b = fingerprint.graph_fingerprint(graph_of(add), other_layout)
  assert b.differing_parts(a.as_dict()) == ['input_metadata']


@pytest.mark.parametrize('name, value', [('XLA_FLAGS', '--xla_dump_to=/x'),
                                         ('XLA_USE_BF16', '1')])
def test_xla_flags_change_is_named(monkeypatch, name, value):
  a = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  monkeypatch.setenv(name, value)
  b = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  assert b.differing_parts(a.as_dict()) == ['xla_flags']


def test_debug_and_cache_variables_do_not_change_the_key(monkeypatch):
  a = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  monkeypatch.setenv('XLA_PATCHES_EXPLAIN_MISSES', '1')
  monkeypatch.setenv('XLA_PERSISTENT_CACHE_PATH', '/tmp/elsewhere')
  assert fingerprint.graph_fingerprint(graph_of(add), LAYOUT).key == a.key


@pytest.mark.parametrize(
    'flag', [f for f in config.FLAGS.values() if not f.changes_program],
    ids=lambda f: f.env_var)
def test_flags_that_cannot_change_programs_leave_the_key_alone(
    monkeypatch, flag):
  a = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  monkeypatch.setenv(flag.env_var, '7')
  assert fingerprint.graph_fingerprint(graph_of(add), LAYOUT).key == a.key


@pytest.mark.parametrize(
    'flag', [f for f in config.FLAGS.values() if f.changes_program],
    ids=lambda f: f.env_var)
def test_flags_that_can_change_programs_are_in_the_key(monkeypatch, flag):
  a = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  monkeypatch.setenv(flag.env_var, '0')
  b = fingerprint.graph_fingerprint(graph_of(add), LAYOUT)
  assert b.differing_parts(a.as_dict()) == ['xla_flags']


def test_every_variable_the_package_reads_is_a_declared_flag():
  """See [Note: Flags that change programs]: a new XLA_PATCHES_* variable
  must be declared in config.py, saying whether it changes programs."""
  package = os.path.dirname(config.__file__)
  used = set()
  for name in os.listdir(package):
    if name.endswith('.py'):
      with open(os.path.join(package, name)) as f:
        used.update(re.findall(r'\bXLA_PATCHES_[A-Z0-9_]*[A-Z0-9]', f.read()))
  assert used, 'the scan found nothing: is the pattern right?'
  undeclared = sorted(used - set(config.FLAGS))
  assert undeclared == [], (f'declare these in config.py with _flag(..., '
                            f'changes_program=...): {undeclared}')


def test_every_flag_is_a_config_attribute():
  for flag in config.FLAGS.values():
    assert hasattr(config, flag.attribute), flag


def test_versions_and_devices_are_parts():
  names = [p.name for p in fingerprint.graph_fingerprint(None, LAYOUT).parts]
  assert names == [
      'graph_code', 'input_metadata', 'torch_version', 'torch_xla_version',
      'python_version', 'device_kind', 'device_count', 'xla_flags', 'spmd'
  ]


def test_version_parts_are_the_runtime_versions(monkeypatch):
  # One reading for fingerprint, artifact and release check; see [Note:
  # Runtime versions].
  import platform
  import torch_xla
  monkeypatch.setattr(torch, '__version__', '2.9.0+test')
  monkeypatch.setattr(torch_xla, '__version__', '2.9.0+git0')
  monkeypatch.setattr(platform, 'python_version', lambda: '3.11.99')
  assert versions.runtime_versions() == versions.RuntimeVersions(
      torch='2.9.0+test', torch_xla='2.9.0+git0', python='3.11.99')
  parts = fingerprint.graph_fingerprint(None, LAYOUT).as_dict()
  assert (parts['torch_version'], parts['torch_xla_version'],
          parts['python_version']) == ('2.9.0+test', '2.9.0+git0', '3.11.99')


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))
