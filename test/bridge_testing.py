"""Helpers shared by the bridge tests."""
import json
import os
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List

import torch
import torch._dynamo
import torch_xla
import torch_xla.debug.metrics as met

import fork_server
from torch_xla_patches import backlog
from torch_xla_patches import counters as bridge_counters

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BRIDGE_COUNTERS = (
    'DynamoExtractCompiledGraph',
    bridge_counters.COUNTER_HIT,
    bridge_counters.COUNTER_MISS,
    bridge_counters.COUNTER_EVICTED_RETRACE,
    bridge_counters.COUNTER_DROPPED,
    bridge_counters.COUNTER_CPU_FALLBACK_PARTITION,
    backlog.COUNTER_PRECOMPILED,
    backlog.COUNTER_PRECOMPILE_SKIPPED,
    'UncachedCompile',
)


def counters() -> Dict[str, int]:
  """The bridge's counters, 0 when never bumped."""
  return {name: met.counter_value(name) or 0 for name in BRIDGE_COUNTERS}


def fresh():
  """Forget compiled frames and zero all metrics."""
  torch._dynamo.reset()
  met.clear_all()


class FrameCounter:
  """A backend wrapper that counts how often dynamo compiles a frame."""

  def __init__(self, backend='openxla'):
    self.frames = 0
    self._backend = torch._dynamo.lookup_backend(backend)

  def __call__(self, gm, example_inputs):
    self.frames += 1
    return self._backend(gm, example_inputs)


def xla(t: torch.Tensor) -> torch.Tensor:
  return t.detach().clone().to(torch_xla.device())


def serve_fresh(fn, sizes, w=None, backend='openxla'):
  """A fresh dynamo trace of fn(x, w), x of shape (n, 8), served for each n
  in `sizes`; each result is checked against eager CPU. Returns the
  compiled function."""
  torch._dynamo.reset()
  compiled = torch.compile(fn, backend=backend, dynamic=True)
  serve_sizes(compiled, fn, sizes, torch.randn(8, 4) if w is None else w)
  return compiled


def serve_sizes(compiled, fn, sizes, w):
  """compiled(x, w), x of shape (n, 8), for each n in `sizes`, each result
  checked against fn on the CPU."""
  for n in sizes:
    x = torch.randn(n, 8)
    torch.testing.assert_close(compiled(xla(x), xla(w)).cpu(),
                               fn(x, w),
                               rtol=1e-4,
                               atol=1e-4)


def cpu_and_xla(make: Callable[[], torch.nn.Module]):
  """(CPU model, XLA model), both made by `make`, with equal weights."""
  torch.manual_seed(0)
  cpu = make()
  model = make()
  model.load_state_dict(cpu.state_dict())
  return cpu, model.to(torch_xla.device())


def run_python(code: str, env: Dict[str, str] = None, timeout: int = 600):
  """Runs `code` in a fresh process, forked from a fork server where its
  environment allows (see [Note: Forked child processes] in
  fork_server.py), else in a fresh interpreter; returns the
  CompletedProcess."""
  usual_env = dict(os.environ)
  usual_env.setdefault('PJRT_DEVICE', 'CPU')
  usual_env['PYTHONPATH'] = os.pathsep.join(
      [REPO_ROOT, usual_env.get('PYTHONPATH', '')])
  full_env = dict(usual_env, **(env or {}))
  forked = fork_server.run(code, full_env, timeout, usual_env)
  if forked is not None:
    return forked
  return subprocess.run([sys.executable, '-c', code],
                        env=full_env,
                        capture_output=True,
                        text=True,
                        timeout=timeout)


def run_reports(code: str, processes: int = 2) -> List[Any]:
  """Runs `code` in `processes` fresh interpreters, one after another (a
  first start, then restarts); each must succeed and print a JSON report as
  its last line. Returns the reports."""
  reports = []
  for _ in range(processes):
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  return reports


def run_counters(code: str, env: Dict[str, str] = None) -> Dict[str, int]:
  """Runs `code` in a fresh interpreter; it must succeed and print one
  `name value` line per counter it reports."""
  proc = run_python(code, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return {
      name: int(value)
      for name, value in (line.split() for line in proc.stdout.splitlines())
  }


def errors_at_once(fn: Callable[[], Any], threads: int) -> List[Exception]:
  """Calls `fn` from `threads` threads released together; returns what the
  calls raised."""
  barrier = threading.Barrier(threads)
  errors: List[Exception] = []

  def call():
    barrier.wait()
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  started = [threading.Thread(target=call) for _ in range(threads)]
  for thread in started:
    thread.start()
  for thread in started:
    thread.join()
  return errors
