"""versions.py: the versions of this process, the supported (torch,
torch_xla) pairs, and the save/load refusal on releases without torch's
aot_compile."""
import os
import platform
import re
import sys

import pytest
import torch
import torch_xla

import torch_xla_patches
from torch_xla_patches import serialization, versions

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _found(torch_version, torch_xla_version):
  return versions.RuntimeVersions(torch=torch_version,
                                  torch_xla=torch_xla_version,
                                  python='3.11.0')


def test_runtime_versions_are_what_the_modules_report():
  found = versions.runtime_versions()
  assert found == versions.RuntimeVersions(torch=torch.__version__,
                                           torch_xla=torch_xla.__version__,
                                           python=platform.python_version())
  assert versions.release_of(found) == versions.ReleasePair(
      torch=torch.__version__.split('+')[0],
      torch_xla=torch_xla.__version__.split('+')[0])
  assert versions.installed() == versions.release_of(found)


def test_release_drops_local_tags_only():
  assert versions.release_of(_found('2.9.0+cu128',
                                    '2.9.0+git1a2b')) == (versions.ReleasePair(
                                        torch='2.9.0', torch_xla='2.9.0'))


@pytest.mark.parametrize('pair',
                         versions.SUPPORTED_PAIRS,
                         ids=lambda pair: pair.describe())
def test_every_supported_pair_is_accepted_with_local_tags(pair):
  versions.check_supported(_found(pair.torch + '+cu128', pair.torch_xla))
  versions.check_supported(
      _found(pair.torch + '+cpu', pair.torch_xla + '+git1a2b'))


def test_installed_pair_is_supported():
  assert versions.installed() in versions.SUPPORTED_PAIRS
  versions.check_supported()


def test_check_reads_the_installed_versions(monkeypatch):
  monkeypatch.setattr(torch_xla, '__version__', '2.7.0')
  with pytest.raises(RuntimeError) as info:
    versions.check_supported()
  assert str(info.value).endswith(
      f'found torch_xla 2.7.0 (with torch {torch.__version__}).')


def test_releases_of_different_pairs_are_refused():
  with pytest.raises(RuntimeError) as info:
    versions.check_supported(_found('2.9.0+cu128', '2.8.1'))
  assert str(info.value).endswith(
      'found torch 2.9.0+cu128 with torch_xla 2.8.1, which needs torch 2.8.0.')
  with pytest.raises(RuntimeError) as info:
    versions.check_supported(_found('2.8.0', '2.9.0'))
  assert str(info.value).endswith(
      'found torch 2.8.0 with torch_xla 2.9.0, which needs torch 2.9.0.')


def test_makefile_installs_exactly_the_supported_pairs():
  with open(os.path.join(REPO_ROOT, 'Makefile')) as f:
    makefile = f.read()
  table = re.findall(r'^TORCH_FOR_(\S+)\s*:=\s*(\S+)\s*$', makefile,
                     re.MULTILINE)
  assert table, 'no TORCH_FOR_* lines in the Makefile'
  pairs = [
      versions.ReleasePair(torch=torch_version, torch_xla=torch_xla_version)
      for torch_xla_version, torch_version in table
  ]
  assert sorted(pairs, key=repr) == sorted(versions.SUPPORTED_PAIRS, key=repr)
  # Every supported torch has its torchvision named.
  assert set(versions.TORCHVISION_FOR_TORCH) == {
      pair.torch for pair in versions.SUPPORTED_PAIRS
  }


def test_aot_compile_feature_test_matches_torch():
  try:
    import torch._dynamo.aot_compile  # noqa: F401
    importable = True
  except ImportError:
    importable = False
  assert versions.has_torch_aot_compile() == importable


@pytest.mark.parametrize('torch_xla_version,raises', [('2.8.0', False),
                                                      ('2.8.1', False),
                                                      ('2.9.0', True),
                                                      ('2.9.0+git', True)])
def test_xla_errors_are_exceptions_from_2_9(monkeypatch, torch_xla_version,
                                            raises):
  monkeypatch.setattr(
      versions, 'installed', lambda: versions.ReleasePair(
          torch='2.9.0', torch_xla=versions.base_version(torch_xla_version)))
  assert versions.xla_errors_are_exceptions() == raises


def _assert_needs_torch_2_9(what, call):
  with pytest.raises(RuntimeError) as info:
    call()
  assert str(info.value) == (
      f'torch_xla_patches: {what} needs torch 2.9.0 or later '
      f'(torch._dynamo.aot_compile); found torch {torch.__version__}. '
      f'The rest of the patch works on torch {torch.__version__}.')


def _refusals():
  model = torch.nn.Linear(2, 2)
  return (
      ('torch_xla_patches.serialization.aot_compile',
       lambda: serialization.aot_compile(model, (torch.ones(2, 2),))),
      ('torch_xla_patches.save',
       lambda: torch_xla_patches.save(model, '/nonexistent/m.xla_aot',
                                      (torch.ones(2, 2),))),
      ('torch_xla_patches.load',
       lambda: torch_xla_patches.load('/nonexistent/m.xla_aot', model=model)),
  )


def test_save_and_load_name_the_torch_they_need(monkeypatch):
  # Works on every release: pretend torch has no aot_compile.
  monkeypatch.setattr(versions, 'has_torch_aot_compile', lambda: False)
  for what, call in _refusals():
    _assert_needs_torch_2_9(what, call)


@pytest.mark.requires('no_torch_aot_compile')
def test_save_and_load_refuse_on_this_release():
  torch_xla_patches.apply()
  try:
    for what, call in _refusals():
      _assert_needs_torch_2_9(what, call)
  finally:
    torch_xla_patches.revert()


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))
