"""tools/run_upstream_tests.py: what CI's run of upstream's suite relies on,
checked on a stand-in checkout (no upstream test runs here)."""
import os
import sys

from bridge_testing import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, 'tools'))
import run_upstream_tests  # noqa: E402

# Exits 1 when CI is set, as torch's run_tests does without xmlrunner.
ENV_PROBE = '''\
import os, sys, unittest

class EnvTest(unittest.TestCase):

  def test_ci_unset(self):
    self.assertEqual(os.environ.get('CI'), None)

if __name__ == '__main__':
  if os.environ.get('CI'):
    raise ModuleNotFoundError("No module named 'xmlrunner'")
  unittest.main()
'''


def stand_in_checkout(tmp_path, source):
  dynamo = tmp_path / 'xla' / 'test' / 'dynamo'
  dynamo.mkdir(parents=True)
  (tmp_path / 'xla' / 'examples').mkdir()
  (dynamo / 'test_env.py').write_text(source)
  return str(tmp_path / 'xla')


def test_a_file_runs_without_ci_set(tmp_path, monkeypatch):
  monkeypatch.setenv('CI', 'true')
  xla_src = stand_in_checkout(tmp_path, ENV_PROBE)
  column = run_upstream_tests.Column('upstream', '', {})
  outcome = run_upstream_tests.run_file(xla_src, 'test_env.py', column,
                                        str(tmp_path), None, 120,
                                        str(tmp_path / 'logs'))
  assert outcome.passed, open(outcome.log).read()
  assert (outcome.ran, outcome.failures, outcome.errors) == (1, 0, 0)


def test_a_regression_prints_the_end_of_its_log(tmp_path, capsys):
  log = tmp_path / 'test_x.py.log'
  log.write_text(''.join(f'line {i}\n' for i in range(40)))
  failed = run_upstream_tests.Outcome(returncode=1,
                                      ran=None,
                                      failures=0,
                                      errors=0,
                                      skipped=0,
                                      seconds=1.0,
                                      log=str(log))
  passed = run_upstream_tests.Outcome(0, 3, 0, 0, 0, 1.0, '')
  assert run_upstream_tests.regressions_of(passed, failed, 'patched',
                                           'test_x.py') == [
                                               'test_x.py passes upstream, '
                                               'not in "patched" (exit 1)'
                                           ]
  run_upstream_tests.print_log_tail(failed, 'test_x.py "patched"', lines=3)
  assert capsys.readouterr().out == (
      f'--- test_x.py "patched": last 3 lines of {log}\n'
      '    line 37\n    line 38\n    line 39\n')
