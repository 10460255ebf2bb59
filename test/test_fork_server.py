"""The fork server the tests' child processes come from: a forked child
answers as a fresh interpreter does (see [Note: Forked child processes] in
fork_server.py)."""
import os
import subprocess
import sys

import pytest

import fork_server
from bridge_testing import REPO_ROOT


def child_env(**variables):
  """A child's environment as run_python makes it, from the environment at
  the time of the call (which the tests before may have changed: torch sets
  inductor's cache directory there on a first compile)."""
  return {
      **os.environ, 'PJRT_DEVICE': 'CPU',
      'PYTHONPATH': REPO_ROOT,
      **variables
  }


# What a child can see of its process, printed as one line.
INTROSPECT = '''
import os, sys
print(sys.argv, sys.path[:3], os.getcwd(), __name__, '__file__' in globals(),
      os.environ.get('XLA_PATCHES_PROBE'), os.environ.get('PYTHONHASHSEED'),
      os.environ.get('PYTHONPATH'), sorted(sys.modules).count('torch_xla_patches'))
'''


def fresh(code, env, timeout=120):
  """`code` in a fresh interpreter, as run_python runs it without a fork
  server."""
  return subprocess.run([sys.executable, '-c', code],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=timeout)


def forked(code, env=None, timeout=120):
  env = child_env() if env is None else env
  proc = fork_server.run(code, env, timeout, child_env())
  assert proc is not None, 'the fork server did not take a forkable request'
  return proc


@pytest.mark.parametrize(
    'code',
    [
        INTROSPECT,
        # Exit statuses: SystemExit with a number, with text, and an error.
        'import sys; print("out"); sys.stderr.write("err\\n"); sys.exit(3)',
        'raise SystemExit("text goes to stderr")',
        'raise ValueError("boom")',
        # Threads that are not daemons finish, and atexit handlers run,
        # before the process exits; what they print is kept.
        '''
import atexit, threading, time
atexit.register(lambda: print('atexit ran', flush=True))
threading.Thread(target=lambda: (time.sleep(0.5), print('thread ran'))).start()
''',
        # Windows line ends come out as a text-mode pipe gives them.
        'import sys; sys.stdout.write("a\\r\\nb\\rc\\n")',
    ])
def test_a_forked_child_answers_as_a_fresh_interpreter(tmp_path, monkeypatch,
                                                       code):
  monkeypatch.chdir(tmp_path)
  env = child_env(XLA_PATCHES_PROBE='7')
  expected, got = fresh(code, env), forked(code, env)
  assert got.returncode == expected.returncode
  assert got.stdout == expected.stdout
  # A traceback names the server's frame that ran the code, above the code's
  # own, where a fresh interpreter names none; the rest is the same.
  assert got.stderr.splitlines()[-2:] == expected.stderr.splitlines()[-2:]


def test_pythonpath_is_the_requests():
  code = 'import sys, os; print(sys.path[:4], os.environ["PYTHONPATH"])'
  env = child_env(PYTHONPATH=os.pathsep.join(['/nowhere/a', '', 'rel', '']))
  assert forked(code, env).stdout == fresh(code, env).stdout


def test_consecutive_children_hash_strings_differently():
  # A first start and its restart are two processes with their own hash
  # seeds: nothing a restart test checks may depend on sharing one.
  code = 'print(hash("torch_xla_patches"))'
  hashes = [forked(code).stdout for _ in range(4)]
  assert hashes[0] != hashes[1] and hashes[1] != hashes[2]
  assert hashes[0] == hashes[2] and hashes[1] == hashes[3]


@pytest.mark.parametrize('name, value', [
    ('PYTEST_CURRENT_TEST', 'test_two (call)'),
    ('TORCHINDUCTOR_CACHE_DIR', '/tmp/inductor'),
    ('XLA_PATCHES_SERVE_WAIT', '0'),
    ('CPU_NUM_DEVICES', '4'),
    ('PYTHONPATH', '/elsewhere'),
])
def test_what_tests_change_in_the_environment_is_forked(name, value):
  # Variables the suite sets as it goes, or a test passes to its child: the
  # servers made for the first child fork for every later one.
  server_env = child_env(PYTEST_CURRENT_TEST='test_one (call)')
  server_env.pop('TORCHINDUCTOR_CACHE_DIR', None)
  assert fork_server.forks_as_fresh(server_env, {**server_env, name: value})
  assert not fork_server.forks_as_fresh(server_env, {
      **server_env, name: value,
      'XLA_COMPILATION_CACHE_SIZE': '2'
  })


def test_another_environment_is_not_forked():
  # XLA_COMPILATION_CACHE_SIZE is read by torch_xla's runtime, which the
  # server may have set up while importing it.
  env = child_env(XLA_COMPILATION_CACHE_SIZE='2')
  assert fork_server.run('print(1)', env, 60, child_env()) is None


def test_servers_started_for_a_child_of_its_own_environment_fork_others(
    monkeypatch):
  # Servers start with the usual environment, not with what the first
  # child's test set for it: one test's XLA_COMPILATION_CACHE_SIZE must not
  # keep every later child from forking.
  servers = []
  monkeypatch.setattr(fork_server, '_servers', servers)
  try:
    env = child_env(XLA_COMPILATION_CACHE_SIZE='2')
    assert fork_server.run('print(1)', env, 60, child_env()) is None
    assert len(servers) == 2
    assert forked('print(2)').stdout == '2\n'
  finally:
    for server in servers:
      server.close()


def test_a_child_past_its_timeout_is_stopped(tmp_path):
  marker = tmp_path / 'still_running'
  code = f'import time; time.sleep(3); open({str(marker)!r}, "w").close()'
  with pytest.raises(subprocess.TimeoutExpired):
    fork_server.run(code, child_env(), 1, child_env())
  # Well past the child's sleep: it was killed, not left running.
  assert forked('import time; time.sleep(4)').returncode == 0
  assert not marker.exists()


def test_children_of_every_test_are_forked():
  # pytest names the running test in the environment, which the child sees
  # as a fresh interpreter would: the servers made for one test fork for
  # the next.
  code = 'import os; print(os.environ["PYTEST_CURRENT_TEST"])'
  for test in ('test_one (call)', 'test_two (call)'):
    env = child_env(PYTEST_CURRENT_TEST=test)
    assert forked(code, env).stdout == test + '\n'
