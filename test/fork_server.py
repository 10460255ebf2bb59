"""Child processes for the tests, forked from interpreters that have
already imported torch and torch_xla.

[Note: Forked child processes]
Restart tests run Python in a fresh process, and each such process spends
most of its life importing torch and torch_xla before the few seconds it is
there for (figures in CONTRIBUTING.md). A fork server imports them once and
forks a child per request, which then runs the request's code as `python
-c` would, as the process's `__main__`, and exits as its interpreter would
(threads that are not daemons joined, atexit handlers run, streams
flushed), except that it skips the teardown of its modules, which costs
seconds of CPU once torch is imported and shows a test nothing.

What makes a forked child a fresh process for the tests:
  * The server imports torch and torch_xla and nothing else (not this
    package, whose import reads its flags): no XLA client, no dynamo
    state, no thread but torch's own.
  * A request whose environment differs from the server's in a variable
    that an import may have read is run in a fresh interpreter instead;
    only FORKABLE_ENV variables, read after the imports, may differ, and
    the child sets them before it runs anything.
  * Each pytest process keeps two servers, each with its own hash seed, and
    forks from them in turn: consecutive children (a first start and its
    restart) differ in string hashes and memory layout as two fresh
    processes do, so what a restart test checks (nothing an artifact keeps
    depends on the process that wrote it) is still checked.
  * The working directory is the request's, and sys.path starts with ''
    and the request's PYTHONPATH as for `python -c`. The server imports
    torch and torch_xla without PYTHONPATH, from the environment's
    site-packages, so a request's PYTHONPATH must not shadow them.
Only the server's main thread forks, and it runs no thread of its own: it
reaps its children with waitpid between polls of its socket.
"""
import atexit
import itertools
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Dict, List, Optional

# Variables a request may set differently from the server's environment:
# nothing reads them while torch and torch_xla are imported (this package's
# flags; the CPU client's device count, read when the client is made;
# PYTHONPATH, which the child applies to sys.path itself; the test pytest is
# running, which it sets per test; inductor's cache directory, which torch
# sets in the environment the first time a compile asks for it). Any other
# variable, XLA_COMPILATION_CACHE_SIZE among them (torch_xla's runtime may
# read it on import), must equal the server's.
FORKABLE_ENV_PREFIXES = ('XLA_PATCHES_',)
FORKABLE_ENV = ('CPU_NUM_DEVICES', 'HYPOTHESIS_PROFILE', 'PYTHONPATH',
                'PYTEST_CURRENT_TEST', 'TORCHINDUCTOR_CACHE_DIR')

_POLL_SECONDS = 0.05


def _forkable(name: str) -> bool:
  return name in FORKABLE_ENV or name.startswith(FORKABLE_ENV_PREFIXES)


def forks_as_fresh(server_env: Dict[str, str], env: Dict[str, str]) -> bool:
  """Whether a child with `env`, forked from a server started with
  `server_env`, is the process a fresh interpreter with `env` would be."""
  names = set(env) | set(server_env)
  return all(env.get(n) == server_env.get(n) or _forkable(n) for n in names)


def _receive(connection: socket.socket) -> tuple:
  """One request: (its JSON, the child's stdout and stderr descriptors)."""
  data = b''
  fds: List[int] = []
  while not data.endswith(b'\n'):
    chunk, received, _, _ = socket.recv_fds(connection, 1 << 20, 2)
    if not chunk:
      raise ConnectionError('the client left before its request was whole')
    data += chunk
    fds.extend(received)
  return json.loads(data), fds


def _run_child(request: dict, stdout: int, stderr: int) -> None:
  """Becomes the request's `python -c` process; returns to run its code."""
  os.setpgrp()
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.dup2(stdout, 1)
  os.dup2(stderr, 2)
  for fd in (devnull, stdout, stderr):
    os.close(fd)
  for name in [n for n in os.environ if _forkable(n)]:
    del os.environ[name]
  # The server's own seed (see ForkServer), which `python -c` would not see.
  os.environ.pop('PYTHONHASHSEED', None)
  os.environ.update(request['env'])
  os.chdir(request['cwd'])
  # `python -c`'s '' and PYTHONPATH in front, as its interpreter makes them
  # (relative to the working directory, an empty entry for it, a trailing
  # separator ignored), in place of the script directory of the server,
  # which runs without PYTHONPATH.
  front = request['env'].get('PYTHONPATH', '').split(os.pathsep)
  if not front[-1]:
    front.pop()
  sys.path[:] = [''] + [os.path.abspath(p) for p in front] + sys.path[1:]
  sys.argv = ['-c']


def serve(path: str) -> dict:
  """Forks a child per request on the socket at `path`; returns in a child,
  with its request, and never in the server."""
  import torch  # pylint: disable=unused-import
  import torch_xla  # pylint: disable=unused-import
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(8)
  print('ready', flush=True)
  waiting: Dict[int, socket.socket] = {}
  selector = selectors.DefaultSelector()
  selector.register(listener, selectors.EVENT_READ)
  client = os.getppid()
  while True:
    if os.getppid() != client:
      # The pytest process is gone without closing the server.
      sys.exit(0)
    for _ in selector.select(_POLL_SECONDS):
      connection, _ = listener.accept()
      try:
        request, fds = _receive(connection)
      except (ConnectionError, ValueError):
        connection.close()
        continue
      pid = os.fork()
      if pid == 0:
        selector.close()
        listener.close()
        for other in waiting.values():
          other.close()
        connection.close()
        _run_child(request, *fds)
        return request
      for fd in fds:
        os.close(fd)
      connection.sendall(json.dumps({'pid': pid}).encode() + b'\n')
      waiting[pid] = connection
    while waiting:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if pid == 0:
        break
      connection = waiting.pop(pid, None)
      if connection is None:
        continue
      code = (-os.WTERMSIG(status)
              if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
      try:
        connection.sendall(json.dumps({'returncode': code}).encode() + b'\n')
      except OSError:
        pass
      connection.close()


def _text(outputs: Dict[str, bytes], name: str) -> str:
  """What subprocess.run(text=True) makes of a stream's bytes."""
  text = outputs.get(name, b'').decode(errors='replace')
  return text.replace('\r\n', '\n').replace('\r', '\n')


class ForkServer:
  """A server process (see [Note: Forked child processes]) and the client's
  end: run() is subprocess.run of `python -c code` with captured text."""

  def __init__(self, env: Dict[str, str]):
    self.env = dict(env)
    self._dir = tempfile.mkdtemp(prefix='fork_server_')
    self._socket = os.path.join(self._dir, 'socket')
    server_env = dict(env, PYTHONHASHSEED=str(random.randrange(1, 2**32)))
    self._process = subprocess.Popen(
        [sys.executable,
         os.path.abspath(__file__), self._socket],
        env=server_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True)
    self._ready = False
    self._ready_lock = threading.Lock()

  def forkable(self, env: Dict[str, str]) -> bool:
    """Whether a child with `env` is a fresh process when forked here."""
    return forks_as_fresh(self.env, env)

  def _wait_ready(self) -> bool:
    with self._ready_lock:
      if not self._ready and self._process.poll() is None:
        self._ready = self._process.stdout.readline().strip() == 'ready'
      return self._ready

  def run(self, code: str, env: Dict[str, str],
          timeout: float) -> Optional[subprocess.CompletedProcess]:
    """`python -c code` forked with `env`; None if the server is gone."""
    if not self._wait_ready():
      return None
    stdout_read, stdout_write = os.pipe()
    stderr_read, stderr_write = os.pipe()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      client.connect(self._socket)
      request = {
          'code': code,
          'env': {
              n: v for n, v in env.items() if _forkable(n)
          },
          'cwd': os.getcwd(),
      }
      socket.send_fds(client, [json.dumps(request).encode() + b'\n'],
                      [stdout_write, stderr_write])
    except OSError:
      client.close()
      for fd in (stdout_read, stdout_write, stderr_read, stderr_write):
        os.close(fd)
      return None
    os.close(stdout_write)
    os.close(stderr_write)
    outputs = {}

    def read(name, fd):
      with os.fdopen(fd, 'rb') as stream:
        outputs[name] = stream.read()

    readers = [
        threading.Thread(target=read, args=(name, fd), daemon=True)
        for name, fd in (('stdout', stdout_read), ('stderr', stderr_read))
    ]
    for reader in readers:
      reader.start()
    with client, client.makefile('rb') as replies:
      first = replies.readline()
      if not first:
        return None  # The server is gone and forked nothing.
      pid = json.loads(first)['pid']
      deadline = time.monotonic() + timeout
      client.settimeout(timeout)
      try:
        line = replies.readline()
      except socket.timeout:
        line = b''
      if not line:
        try:
          os.killpg(pid, signal.SIGKILL)
        except OSError:
          pass
        if time.monotonic() < deadline:
          return None  # The server is gone; its child is stopped.
        raise subprocess.TimeoutExpired([sys.executable, '-c', code], timeout)
      returncode = json.loads(line)['returncode']
    for reader in readers:
      reader.join(max(0.0, deadline - time.monotonic()) + 10)
    return subprocess.CompletedProcess([sys.executable, '-c', code], returncode,
                                       _text(outputs, 'stdout'),
                                       _text(outputs, 'stderr'))

  def close(self) -> None:
    self._process.kill()
    self._process.wait()
    try:
      os.unlink(self._socket)
      os.rmdir(self._dir)
    except OSError:
      pass


_servers: List[ForkServer] = []
_turn = itertools.count()
_servers_lock = threading.Lock()


def _close_servers() -> None:
  for server in _servers:
    server.close()


def run(code: str, env: Dict[str, str], timeout: float,
        usual_env: Dict[str, str]) -> Optional[subprocess.CompletedProcess]:
  """`python -c code` with `env`, forked from one of this process's two
  servers in turn; None where it must run in a fresh interpreter (another
  environment, a server that did not start, TEST_FORK_SERVER=0).
  `usual_env` is a child's environment without what the caller set for
  this one: the servers start with it, so that the environment of one
  test's child (XLA_COMPILATION_CACHE_SIZE, say) does not keep every later
  child from forking."""
  if os.environ.get('TEST_FORK_SERVER', '1') == '0':
    return None
  with _servers_lock:
    if not _servers:
      base = {n: v for n, v in usual_env.items() if not _forkable(n)}
      _servers.extend(ForkServer(base) for _ in range(2))
      atexit.register(_close_servers)
    server = _servers[next(_turn) % len(_servers)]
  if not server.forkable(env):
    return None
  return server.run(code, env, timeout)


def _exit_status(error: SystemExit) -> int:
  """The status Python exits with for an uncaught SystemExit."""
  if error.code is None:
    return 0
  if isinstance(error.code, int):
    return error.code
  print(error.code, file=sys.stderr)
  return 1


def _run_request(request: dict) -> None:
  """Runs the request's code as `python -c` runs it, and exits as its
  interpreter would, short of tearing down its modules (see [Note: Forked
  child processes])."""
  main = types.ModuleType('__main__')
  main.__builtins__ = __builtins__
  sys.modules['__main__'] = main
  status = 0
  try:
    exec(compile(request['code'], '<string>', 'exec'), main.__dict__)  # pylint: disable=exec-used
  except SystemExit as e:
    status = _exit_status(e)
  except BaseException:  # pylint: disable=broad-except
    sys.excepthook(*sys.exc_info())
    status = 1
  # What the interpreter's shutdown does first: wait for the threads that
  # are not daemons, then run the atexit handlers, then flush.
  threading._shutdown()  # pylint: disable=protected-access
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(status)


if __name__ == '__main__':
  _run_request(serve(sys.argv[1]))
