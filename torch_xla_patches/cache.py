"""Inspect and maintain a torch_xla_patches cache directory.

  python -m torch_xla_patches.cache list   DIR [--json]   graphs, signatures, usage
  python -m torch_xla_patches.cache stats  DIR [--json]   counts and sizes
  python -m torch_xla_patches.cache verify DIR [--json]   check every file
  python -m torch_xla_patches.cache prune  DIR [--max N]  keep the N most served
                                                          signatures per graph
  python -m torch_xla_patches.cache clear  DIR            remove index and executables

(also installed as the `torch-xla-patches-cache` command). Reads and writes the
index files only; needs no XLA device. Exit status: 0, or 1 when verify finds
an unusable file, 2 for a directory that does not exist.
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional

from torch_xla_patches import config
from torch_xla_patches import record
from torch_xla_patches import signature_index


def _graph_summary(directory: str) -> Dict[str, Any]:
  """One graph directory: its records (ranked) and its unusable files."""
  name = os.path.basename(directory)
  try:
    # No cap: list everything the directory holds.
    index = signature_index.open_graph_directory(directory, max_signatures=0)
  except record.RecordError as e:
    return {'graph': name, 'error': f'{signature_index.GRAPH_FILE}: {e}'}
  contents = index.load()
  parts = index.fingerprint.as_dict()
  files = os.listdir(directory)
  return {
      'graph':
          name,
      'torch_xla_version':
          parts.get('torch_xla_version', '?'),
      'device_kind':
          parts.get('device_kind', '?'),
      'signatures': [{
          'signature': record.describe(),
          'served': record.served,
          'last_served': record.last_served,
          'file': os.path.basename(record.source),
      } for record in contents.records],
      'unusable': [{
          'file': os.path.basename(p.path),
          'reason': p.reason
      } for p in contents.problems],
      'usage_files':
          sum(f.startswith(signature_index.USAGE_PREFIX) for f in files),
      'snapshots':
          sum(f.startswith(signature_index.SNAPSHOT_PREFIX) for f in files),
  }


def _summaries(cache_dir: str) -> List[Dict[str, Any]]:
  return [
      _graph_summary(d) for d in signature_index.graph_directories(cache_dir)
  ]


def _old_format_files(cache_dir: str) -> List[str]:
  root = os.path.join(cache_dir, signature_index.SIGNATURES_DIR)
  if not os.path.isdir(root):
    return []
  return sorted(
      n for n in os.listdir(root)
      if n.endswith('.json') and os.path.isfile(os.path.join(root, n)))


def _when(seconds: float) -> str:
  return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(seconds))


def cmd_list(cache_dir: str, as_json: bool, _args) -> int:
  summaries = _summaries(cache_dir)
  if as_json:
    print(json.dumps(summaries, indent=1))
    return 0
  for graph in summaries:
    if 'error' in graph:
      print(f'{graph["graph"]}: UNUSABLE ({graph["error"]})')
      continue
    print(f'{graph["graph"]}: {len(graph["signatures"])} signatures, '
          f'torch_xla {graph["torch_xla_version"]} on {graph["device_kind"]}')
    for item in graph['signatures']:
      print(f'  served {item["served"]:>6}  last {_when(item["last_served"])}  '
            f'{item["signature"]}')
    for item in graph['unusable']:
      print(f'  UNUSABLE {item["file"]}: {item["reason"]}')
  return 0


def _tree_size(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      with contextlib.suppress(OSError):
        total += os.path.getsize(os.path.join(root, name))
  return total


def cmd_stats(cache_dir: str, as_json: bool, _args) -> int:
  summaries = _summaries(cache_dir)
  good = [g for g in summaries if 'error' not in g]
  stats = {
      'graphs':
          len(good),
      'signatures':
          sum(len(g['signatures']) for g in good),
      'calls_served':
          sum(s['served'] for g in good for s in g['signatures']),
      'unusable_files':
          (len(summaries) - len(good) + sum(len(g['unusable']) for g in good)),
      'usage_files':
          sum(g['usage_files'] for g in good),
      'index_bytes':
          _tree_size(os.path.join(cache_dir, signature_index.SIGNATURES_DIR)),
      # torch_xla 2.9 writes these but cannot load them back.
      'persisted_executable_bytes':
          _tree_size(os.path.join(cache_dir, 'xla')),
  }
  if as_json:
    print(json.dumps(stats, indent=1))
  else:
    for name, value in stats.items():
      print(f'{name}: {value}')
  return 0


def cmd_verify(cache_dir: str, as_json: bool, _args) -> int:
  problems = []
  for name in _old_format_files(cache_dir):
    problems.append({
        'file': name,
        'reason': 'format 1 index file, no longer read (clear it)'
    })
  ok = []
  for graph in _summaries(cache_dir):
    if 'error' in graph:
      problems.append({'file': graph['graph'], 'reason': graph['error']})
      continue
    ok.append({'graph': graph['graph'], 'signatures': len(graph['signatures'])})
    problems.extend({
        'file': f'{graph["graph"]}/{item["file"]}',
        'reason': item['reason']
    } for item in graph['unusable'])
  if as_json:
    print(json.dumps({'ok': ok, 'unusable': problems}, indent=1))
  else:
    for item in ok:
      print(f'ok  {item["graph"]}: {item["signatures"]} signatures')
    for item in problems:
      print(f'BAD {item["file"]}: {item["reason"]}')
  return 1 if problems else 0


def cmd_prune(cache_dir: str, as_json: bool, args) -> int:
  cap = config.index_max_signatures if args.max is None else args.max
  results = []
  for directory in signature_index.graph_directories(cache_dir):
    try:
      index = signature_index.open_graph_directory(directory, cap)
    except record.RecordError as e:
      results.append({'graph': os.path.basename(directory), 'error': str(e)})
      continue
    contents = index.load()
    before = len(contents.records) + contents.over_cap
    compacted = index.compact(force=True)
    after = len(index.load().records)
    results.append({
        'graph': os.path.basename(directory),
        'compacted': compacted,
        'signatures_before': before,
        'signatures_after': after,
    })
  if as_json:
    print(json.dumps(results, indent=1))
  else:
    for item in results:
      if 'error' in item:
        print(f'{item["graph"]}: UNUSABLE ({item["error"]})')
      elif not item['compacted']:
        print(f'{item["graph"]}: skipped (another process is compacting it)')
      else:
        print(f'{item["graph"]}: {item["signatures_before"]} -> '
              f'{item["signatures_after"]} signatures')
  return 0


def cmd_clear(cache_dir: str, as_json: bool, _args) -> int:
  removed = []
  for sub in (signature_index.SIGNATURES_DIR, 'xla'):
    path = os.path.join(cache_dir, sub)
    if os.path.isdir(path):
      shutil.rmtree(path)
      removed.append(path)
  if as_json:
    print(json.dumps({'removed': removed}))
  else:
    for path in removed:
      print(f'removed {path}')
  return 0


COMMANDS = {
    'list': cmd_list,
    'stats': cmd_stats,
    'verify': cmd_verify,
    'prune': cmd_prune,
    'clear': cmd_clear,
}


def main(argv: Optional[List[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m torch_xla_patches.cache',
                                   description=__doc__.splitlines()[0])
  parser.add_argument('command', choices=sorted(COMMANDS))
  parser.add_argument('cache_dir')
  parser.add_argument('--json', action='store_true', help='JSON output')
  parser.add_argument('--max',
                      type=int,
                      default=None,
                      help='prune: signatures kept per graph (default: '
                      'config.index_max_signatures)')
  args = parser.parse_args(argv)
  if not os.path.isdir(args.cache_dir):
    print(f'{args.cache_dir} is not a directory', file=sys.stderr)
    return 2
  return COMMANDS[args.command](args.cache_dir, args.json, args)


if __name__ == '__main__':
  sys.exit(main())
