"""tools/make_upstream_patch.py: the rendered pull request applies to the
installed torch_xla 2.9.0 files, and the repo's behaviour tests pass with the
rendered bridge loaded in place of torch_xla's (test/upstream_mode.py), with
no torch_xla_patches.apply().

The behaviour run covers test_dynamo_bridge.py, test_training.py,
test_properties.py (HYPOTHESIS_PROFILE=ci), test_eviction.py and
test_memory.py, about a minute on 2 cores. Left out:
  * test_dynamo_bridge.py::test_default_mode_goes_dynamic_on_second_shape
    checks apply()'s switch of dynamo's automatic dynamic shapes, which is
    not part of the bridge, so it cannot hold with apply() a no-op;
  * test_signature_index.py passes cache_dir to apply() (a no-op here);
  * test_spmd.py passes on the rendered bridge too, but costs another 15 s;
  * test_patching.py, test_decompositions.py, test_gpt2_dynamic.py and the
    module survey test apply() itself or the decompositions, not the bridge.
"""
import ast
import os
import shutil
import subprocess
import sys

import pytest

from bridge_testing import REPO_ROOT
import upstream_mode

sys.path.insert(0, os.path.join(REPO_ROOT, 'tools'))
import make_upstream_patch  # noqa: E402

BEHAVIOUR_TESTS = (
    'test/test_dynamo_bridge.py',
    'test/test_training.py',
    'test/test_properties.py',
    'test/test_eviction.py',
    'test/test_memory.py',
)
DESELECTED = (
    'test/test_dynamo_bridge.py::test_default_mode_goes_dynamic_on_second_shape',
)

pytestmark = [
    pytest.mark.skipif(bool(os.environ.get(upstream_mode.MODE_ENV)),
                       reason='already running in an upstream_mode subprocess'),
    pytest.mark.requires('torch_xla_2.9.0'),
]


@pytest.fixture(scope='module')
def rendered(tmp_path_factory):
  out = tmp_path_factory.mktemp('upstream')
  result = make_upstream_patch.render(str(out))
  return out, result


def _child_env(mode, tmp_path, rendered_dir=None):
  hook_dir = str(tmp_path / 'hook')
  upstream_mode.write_sitecustomize(hook_dir)
  env = upstream_mode.subprocess_env(mode, hook_dir, rendered_dir)
  env['HYPOTHESIS_PROFILE'] = 'ci'
  # test_memory's upstream comparison would measure the rendered bridge.
  env.pop('XLA_PATCHES_COMPARE_UPSTREAM', None)
  return env


def test_main_prints_names_and_diff_size(tmp_path, capsys):
  assert make_upstream_patch.main(['--out', str(tmp_path)]) == 0
  out = capsys.readouterr().out
  for section in ('replaced (', 'added (', 'removed (', 'kept from upstream (',
                  'conflicts with upstream callers ('):
    assert section in out
  assert 'torch_xla/_dynamo/dynamo_bridge.py: +' in out
  assert 'insertions(+)' in out and 'deletions(-)' in out


def test_names_replaced_removed_and_kept(rendered):
  out, result = rendered
  assert {
      'extract_graph_helper', 'extract_internal', 'extract_compiled_graph',
      'extract_compiled_graph_helper', 'partition_fx_graph_for_cpu_fallback'
  } <= set(result.replaced + result.unchanged)
  # GraphInputMatcher moved to tracing.py with input matching; the bridge
  # imports it, so upstream's callers still find it there.
  assert 'GraphInputMatcher' not in result.removed
  assert set(make_upstream_patch.REMOVED) <= set(result.removed)
  # Upstream's tests and torch_xla/stablehlo.py still import these.
  assert {'NoneRemover', 'get_fallback_ops',
          'XLAConstructorMoverPass'} <= set(result.kept)
  # The conflicts CONTRIBUTING names: three changed signatures, which nothing
  # upstream calls, and every removed definition.
  changed = {c.split('(')[0] for c in result.conflicts if ' -> ' in c}
  removed = {
      c[:-len(' is removed')]
      for c in result.conflicts
      if c.endswith(' is removed')
  }
  # The new parameters of UnsupportedNodesCollector and
  # extract_compiled_graph_helper have defaults: upstream's calls still hold.
  assert changed == {
      'extract_graph_helper', 'partition_fx_graph_for_cpu_fallback',
      'UnsupportedNodesCollector', 'extract_compiled_graph_helper'
  }
  assert removed == {
      '_get_input_arg_device', '_split_xla_args_tensor_sym_constant', 'Deduper',
      'SpecialReturnHandler', 'is_xla_tensor', '_clear_pending_irs_on_args'
  }
  assert len(result.conflicts) == len(changed) + len(removed)
  # The release checks stay out of the pull request; see [Note: Runtime
  # versions].
  assert not {'versions', 'torch_internals'} & set(result.companions)

  bridge = ast.parse((out / 'dynamo_bridge.py').read_text())
  top_level = {
      node.name
      for node in bridge.body
      if isinstance(node, (ast.ClassDef, ast.FunctionDef))
  }
  assert {'NoneRemover', 'XLAConstructorMoverPass'} <= top_level
  assert not {'Deduper', 'SpecialReturnHandler'} & top_level
  # The bridge's other jobs are companion modules (see test_layering.py).
  assert {
      'counters', 'execution', 'donation', 'tracing', 'program_run',
      'compile_window', 'signature_cache', 'bound_program'
  } <= set(result.companions)
  tracing = ast.parse((out / 'tracing.py').read_text())
  assert {'GraphInputMatcher', 'OutputPlan', 'CompiledGraphEntry'} <= {
      node.name for node in tracing.body if isinstance(node, ast.ClassDef)
  }
  # signature.py is a module of its own: the index modules import it too.
  signature = ast.parse((out / 'signature.py').read_text())
  assert 'ArgLayout' in {
      node.name for node in signature.body if isinstance(node, ast.ClassDef)
  }
  config = ast.parse((out / 'config.py').read_text())
  assigned = set()
  for node in config.body:
    if isinstance(node, ast.Assign):
      assigned.update(t.id for t in node.targets if isinstance(t, ast.Name))
    elif isinstance(node, ast.AnnAssign):
      assigned.add(node.target.id)
  assert set(result.config_flags + ['skip_input_data_check']) <= assigned
  for path in out.glob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        assert not (node.module or '').startswith('torch_xla_patches'), path


def test_patch_applies_to_the_installed_files(rendered, tmp_path):
  out, result = rendered
  tree = tmp_path / 'xla'
  for name in ('dynamo_bridge.py', 'config.py'):
    target = tree / 'torch_xla' / '_dynamo' / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(make_upstream_patch.installed_upstream_file(name), target)
  subprocess.run(['git', 'apply', str(out / 'upstream.patch')],
                 cwd=tree,
                 check=True)
  assert {'torch_xla/_dynamo/dynamo_bridge.py',
          'torch_xla/_dynamo/config.py'} <= set(result.diff_sizes)
  for repo_path in result.diff_sizes:
    rendered_file = out / os.path.basename(repo_path)
    assert (tree / repo_path).read_text() == rendered_file.read_text()


def test_refuses_another_torch_xla_version(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(make_upstream_patch, 'installed_torch_xla_version',
                      lambda: '2.8.0')
  assert make_upstream_patch.main(['--out', str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert 'torch_xla 2.9.0' in err and 'installed torch_xla is 2.8.0' in err
  assert not list(tmp_path.iterdir())


def test_refuses_when_an_expected_upstream_name_is_gone(monkeypatch, tmp_path,
                                                        capsys):
  real = make_upstream_patch.installed_upstream_file
  changed = tmp_path / 'dynamo_bridge.py'
  changed.write_text(
      open(real('dynamo_bridge.py')).read().replace('class NoneRemover:',
                                                    'class NoneDropper:'))
  monkeypatch.setattr(
      make_upstream_patch, 'installed_upstream_file', lambda name: str(changed)
      if name == 'dynamo_bridge.py' else real(name))
  assert make_upstream_patch.main(['--out', str(tmp_path / 'out')]) == 2
  err = capsys.readouterr().err
  assert 'are gone: NoneRemover' in err


def test_refuses_a_bridge_out_of_upstream_order(tmp_path, capsys):
  source = open(make_upstream_patch.BRIDGE_PATH).read()
  tree = ast.parse(source)
  node = next(n for n in tree.body
              if getattr(n, 'name', '') == 'extract_compiled_graph')
  lines = source.split('\n')
  moved = '\n'.join(lines[node.lineno - 1:node.end_lineno])
  del lines[node.lineno - 1:node.end_lineno]
  bridge = tmp_path / 'torch_xla_patches' / 'dynamo_bridge.py'
  shutil.copytree(os.path.dirname(make_upstream_patch.BRIDGE_PATH),
                  bridge.parent)
  bridge.write_text('\n'.join(lines) + '\n\n' + moved + '\n')
  assert make_upstream_patch.main(
      ['--out', str(tmp_path / 'out'), '--bridge',
       str(bridge)]) == 2
  err = capsys.readouterr().err
  assert ('defines extract_compiled_graph after '
          'extract_compiled_graph_helper') in err


def test_rendered_bridge_is_the_one_torch_xla_runs(rendered, tmp_path):
  out, _ = rendered
  check = (
      'import torch_xla, torch_xla.core.dynamo_bridge as core\n'
      'import torch_xla._dynamo.dynamo_bridge as bridge\n'
      'import torch_xla_patches\n'
      'from torch_xla_patches import dynamo_bridge\n'
      'assert bridge.__file__.startswith(%r), bridge.__file__\n'
      'assert core.extract_compiled_graph is bridge.extract_compiled_graph\n'
      'assert dynamo_bridge is bridge\n'
      'assert not hasattr(core, "Deduper") and hasattr(core, "NoneRemover")\n'
      'print("rendered bridge active")\n') % str(out)
  proc = subprocess.run([sys.executable, '-c', check],
                        env=_child_env('rendered', tmp_path, str(out)),
                        capture_output=True,
                        text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'rendered bridge active' in proc.stdout


def test_behaviour_tests_pass_on_the_rendered_bridge(rendered, tmp_path):
  out, _ = rendered
  command = [
      sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-o',
      'log_level=WARNING', *BEHAVIOUR_TESTS
  ]
  for test_id in DESELECTED:
    command += ['--deselect', test_id]
  proc = subprocess.run(command,
                        cwd=REPO_ROOT,
                        env=_child_env('rendered', tmp_path, str(out)),
                        capture_output=True,
                        text=True,
                        timeout=900)
  summary = proc.stdout[-4000:]
  assert proc.returncode == 0, summary + proc.stderr[-2000:]
  assert ' passed' in summary and 'failed' not in summary


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))
