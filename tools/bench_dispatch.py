"""Per-call host overhead: upstream's bridge, the patched one and serve(),
side by side.

A stack of 64 Linear layers (129 graph inputs) compiled with dynamic=True is
called with 4 batch sizes in rotation. Every variant runs in this one
process, in interleaved rounds, so machine noise hits them alike. The floor
is `_run_cached_graph` alone with inputs prepared beforehand (what any bridge
must pay); "bridge only" calls the bridge's callable directly with the
arguments dynamo passes it, without dynamo's own wrapper. The serve() row
calls what torch_xla_patches.serve() returns (its fast path, see [Note:
Served fast path]); its floor is its own program's, run the same way, with
the buckets in rotation as a server's traffic calls them and with one bucket
called over and over.

The stage split times what dynamo runs above the bridge, piece by piece, for
both bridges: the whole call, dynamo's transformed code called directly (no
frame entry, no guards), its guard check alone, dynamo's compiled function
(AOTAutograd's wrappers around the bridge) and the bridge. The differences
are each stage's own cost (see docs/fast-path.md).

The same stages are timed again with `_run_cached_graph` replaced by a stub
returning each program's recorded results: each stage's own host work with
its code and data still in the CPU caches. A real run evicts them, and the
first split charges those misses to whichever stage touches the memory
first (see docs/fast-path.md, "Where a torch.compile call's time goes").

Host memory kept per call: after the timed rounds, each of upstream's
torch.compile call, the patched one and serve()'s makes --memory-calls more
calls alone, and the process's resident memory is read before and after
(a call that keeps host memory for good, as torch_xla's counter binding
does, grows it by that much per call; see docs/observability.md).

The last line is the ratio to upstream, the number docs/benchmarks.md keeps
per commit: (patched torch.compile call - floor) / (upstream's - floor),
host CPU.

  python tools/bench_dispatch.py [--calls 400] [--rounds 7]
      [--memory-calls 30000] [--json out.json]
"""
import argparse
import dataclasses
import json
import os
import importlib
import statistics
import sys
import tempfile
import time
import types
from typing import Any, List, Optional

os.environ.setdefault('PJRT_DEVICE', 'CPU')
# The package of this checkout, whatever the venv has installed.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch
import torch_xla
import torch_xla.core.xla_model as xm

import torch_xla_patches
from torch_xla_patches import config

MODEL_SOURCE = '''
import torch

class LinearStack(torch.nn.Module):

  def __init__(self, width, depth):
    super().__init__()
    self.layers = torch.nn.ModuleList(
        torch.nn.Linear(width, width) for _ in range(depth))

  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return x
'''


def make_model(width: int, depth: int) -> torch.nn.Module:
  # A fresh class per variant gives each its own code object, so dynamo keeps
  # a separate cache entry (and bridge) for each.
  namespace = {}
  exec(compile(MODEL_SOURCE, '<bench_dispatch model>', 'exec'), namespace)
  torch.manual_seed(0)
  return namespace['LinearStack'](width, depth)


@dataclasses.dataclass(frozen=True)
class Timing:
  # Wall time per call, device work included (XLA's CPU client runs the
  # program on its own threads, overlapped with the next call's host work).
  wall_us: float
  # CPU time of the calling thread per call: the host overhead itself.
  host_us: float


def time_calls(fn, arg_sets, calls) -> Timing:
  xm.wait_device_ops()
  start, start_cpu = time.perf_counter(), time.thread_time()
  for i in range(calls):
    fn(*arg_sets[i % len(arg_sets)])
  host = time.thread_time() - start_cpu
  xm.wait_device_ops()
  wall = time.perf_counter() - start
  return Timing(wall / calls * 1e6, host / calls * 1e6)


def make_served(width, depth, batches, device):
  """serve() of the same model, whose class must live in a module file (an
  aot_compile capture needs its source), and its floor: (graph hash, XLA
  inputs) per batch."""
  from torch_xla_patches.io_utils import TensorSpec
  directory = tempfile.mkdtemp(prefix='bench_dispatch_')
  with open(os.path.join(directory, 'bench_dispatch_served.py'), 'w') as f:
    f.write(MODEL_SOURCE)
  sys.path.insert(0, directory)
  module = importlib.import_module('bench_dispatch_served')
  torch.manual_seed(0)
  model = module.LinearStack(width, depth).to(device)
  # wait=True: the first capture is made before serve() returns (see [Note:
  # The first capture] in serving.py).
  served = torch_xla_patches.serve(
      model, [(TensorSpec((b, width), torch.float32),) for b in batches],
      wait=True)
  backend = served.compiled.backend_callable
  floor = []
  for batch in batches:
    with backend.observed_calls() as calls:
      served.compiled(torch.randn(batch, width, device=device))
    graph_args = calls[0][0]
    # The graph's cache exists once the backend's first call has run.
    cache = backend.signature_cache
    entry = cache.entries[cache.key_of(graph_args)]
    floor.append((entry.graph_hash, entry.graph_input_matcher(graph_args)))
  return served, floor


def prepared_graph_runs(captured):
  """(graph hash, XLA inputs) per batch, prepared by the patched bridge.

  The compiled program and its inputs are the same whichever bridge made
  them, so one floor serves both rows.
  """
  runs = []
  for bridge, args in captured:
    cache = bridge.signature_cache
    entry = cache.entries[cache.key_of(args)]
    runs.append((entry.graph_hash, entry.graph_input_matcher(args)))
  return runs


def capture_bridge(compiled, batches, device, width):
  """The bridge callable and the args dynamo hands it, per batch size.

  The capturing wrapper stays in the call path afterwards (dynamo's closure
  keeps it), but costs only a flag test once capturing is over.
  """
  import torch_xla.core.dynamo_bridge as core_bridge
  original = core_bridge.extract_compiled_graph
  captured = {}
  capturing = [True]

  def extract_and_capture(xla_model, xla_args):
    bridge = original(xla_model, xla_args)

    def wrapper(*args):
      if capturing[0]:
        batch = next(a.shape[0] for a in args if isinstance(a, torch.Tensor) and
                     not isinstance(a, torch.nn.Parameter))
        captured[batch] = (bridge, args)
      return bridge(*args)

    return wrapper

  core_bridge.extract_compiled_graph = extract_and_capture
  try:
    for batch in batches:
      compiled(torch.randn(batch, width, device=device))
  finally:
    core_bridge.extract_compiled_graph = original
    capturing[0] = False
  return captured


@dataclasses.dataclass(frozen=True)
class DynamoStages:
  """The pieces of a torch.compile call above the bridge, each callable on
  its own with the arguments it takes (see the stage split in the module
  docstring)."""
  # dynamo's transformed code of forward, as a function, and its arguments
  # (the module and the input) per batch.
  transformed_code: Any
  code_args: List[tuple]
  # The cache entry's guard check, and dynamo's frame locals per batch.
  guard_check: Any
  guard_args: List[tuple]
  # The compiled function the transformed code calls (AOTAutograd's
  # callable inside dynamo's disable wrapper), and its arguments per batch.
  compiled_fn: Any
  compiled_fn_args: List[tuple]


def dynamo_stages(model, compiled, inputs) -> Optional[DynamoStages]:
  """dynamo's stages of `compiled` (torch.compile of `model`, called on
  `inputs` already), from its one cache entry for forward; None where this
  torch keeps them elsewhere."""
  from torch._dynamo.eval_frame import _debug_get_cache_entry_list
  forward = type(model).forward
  try:
    entries = _debug_get_cache_entry_list(forward.__code__)
    code, guards = entries[0].code, entries[0].guard_manager
  except (AttributeError, IndexError):
    return None
  names = [n for n in code.co_names if n.startswith('__compiled_fn')]
  if len(entries) != 1 or len(names) != 1:
    return None
  namespace = forward.__globals__
  compiled_fn = namespace[names[0]]
  seen = []

  def spy(*args):
    seen.append(args)
    return compiled_fn(*args)

  namespace[names[0]] = spy
  try:
    for x in inputs:
      compiled(*x)
  finally:
    namespace[names[0]] = compiled_fn
  guard_args = [({'self': model, 'x': x},) for (x,) in inputs]
  if not all(guards.check(*a) for a in guard_args):
    return None
  return DynamoStages(transformed_code=types.FunctionType(code, namespace),
                      code_args=[(model, x) for (x,) in inputs],
                      guard_check=guards.check,
                      guard_args=guard_args,
                      compiled_fn=compiled_fn,
                      compiled_fn_args=seen)


def served_full_calls(served) -> int:
  """Calls of `served` that took the full path, by the fallback counters."""
  from torch_xla_patches import fast_dispatch
  import torch_xla.debug.metrics as metrics
  return sum(
      metrics.counter_value(name) or 0
      for name in (fast_dispatch.COUNTER_FALLBACK_GLOBAL_STATE,
                   fast_dispatch.COUNTER_FALLBACK_MODULE,
                   fast_dispatch.COUNTER_FALLBACK_ARGUMENTS,
                   fast_dispatch.COUNTER_FALLBACK_NO_PLAN))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--calls', type=int, default=400)
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--width', type=int, default=16)
  parser.add_argument('--depth', type=int, default=64)
  parser.add_argument('--memory-calls',
                      type=int,
                      default=30000,
                      help='calls per variant for the host memory kept per '
                      'call (0: not measured)')
  parser.add_argument('--json', default=None)
  args = parser.parse_args(argv)
  device = torch_xla.device()
  # Batch 1 is left out: dynamo specializes size 1 into a graph of its own.
  batches = (2, 4, 8, 16)
  torch.set_grad_enabled(False)

  variants = {}
  for name in ('upstream', 'patched'):
    if name == 'patched':
      torch_xla_patches.apply()
    else:
      torch_xla_patches.revert()
    model = make_model(args.width, args.depth).to(device)
    compiled = torch.compile(model, backend='openxla', dynamic=True)
    captured = capture_bridge(compiled, batches, device, args.width)
    inputs = [
        torch.randn(b, args.width, device=device).detach() for b in batches
    ]
    variants[name] = {
        'compiled': compiled,
        'inputs': [(x,) for x in inputs],
        'bridge': captured,
        'stages': dynamo_stages(model, compiled, [(x,) for x in inputs]),
    }
  served, served_floor_sets = make_served(args.width, args.depth, batches,
                                          device)
  served_inputs = [(torch.randn(b, args.width, device=device),) for b in batches
                  ]
  for x in served_inputs:
    served(*x)
  # The patch stays applied while timing: revert() also ends serve()'s
  # fast path (its module watch). The other variants' callables were made
  # already; the patch does not touch their per-call path.
  xm.wait_device_ops()

  run_cached_graph = torch_xla._XLAC._run_cached_graph
  floor_sets = prepared_graph_runs(variants['patched']['bridge'].values())
  samples = {}
  for _ in range(args.rounds):
    for name, v in variants.items():
      samples.setdefault(f'{name} torch.compile call', []).append(
          time_calls(v['compiled'], v['inputs'], args.calls))
      bridge_sets = [(b, a) for b, a in v['bridge'].values()]
      samples.setdefault(f'{name} bridge only', []).append(
          time_calls(lambda bridge, a: bridge(*a), bridge_sets, args.calls))
      stages = v['stages']
      if stages is not None:
        samples.setdefault(f'{name} transformed code', []).append(
            time_calls(stages.transformed_code, stages.code_args, args.calls))
        samples.setdefault(f'{name} guard check', []).append(
            time_calls(stages.guard_check, stages.guard_args, args.calls))
        samples.setdefault(f'{name} compiled fn', []).append(
            time_calls(stages.compiled_fn, stages.compiled_fn_args, args.calls))
    samples.setdefault('floor', []).append(
        time_calls(run_cached_graph, floor_sets, args.calls))
    samples.setdefault('serve() call',
                       []).append(time_calls(served, served_inputs, args.calls))
    samples.setdefault('serve() floor', []).append(
        time_calls(run_cached_graph, served_floor_sets, args.calls))
    samples.setdefault('serve() call, one bucket', []).append(
        time_calls(served, served_inputs[:1], args.calls))
    config.serve_check_bound_tensors = False
    samples.setdefault('serve() call, no bound-tensor check',
                       []).append(time_calls(served, served_inputs, args.calls))
    config.serve_check_bound_tensors = True
    samples.setdefault('serve() floor, one bucket', []).append(
        time_calls(run_cached_graph, served_floor_sets[:1], args.calls))

  stubbed = stubbed_split(variants, served, served_inputs, args.rounds)
  kept = {}
  if args.memory_calls > 0:
    for name, v in variants.items():
      kept[f'{name} torch.compile call'] = kept_per_call(
          v['compiled'], v['inputs'], args.memory_calls)
    kept['serve() call'] = kept_per_call(served, served_inputs,
                                         args.memory_calls)
  torch_xla_patches.revert()

  def median_of(key, field):
    return statistics.median(getattr(t, field) for t in samples[key])

  labels = [
      (f'upstream {torch_xla.__version__}, per torch.compile call',
       'upstream torch.compile call'),
      ('patched, per torch.compile call', 'patched torch.compile call'),
      ('upstream bridge only (no dynamo wrapper)', 'upstream bridge only'),
      ('patched bridge only (no dynamo wrapper)', 'patched bridge only'),
      ('floor: _run_cached_graph with prepared inputs', 'floor'),
      ('serve() call (its fast path)', 'serve() call'),
      ('floor of serve()\'s program', 'serve() floor'),
      ('serve() call, one bucket over and over', 'serve() call, one bucket'),
      ('floor of that bucket\'s program', 'serve() floor, one bucket'),
      ('serve() call, buckets in rotation, XLA_PATCHES_SERVE_CHECK_TENSORS=0',
       'serve() call, no bound-tensor check'),
  ]
  host = {key: median_of(key, 'host_us') for _, key in labels}
  wall = {key: median_of(key, 'wall_us') for _, key in labels}

  def ratio(values, first, second):
    return ((values[f'patched {first}'] - values['floor']) /
            (values[f'upstream {first}'] - values['floor']))

  print(f'\nPer-call time, {args.depth} Linear layers '
        f'({2 * args.depth + 1} graph inputs), batches {batches} in rotation, '
        f'median of {args.rounds} interleaved rounds x {args.calls} calls. '
        'Host CPU is the calling thread\'s CPU time (time.thread_time); wall '
        'includes waiting for the device.\n')
  print('| measurement | host CPU us per call | wall us per call |')
  print('|---|---:|---:|')
  for label, key in labels:
    print(f'| {label} | {host[key]:.1f} | {wall[key]:.1f} |')
  call_ratio = (ratio(host, 'torch.compile call',
                      None), ratio(wall, 'torch.compile call', None))
  bridge_ratio = (ratio(host, 'bridge only',
                        None), ratio(wall, 'bridge only', None))
  print(f'| (patched - floor) / (upstream - floor), per call | '
        f'{call_ratio[0]:.2f} | {call_ratio[1]:.2f} |')
  print(f'| (patched - floor) / (upstream - floor), bridge only | '
        f'{bridge_ratio[0]:.2f} | {bridge_ratio[1]:.2f} |')
  print(
      f'| patched / upstream, per call | '
      f'{host["patched torch.compile call"] / host["upstream torch.compile call"]:.2f} | '
      f'{wall["patched torch.compile call"] / wall["upstream torch.compile call"]:.2f} |'
  )
  print(f'| serve() call / its floor, buckets in rotation | '
        f'{host["serve() call"] / host["serve() floor"]:.2f} | '
        f'{wall["serve() call"] / wall["serve() floor"]:.2f} |')
  print(
      f'| serve() call / its floor, one bucket | '
      f'{host["serve() call, one bucket"] / host["serve() floor, one bucket"]:.2f} | '
      f'{wall["serve() call, one bucket"] / wall["serve() floor, one bucket"]:.2f} |'
  )
  print(
      f'| serve() call / its floor, in rotation, no bound-tensor check | '
      f'{host["serve() call, no bound-tensor check"] / host["serve() floor"]:.2f} | '
      f'{wall["serve() call, no bound-tensor check"] / wall["serve() floor"]:.2f} |'
  )
  print(f'| patched torch.compile call / floor | '
        f'{host["patched torch.compile call"] / host["floor"]:.2f} | '
        f'{wall["patched torch.compile call"] / wall["floor"]:.2f} |')
  print(f'\nserve(): {served.fast_calls} of '
        f'{served.fast_calls + served_full_calls(served)} calls took '
        'the fast path.')
  split = stage_split(samples)
  if split:
    print('\nStage split of a torch.compile call, host CPU us per call '
          '(medians; each stage is the difference of two timed callables):\n')
    print('| stage | upstream | patched |')
    print('|---|---:|---:|')
    for label, values in split.items():
      print(f'| {label} | {values["upstream"]:.1f} | {values["patched"]:.1f} |')
  if stubbed:
    print('\nThe same split with _run_cached_graph replaced by a stub that '
          'returns recorded results (host CPU us per call, medians): what '
          'each stage costs with its code and data in the CPU caches, which '
          'a real run evicts (see docs/fast-path.md):\n')
    print('| stage | upstream | patched |')
    print('|---|---:|---:|')
    for label, values in stubbed.items():
      print(f'| {label} | ' +
            ' | '.join(f'{values[name]:.1f}' if name in values else '-'
                       for name in ('upstream', 'patched')) + ' |')
  if kept:
    print(f'\nHost memory kept per call: resident memory grown over '
          f'{args.memory_calls} calls of each, after the timed rounds, in '
          'bytes per call (a page is 4096 bytes):\n')
    print('| call | bytes kept per call |')
    print('|---|---:|')
    for label, value in kept.items():
      print(f'| {label} | {value:.1f} |')
  if stubbed:
    above = stubbed['above the run (whole call - stub)']
    print(f'\nRatio to upstream with the run stubbed: '
          f'{above["patched"] / above["upstream"]:.2f}')
  print(f'\nRatio to upstream: {call_ratio[0]:.2f} (the patched torch.compile '
        'call\'s host CPU above the floor over upstream\'s, this run)')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(
          {
              'host_us': host,
              'wall_us': wall,
              'ratio_to_upstream': call_ratio[0],
              'stage_split_host_us': split,
              'stubbed_split_host_us': stubbed,
              'bytes_kept_per_call': kept,
          },
          f,
          indent=2)
  return 0


def resident_bytes() -> int:
  with open('/proc/self/statm') as statm:
    return int(statm.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def kept_per_call(fn, arg_sets, calls: int) -> float:
  """Resident memory grown over `calls` calls of `fn`, per call."""
  xm.wait_device_ops()
  before = resident_bytes()
  for i in range(calls):
    fn(*arg_sets[i % len(arg_sets)])
  xm.wait_device_ops()
  return (resident_bytes() - before) / calls


def stubbed_split(variants, served, served_inputs, rounds) -> dict:
  """{stage: {bridge: host us}} of a torch.compile call (and serve()'s fast
  call) with `_run_cached_graph` replaced by a stub that returns each
  program's recorded results: the host work around the run with nothing
  between two calls to evict it from the CPU caches (a real run does; a
  stage's share of those misses goes to whichever stage comes first).
  Empty where dynamo's stages were not found."""
  if any(v['stages'] is None for v in variants.values()):
    return {}
  real = torch_xla._XLAC._run_cached_graph
  recorded = {}

  def stub(graph_hash, inputs):
    results = recorded.get(graph_hash)
    if results is None:
      results = recorded[graph_hash] = real(graph_hash, inputs)
    return results

  def host_us(fn, arg_sets, calls=1000):
    start = time.thread_time()
    for i in range(calls):
      fn(*arg_sets[i % len(arg_sets)])
    return (time.thread_time() - start) / calls * 1e6

  torch_xla._XLAC._run_cached_graph = stub
  samples = {}
  try:
    for v in variants.values():
      for x in v['inputs']:
        v['compiled'](*x)
    for x in served_inputs:
      served(*x)
    xm.wait_device_ops()
    for _ in range(rounds):
      for name, v in variants.items():
        stages = v['stages']
        timed = {
            'whole': (v['compiled'], v['inputs']),
            'code': (stages.transformed_code, stages.code_args),
            'guards': (stages.guard_check, stages.guard_args),
            'compiled fn': (stages.compiled_fn, stages.compiled_fn_args),
            'bridge':
                (lambda bridge, a: bridge(*a), list(v['bridge'].values())),
        }
        for stage, (fn, arg_sets) in timed.items():
          samples.setdefault((name, stage), []).append(host_us(fn, arg_sets))
      samples.setdefault(('patched', 'serve'),
                         []).append(host_us(served, served_inputs))
      samples.setdefault(('patched', 'stub'),
                         []).append(host_us(stub, [(h, ()) for h in recorded]))
  finally:
    torch_xla._XLAC._run_cached_graph = real
  host = {key: statistics.median(values) for key, values in samples.items()}
  stub_us = host[('patched', 'stub')]
  split = {}
  for name in variants:
    stages = {
        'dynamo\'s frame entry (OptimizedModule, compile wrapper, eval-frame '
        'callback, guards)':
            host[(name, 'whole')] - host[(name, 'code')],
        '... of which the guard check':
            host[(name, 'guards')],
        'dynamo\'s transformed code (arguments gathered, sizes read)':
            host[(name, 'code')] - host[(name, 'compiled fn')],
        'AOTAutograd\'s wrappers and dynamo\'s disable':
            host[(name, 'compiled fn')] - host[(name, 'bridge')],
        'the bridge':
            host[(name, 'bridge')] - stub_us,
        'above the run (whole call - stub)':
            host[(name, 'whole')] - stub_us,
    }
    for label, value in stages.items():
      split.setdefault(label, {})[name] = value
  split['serve() fast call above the run'] = {
      'patched': host[('patched', 'serve')] - stub_us
  }
  return split


def stage_split(samples) -> dict:
  """{stage: {bridge: host us}} of a torch.compile call, from the timed
  stages of both bridges; empty where dynamo's stages were not found."""
  if 'patched transformed code' not in samples:
    return {}

  def host(key):
    return statistics.median(t.host_us for t in samples[key])

  split = {}
  for name in ('upstream', 'patched'):
    whole = host(f'{name} torch.compile call')
    code = host(f'{name} transformed code')
    compiled_fn = host(f'{name} compiled fn')
    bridge = host(f'{name} bridge only')
    floor = host('floor')
    stages = {
        'dynamo\'s frame entry (OptimizedModule, compile wrapper, eval-frame '
        'callback, guards)':
            whole - code,
        '... of which the guard check':
            host(f'{name} guard check'),
        'dynamo\'s transformed code (arguments gathered, sizes read)':
            code - compiled_fn,
        'AOTAutograd\'s wrappers and dynamo\'s disable':
            compiled_fn - bridge,
        'the bridge':
            bridge - floor,
        'floor (_run_cached_graph)':
            floor,
        'whole call':
            whole,
        'above the floor':
            whole - floor,
    }
    for label, value in stages.items():
      split.setdefault(label, {})[name] = value
  return split


if __name__ == '__main__':
  sys.exit(main())
