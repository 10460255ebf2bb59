"""Host time of a served call's full path: dynamo's guards, the captured
code, the served graph's callable and the bridge's, on make bench's model
(tools/bench_dispatch.py: 64 Linear layers, 129 graph inputs, 4 batch sizes
in rotation), with what computing the call's signature key once more costs,
timed in the same interleaved rounds.

A full call is what serve() returns minus its fast path: the first
capture called directly (`served.compiled`). The "key once more" row adds
one `key_of` of the graph's arguments to each full call, the work serve()'s
full path did before the served graph's callable handed its key down to the
bridge's (it computed it to record the signature, then the bridge computed
it again); "key alone" is that `key_of` by itself.

  python tools/bench_full_path.py [--calls 400] [--rounds 7]
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch
import torch_xla

import torch_xla_patches
from bench_dispatch import make_served, time_calls


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--calls', type=int, default=400)
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--width', type=int, default=16)
  parser.add_argument('--depth', type=int, default=64)
  args = parser.parse_args(argv)
  device = torch_xla.device()
  batches = (2, 4, 8, 16)
  torch.set_grad_enabled(False)
  served, _ = make_served(args.width, args.depth, batches, device)
  full = served.compiled
  backend = full.backend_callable
  inputs = [(torch.randn(b, args.width, device=device),) for b in batches]
  graph_args = []
  for x in inputs:
    with backend.observed_calls() as calls:
      full(*x)
    graph_args.append((calls[0][0],))
  key_of = backend.signature_cache.key_of
  # The graph arguments of the full call of the same inputs, in the same
  # rotation.
  paired = [x + a for x, a in zip(inputs, graph_args)]

  def full_and_key(x, graph_arguments):
    key_of(graph_arguments)
    return full(x)

  samples = {}
  for _ in range(args.rounds):
    samples.setdefault('full call',
                       []).append(time_calls(full, inputs, args.calls).host_us)
    samples.setdefault('full call, key once more', []).append(
        time_calls(full_and_key, paired, args.calls).host_us)
    samples.setdefault('key alone', []).append(
        time_calls(key_of, graph_args, args.calls).host_us)
  torch_xla_patches.revert()
  print(f'torch_xla {torch_xla.__version__}, {args.depth} Linear layers, '
        f'batches {batches} in rotation; host CPU us per call, median of '
        f'{args.rounds} interleaved rounds of {args.calls} calls '
        f'(min-max)\n')
  print('| | host us |')
  print('|---|---:|')
  for name, values in samples.items():
    print(f'| {name} | {statistics.median(values):.1f} '
          f'({min(values):.1f}-{max(values):.1f}) |')
  return 0


if __name__ == '__main__':
  sys.exit(main())
