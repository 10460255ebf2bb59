"""Part 2 of tools/bench_decode.py: generate() with a StaticCache on a
compiled forward.

Part 2, Hugging Face generate with a StaticCache: a tiny LlamaForCausalLM
built from a LlamaConfig (nothing downloaded) on the XLA device, with
`model.forward = torch.compile(model.forward, backend='openxla')` as the
transformers docs show, and `model.generate(ids,
cache_implementation='static', max_cache_len=L, do_sample=False)` at two
static cache lengths, upstream and patched, each in a fresh process. The
forward is timed the same way per call (prefill left out); tokens are
compared with the same generate run eagerly on the CPU. Two untimed
generate calls come first: the first compiles two XLA programs per decode
step (about 0.1 s each here; its inputs arrive with pending IR, synced
first), the second none. A row that fails prints its error instead of a
number.
"""
import copy
import statistics
from typing import Any, Dict, List, Sequence

import torch

from bench_decode_common import (HF_CONFIG, HF_MODEL_WORDS, HF_PROMPT, compiles,
                                 counter, failed_row, fmt, hf_model, hf_prompt,
                                 peak_rss_mib, time_call)


def hf_row(mode: str, cache_len: int, new_tokens: int,
           runs: int) -> Dict[str, Any]:
  """One StaticCache generate row, run in this process (see the module
  docstring)."""
  import torch_xla
  if mode == 'patched':
    import torch_xla_patches
    torch_xla_patches.apply()
  device = torch_xla.device()
  _, cpu_model = hf_model(cache_len)
  ids = hf_prompt()
  generate_args = dict(max_new_tokens=new_tokens,
                       cache_implementation='static',
                       max_cache_len=cache_len,
                       do_sample=False)
  expected = cpu_model.generate(ids, **generate_args)
  model = copy.deepcopy(cpu_model).to(device)
  compiled = torch.compile(model.forward, backend='openxla')
  walls, hosts = [], []

  def forward(*args, **kwargs):
    logits, wall, host = time_call(compiled, *args, **kwargs)
    walls.append(wall)
    hosts.append(host)
    return logits

  model.forward = forward
  step_walls, step_hosts = [], []
  timed_compiles = 0
  matches = True
  # Two generate calls warm up: the first compiles every step's program.
  for index in range(2 + runs):
    walls.clear()
    hosts.clear()
    before = compiles()
    got = model.generate(ids.to(device), **generate_args).cpu()
    matches = matches and torch.equal(got, expected)
    if index >= 2:
      timed_compiles += compiles() - before
      step_walls += walls[1:]  # walls[0] is the prefill
      step_hosts += hosts[1:]
  return {
      'step_ms': statistics.median(step_walls) * 1e3,
      'host_us': statistics.median(step_hosts) * 1e6,
      'peak_rss_mib': peak_rss_mib(),
      'compiles': timed_compiles,
      'steps': len(step_walls),
      'donated': counter('DynamoDonatedInput'),
      'tokens_match': matches,
  }


def hf_table(results: Dict[tuple, Dict[str, Any]],
             lengths: Sequence[int]) -> List[str]:
  """Part 2's markdown table."""
  lines = [
      '| row | static cache length | step ms | host us | long/short step | '
      'peak RSS MiB | compiles | donated | decode steps timed | '
      'vs eager tokens |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---:|---|',
  ]
  for mode in ('upstream', 'patched'):
    short = results[(mode, lengths[0])]
    for length in lengths:
      r = results[(mode, length)]
      if 'error' in r:
        lines.append(failed_row(lines, (mode, length), r['error']))
        continue
      ratio = '-'
      if length != lengths[0] and 'error' not in short:
        ratio = fmt(r['step_ms'] / short['step_ms']) + 'x'
      check = 'ok' if r['tokens_match'] else 'MISMATCH'
      lines.append(f'| {mode} | {length} | {fmt(r["step_ms"])} | '
                   f'{fmt(r["host_us"], 1)} | {ratio} | '
                   f'{r["peak_rss_mib"]:.0f} | {r["compiles"]} | '
                   f'{r["donated"]} | {r["steps"]} | {check} |')
  return lines


def title(args) -> str:
  """Part 2's title line."""
  return (
      f'\nHugging Face StaticCache generate: {HF_MODEL_WORDS}, vocab '
      f'{HF_CONFIG["vocab_size"]}, prompt {HF_PROMPT}, {args.hf_tokens} new '
      f'tokens; median decode step of {args.hf_runs} generate call(s) after '
      '2; one fresh process per row\n')
