"""generate()'s one-token steps on a torch.compile'd forward: upstream's
bridge against the patched one, interleaved in one process.

  .venv/bin/python tools/bench_generate_steps.py [--lengths 64 4096]

For each static cache length, one fresh process: the tiny Llama of
tools/bench_decode.py part 6, two forwards compiled with
`torch.compile(model.forward, backend='openxla')`, the first made and run
(two untimed generations) before `torch_xla_patches.apply()`, so its graphs
go through upstream's bridge, the second after. Then --rounds rounds of one
--tokens generation per forward, their order swapped every round. A step's
host time is the thread CPU of the forward call alone, its wall time runs
to the device's end (tools/bench_decode_common.time_call); both are the
medians of every one-token step of the timed rounds. XLA compiles are
counted in the timed rounds only: XLA's compile cache is the process's, so
the programs both forwards make (generate()'s own eager graphs, the
timer's syncs) compile in the upstream forward's untimed generations.
Part 6 of
bench_decode.py runs each row in its own process, minutes apart: this tool
compares the two bridges on the same process, machine state and caches.
"""
import argparse
import copy
import inspect
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Tuple

import torch

BRIDGES = ('upstream', 'patched')


def _row(cache_len: int, tokens: int, rounds: int) -> Dict[str, Any]:
  """One cache length's measurements, in this process."""
  import torch_xla
  from bench_decode_common import compiles, hf_model, hf_prompt, time_call
  from bench_decode_hf_generate import generate_cache, generate_tokens
  device = torch_xla.device()
  config, cpu_model = hf_model(cache_len)
  ids = hf_prompt()

  def generate(model: Any, on: Any, cache: Any) -> torch.Tensor:
    return generate_tokens(model, on, cache, ids, tokens)

  expected = generate(cpu_model, 'cpu', generate_cache(config, cache_len,
                                                       'cpu'))

  def compiled() -> Tuple[Any, Any, List[Tuple[float, float]]]:
    model = copy.deepcopy(cpu_model).to(device)
    target = torch.compile(model.forward, backend='openxla')
    calls: List[Tuple[float, float]] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
      result, wall, host = time_call(target, *args, **kwargs)
      calls.append((wall, host))
      return result

    # generate() passes what the forward's parameters name.
    forward.__signature__ = inspect.signature(target)
    model.forward = forward
    return model, generate_cache(config, cache_len, device), calls

  forwards = {}
  tokens_match = {}
  for bridge in BRIDGES:
    if bridge == 'patched':
      import torch_xla_patches
      torch_xla_patches.apply()
    forwards[bridge] = compiled()
    model, cache, _ = forwards[bridge]
    tokens_match[bridge] = all(
        torch.equal(generate(model, device, cache), expected) for _ in range(2))
  hosts: Dict[str, List[float]] = {bridge: [] for bridge in BRIDGES}
  walls: Dict[str, List[float]] = {bridge: [] for bridge in BRIDGES}
  timed_compiles = {bridge: 0 for bridge in BRIDGES}
  for round_index in range(rounds):
    order = BRIDGES if round_index % 2 == 0 else BRIDGES[::-1]
    for bridge in order:
      model, cache, calls = forwards[bridge]
      calls.clear()
      before = compiles()
      got = generate(model, device, cache)
      timed_compiles[bridge] += compiles() - before
      tokens_match[bridge] &= torch.equal(got, expected)
      steps = calls[1:]  # calls[0] is the prompt
      hosts[bridge] += [host for _, host in steps]
      walls[bridge] += [wall for wall, _ in steps]
  return {
      bridge: {
          'step_ms': statistics.median(walls[bridge]) * 1e3,
          'host_us': statistics.median(hosts[bridge]) * 1e6,
          'steps': len(hosts[bridge]),
          'compiles': timed_compiles[bridge],
          'tokens_match': tokens_match[bridge],
      } for bridge in BRIDGES
  }


def _table(results: Dict[int, Dict[str, Any]], rounds: int) -> List[str]:
  lines = [
      '| cache | upstream step ms | upstream host us | patched step ms | '
      'patched host us | patched / upstream, step | patched / upstream, '
      f'host | XLA compiles in the {rounds} timed generations (upstream / '
      'patched) | tokens equal eager (upstream / patched) |',
      '|---:|---:|---:|---:|---:|---:|---:|---|---|',
  ]
  for cache_len, row in results.items():
    up, patched = row['upstream'], row['patched']
    lines.append(f'| {cache_len} | {up["step_ms"]:.3f} | {up["host_us"]:.1f} | '
                 f'{patched["step_ms"]:.3f} | {patched["host_us"]:.1f} | '
                 f'{patched["step_ms"] / up["step_ms"]:.2f} | '
                 f'{patched["host_us"] / up["host_us"]:.2f} | '
                 f'{up["compiles"]} / {patched["compiles"]} | '
                 f'{up["tokens_match"]} / {patched["tokens_match"]} |')
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--lengths', type=int, nargs='+', default=[64, 4096])
  parser.add_argument('--tokens', type=int, default=16)
  parser.add_argument('--rounds', type=int, default=8)
  parser.add_argument('--row', type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.row is not None:
    print('RESULT ' + json.dumps(_row(args.row, args.tokens, args.rounds)))
    return
  results = {}
  for cache_len in args.lengths:
    # A process per length: apply() stays for the rest of a process, and
    # the upstream forward must compile before it.
    row = subprocess.run([
        sys.executable, __file__, '--row',
        str(cache_len), '--tokens',
        str(args.tokens), '--rounds',
        str(args.rounds)
    ],
                         capture_output=True,
                         text=True,
                         env=dict(os.environ, PJRT_DEVICE='CPU'))
    if row.returncode:
      sys.exit(f'the row of cache length {cache_len} failed:\n'
               f'{row.stderr[-4000:]}')
    out = row.stdout
    line = next(l for l in out.splitlines() if l.startswith('RESULT '))
    results[cache_len] = json.loads(line[len('RESULT '):])
  print(f'\ngenerate() one-token steps on a torch.compile\'d forward, '
        f'{args.tokens} new tokens, {args.rounds} rounds per bridge '
        'interleaved in one process per cache length (medians of every '
        'step)\n')
  print('\n'.join(_table(results, args.rounds)))


if __name__ == '__main__':
  main()
