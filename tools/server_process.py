"""The reference HTTP server (torch_xla_patches/server.py) in a subprocess,
an HTTP client for it, and its built-in model's eager tokens: what
tools/bench_generation.py and test/test_server.py both need."""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_SECONDS = 0.05
HTTP_TIMEOUT = 300.0
START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0


def request(port: int,
            method: str,
            path: str,
            body: Any = None,
            raw: Optional[bytes] = None,
            headers: Optional[Dict[str, str]] = None,
            timeout: float = HTTP_TIMEOUT) -> Tuple[int, Dict, Dict]:
  """(status, JSON payload, headers) of one request to 127.0.0.1:port;
  `raw` is sent as the body as it is, else `body` as JSON."""
  connection = http.client.HTTPConnection('127.0.0.1', port, timeout=timeout)
  try:
    data = raw if raw is not None else (
        None if body is None else json.dumps(body).encode())
    connection.request(method, path, body=data, headers=headers or {})
    response = connection.getresponse()
    payload = json.loads(response.read() or b'{}')
    return response.status, payload, dict(response.getheaders())
  finally:
    connection.close()


class ServerProcess:
  """`python -m torch_xla_patches.server --port 0 <server_args>` from the
  repository's root, its stdout and stderr in `<log_dir>/<name>.stdout` and
  `.stderr`; `host` and `port` once it printed them, `started` the monotonic
  time just before it was started.

  Args:
    server_args: the server's arguments after `--port 0`.
    log_dir: where its output goes.
    name: the output files' name.
    env: variables set for it, over this process's environment
      (PJRT_DEVICE is CPU unless set).
  """

  def __init__(self,
               server_args: Sequence[str],
               log_dir: str,
               name: str,
               env: Optional[Mapping[str, str]] = None):
    self.stdout_path = os.path.join(log_dir, f'{name}.stdout')
    self.stderr_path = os.path.join(log_dir, f'{name}.stderr')
    environment = dict(os.environ,
                       PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'))
    environment.update(env or {})
    environment['PYTHONPATH'] = os.pathsep.join(
        [REPO_ROOT, environment.get('PYTHONPATH', '')])
    self.started = time.monotonic()
    with open(self.stdout_path, 'w') as out, open(self.stderr_path, 'w') as err:
      self.process = subprocess.Popen(
          [sys.executable, '-m', 'torch_xla_patches.server', '--port', '0'] +
          list(server_args),
          stdout=out,
          stderr=err,
          env=environment,
          cwd=REPO_ROOT)
    self.host, self.port = self._read_address()

  def log(self) -> str:
    """The end of its stderr."""
    with open(self.stderr_path) as f:
      return f.read()[-4000:]

  def failed(self, what: str) -> RuntimeError:
    """An error saying `what`, with the end of its log."""
    return RuntimeError(f'{what}; the server\'s log ends:\n{self.log()}')

  def _read_address(self) -> Tuple[str, int]:
    deadline = self.started + START_TIMEOUT
    while time.monotonic() < deadline:
      with open(self.stdout_path) as f:
        found = re.search(r'^listening on http://([^:]+):(\d+)$', f.read(),
                          re.M)
      if found:
        return found.group(1), int(found.group(2))
      if self.process.poll() is not None:
        raise self.failed(f'the server exited with {self.process.returncode}')
      time.sleep(POLL_SECONDS)
    raise self.failed(f'no port printed in {START_TIMEOUT} s')

  def wait_for_ok(self,
                  path: str,
                  timeout: float,
                  other_status: Optional[int] = None) -> float:
    """Polls GET `path` until it answers 200, at most `timeout` seconds;
    the monotonic time then. With `other_status`, any other answer is an
    error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      status, payload, _ = request(self.port, 'GET', path)
      if status == 200:
        return time.monotonic()
      if other_status is not None and status != other_status:
        raise self.failed(f'{path} answered {status}: {payload}')
      if self.process.poll() is not None:
        raise self.failed(f'the server exited with {self.process.returncode}')
      time.sleep(POLL_SECONDS)
    raise self.failed(f'{path} not 200 within {timeout} s')

  def stop(self) -> int:
    """SIGTERM, then SIGKILL past STOP_TIMEOUT; the exit status."""
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      try:
        self.process.wait(STOP_TIMEOUT)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait(STOP_TIMEOUT)
    return self.process.returncode


def eager_tokens(prompts: Sequence[Sequence[int]],
                 new_tokens: int) -> List[List[int]]:
  """The built-in model's greedy tokens after each prompt, unpadded, with
  transformers' generate() on the CPU."""
  from torch_xla_patches import server
  model = server.builtin_model()
  tokens = []
  with torch.no_grad():
    for prompt in prompts:
      ids = torch.tensor([prompt])
      out = model.generate(ids,
                           attention_mask=torch.ones_like(ids),
                           max_new_tokens=new_tokens,
                           do_sample=False)
      tokens.append(out[0, len(prompt):].tolist())
  return tokens
