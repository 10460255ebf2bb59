"""What a restart costs when the signature index holds many signatures.

  python tools/bench_restart.py [--signatures 400] [--calls 20]

Records one signature of a one-Linear model (batch 2) by serving it, adds
synthetic records for batches 10, 11, ... up to --signatures in all (as a
service without buckets would have recorded), then restarts the model in a
fresh process per replay setting and reports, side by side in one run:
  first call s      wall time of the restart's first call
  compiles before   XLA compiles before the first result came back
  replayed          recorded signatures compiled by then
  next calls s      wall time of --calls later calls on recorded batches
  compiles after    XLA compiles during those calls
The settings: the defaults (sync, at most 64 signatures or 30 s before the
first call returns, the rest one per served call), sync with no bound,
interleaved, and off (compile on demand only).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVE = r'''
import copy, json, sys, time
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
torch_xla_patches.apply(cache_dir=sys.argv[1])
torch.manual_seed(0)
cpu_model = torch.nn.Linear(16, 16)
model = copy.deepcopy(cpu_model).to(torch_xla.device())
compiled = torch.compile(model, backend='openxla', dynamic=True)


def compiles():
  data = met.metric_data('CompileTime')
  return data[0] if data else 0


def call(batch):
  x = torch.randn(batch, 16)
  return compiled(x.to(torch_xla.device())).cpu(), x


start = time.perf_counter()
out, x = call(2)
first = time.perf_counter() - start
with torch.no_grad():
  torch.testing.assert_close(out, cpu_model(x), rtol=1e-4, atol=1e-4)
before = compiles()
replayed = met.counter_value('DynamoSignaturePrecompiled') or 0
start = time.perf_counter()
for batch in json.loads(sys.argv[2]):
  call(batch)
print(json.dumps({
    'first_call_s': first,
    'compiles_before': before,
    'replayed': replayed,
    'next_calls_s': time.perf_counter() - start,
    'compiles_after': compiles() - before,
}))
'''

SETTINGS = (
    ('defaults (sync, 64 / 30 s)', {}),
    ('sync, no bound', {
        'XLA_PATCHES_REPLAY_SYNC_MAX': '0',
        'XLA_PATCHES_REPLAY_SYNC_SECONDS': '0'
    }),
    ('interleaved', {
        'XLA_PATCHES_PRECOMPILE': 'interleaved'
    }),
    ('off', {
        'XLA_PATCHES_PRECOMPILE': 'off'
    }),
)


def run(cache_dir, batches, env):
  full_env = dict(os.environ, PJRT_DEVICE='CPU', PYTHONPATH=REPO_ROOT)
  full_env.update(env)
  full_env.setdefault('XLA_PATCHES_PRECOMPILE_PROGRESS', '0')
  proc = subprocess.run(
      [sys.executable, '-c', SERVE, cache_dir,
       json.dumps(batches)],
      env=full_env,
      capture_output=True,
      text=True,
      timeout=1800)
  if proc.returncode != 0:
    raise SystemExit(proc.stderr[-3000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def fill_index(cache_dir, total):
  sys.path.insert(0, REPO_ROOT)
  from torch_xla_patches import record, signature_index
  (directory,) = signature_index.graph_directories(cache_dir)
  index = signature_index.open_graph_directory(directory, max_signatures=0)
  (recorded,) = index.load().records
  for batch in range(10, 10 + total - 1):
    specs = tuple({'value': batch} if spec == {'value': 2} else ({
        'shape': [batch] + spec['shape'][1:],
        'dtype': spec['dtype']
    } if spec and spec.get('shape', [None])[0] == 2 else spec)
                  for spec in recorded.specs)
    index.record(
        record.RecordedSignature(record_id=record.record_id_of(specs, None),
                                 specs=specs,
                                 shardings=None))
  return len(index.load().records)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--signatures', type=int, default=400)
  parser.add_argument('--calls', type=int, default=20)
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as root:
    seed = os.path.join(root, 'seed')
    run(seed, [], {})
    recorded = fill_index(seed, args.signatures)
    # Later calls: recorded batches, the most served first would be all
    # equal here, so take an even spread.
    step = max(1, (args.signatures - 1) // args.calls)
    batches = [10 + i * step for i in range(args.calls)]
    for name, env in SETTINGS:
      cache_dir = os.path.join(root, name.split()[0])
      subprocess.run(['cp', '-r', seed, cache_dir], check=True)
      rows.append((name, run(cache_dir, batches, env)))
  print(f'\n{recorded} recorded signatures; first call on batch 2, then '
        f'{args.calls} calls on recorded batches\n')
  print('| replay setting | first call s | compiles before first result | '
        'replayed by then | next calls s | compiles during them |')
  print('|---|---:|---:|---:|---:|---:|')
  for name, r in rows:
    print(f'| {name} | {r["first_call_s"]:.2f} | {r["compiles_before"]} | '
          f'{r["replayed"]} | {r["next_calls_s"]:.2f} | '
          f'{r["compiles_after"]} |')
  return 0


if __name__ == '__main__':
  sys.exit(main())
