"""apply() / revert() / is_applied() and the version and signature checks."""
import sys

import pytest
import torch
import torch._dynamo
import torch_xla
import torch_xla._dynamo.dynamo_bridge as upstream_bridge
import torch_xla.core.dynamo_bridge as core_bridge

import torch_xla_patches
from torch_xla_patches import _patching, config, dynamo_bridge, serialization, torch_internals, versions

UPSTREAM_EXTRACT = upstream_bridge.extract_compiled_graph


@pytest.fixture(autouse=True)
def always_revert():
  torch_xla_patches.revert()
  yield
  torch_xla_patches.revert()


def test_apply_replaces_both_bridge_modules():
  assert not torch_xla_patches.is_applied()
  torch_xla_patches.apply()
  assert torch_xla_patches.is_applied()
  assert upstream_bridge.extract_compiled_graph is dynamo_bridge.extract_compiled_graph
  assert core_bridge.extract_compiled_graph is dynamo_bridge.extract_compiled_graph


def test_apply_twice_then_revert_restores_the_true_original():
  torch_xla_patches.apply()
  torch_xla_patches.apply()
  assert torch_xla_patches.original(
      upstream_bridge, 'extract_compiled_graph') is UPSTREAM_EXTRACT
  torch_xla_patches.revert()
  torch_xla_patches.revert()
  assert not torch_xla_patches.is_applied()
  assert upstream_bridge.extract_compiled_graph is UPSTREAM_EXTRACT
  assert core_bridge.extract_compiled_graph is UPSTREAM_EXTRACT


def test_automatic_dynamic_shapes_turned_on_and_restored():
  # torch_xla turns it off at import (pytorch/xla#5285).
  assert torch._dynamo.config.automatic_dynamic_shapes is False
  torch_xla_patches.apply()
  assert torch._dynamo.config.automatic_dynamic_shapes is True
  torch_xla_patches.revert()
  assert torch._dynamo.config.automatic_dynamic_shapes is False


def test_automatic_dynamic_shapes_can_be_left_alone():
  torch_xla_patches.apply(automatic_dynamic_shapes=False)
  assert torch._dynamo.config.automatic_dynamic_shapes is False
  assert torch_xla_patches.is_applied()


def test_revert_restores_every_config_flag_apply_set(tmp_path):
  before = config.flag_values()
  torch_xla_patches.apply(automatic_dynamic_shapes=False,
                          cache_dir=tmp_path,
                          precompile_mode='interleaved')
  assert (config.automatic_dynamic_shapes, config.cache_dir,
          config.precompile_mode) == (False, str(tmp_path), 'interleaved')
  torch_xla_patches.revert()
  assert config.flag_values() == before


def test_the_switch_interval_is_set_by_apply_and_put_back_by_revert(
    monkeypatch):
  python_s = sys.getswitchinterval()
  monkeypatch.setattr(config, 'switch_interval', 0.0005)
  torch_xla_patches.apply()
  assert sys.getswitchinterval() == pytest.approx(0.0005)
  torch_xla_patches.revert()
  assert sys.getswitchinterval() == python_s
  monkeypatch.setattr(config, 'switch_interval', 0.0)
  torch_xla_patches.apply()
  assert sys.getswitchinterval() == python_s


def test_a_refused_apply_changes_nothing(monkeypatch, tmp_path):
  monkeypatch.setattr(torch_xla, '__version__', '2.7.0')
  before = config.flag_values()
  with pytest.raises(RuntimeError, match='found torch_xla 2.7.0'):
    torch_xla_patches.apply(cache_dir=tmp_path, precompile_mode='off')
  assert config.flag_values() == before
  assert not torch_xla_patches.is_applied()
  assert upstream_bridge.extract_compiled_graph is UPSTREAM_EXTRACT


def test_unsupported_torch_xla_version_names_expected_and_found(monkeypatch):
  monkeypatch.setattr(torch_xla, '__version__', '2.7.0')
  with pytest.raises(RuntimeError) as info:
    torch_xla_patches.apply()
  assert str(info.value) == (
      'torch_xla_patches supports torch 2.8.0 + torch_xla 2.8.0, '
      'torch 2.8.0 + torch_xla 2.8.1, torch 2.9.0 + torch_xla 2.9.0; '
      f'found torch_xla 2.7.0 (with torch {torch.__version__}).')
  assert not torch_xla_patches.is_applied()


def test_unsupported_torch_version(monkeypatch):
  monkeypatch.setattr(torch, '__version__', '2.10.0+cpu')
  with pytest.raises(RuntimeError, match=r"found torch 2\.10\.0\+cpu"):
    torch_xla_patches.apply()


def test_serializable_backend_registered_only_with_torch_aot_compile():
  from torch._dynamo.backends import registry
  torch_xla_patches.apply()
  assert (serialization.BACKEND_NAME
          in registry._COMPILER_FNS) == (versions.has_torch_aot_compile())
  torch_xla_patches.revert()
  assert serialization.BACKEND_NAME not in registry._COMPILER_FNS


def test_openxla_keeps_inference_updates_in_the_graph_until_revert(monkeypatch):
  original = torch._dynamo.lookup_backend('openxla')
  torch_xla_patches.apply()
  backend = torch._dynamo.lookup_backend('openxla')
  assert isinstance(backend, torch_internals.InferenceUpdatesInGraph)
  assert backend.openxla is original
  torch_xla_patches.revert()
  assert torch._dynamo.lookup_backend('openxla') is original
  # XLA_PATCHES_DONATE=0: torch's backend as it is.
  monkeypatch.setattr(config, 'donate_inplace_updates', False)
  torch_xla_patches.apply()
  assert torch._dynamo.lookup_backend('openxla') is original


def test_changed_bridge_signature_is_refused(monkeypatch):

  def extract_compiled_graph(xla_model, xla_args, options):
    pass

  monkeypatch.setattr(core_bridge, 'extract_compiled_graph',
                      extract_compiled_graph)
  with pytest.raises(RuntimeError) as info:
    torch_xla_patches.apply()
  assert "expected parameters ('xla_model', 'xla_args'), found " in str(
      info.value)
  assert "('xla_model', 'xla_args', 'options')" in str(info.value)
  assert not torch_xla_patches.is_applied()


def test_registry_restores_missing_attribute_by_deleting_it():

  class Holder:
    pass

  registry = _patching.PatchRegistry()
  registry.set(Holder, 'added', 1)
  registry.set(Holder, 'added', 2)
  assert Holder.added == 2
  registry.revert_all()
  assert not hasattr(Holder, 'added')
  assert len(registry) == 0


def test_registry_restores_each_original_once():

  class Holder:
    first = 'a'

  registry = _patching.PatchRegistry()
  registry.set(Holder, 'first', 'b')
  registry.set(Holder, 'second', 'c')
  registry.set(Holder, 'first', 'd')
  assert registry.original(Holder, 'first') == 'a'
  registry.revert_all()
  assert Holder.first == 'a'
  assert not hasattr(Holder, 'second')
  assert len(registry) == 0
  registry.revert_all()  # nothing left to restore
  assert Holder.first == 'a'


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))
