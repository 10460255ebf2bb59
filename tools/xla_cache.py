"""Inspect a torch_xla_patches cache directory.

  python tools/xla_cache.py list   CACHE_DIR   graphs and their signatures
  python tools/xla_cache.py stats  CACHE_DIR   counts and sizes
  python tools/xla_cache.py verify CACHE_DIR   check every index file
  python tools/xla_cache.py clear  CACHE_DIR   remove index and executables

Needs no XLA device: it reads the JSON index only.
"""
import argparse
import os
import shutil
import sys
import time

os.environ.setdefault('PJRT_DEVICE', 'CPU')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_xla_patches import persistent  # pylint: disable=g-import-not-at-top


def _describe_signature(kinds, signature) -> str:
  parts = []
  for position, (kind, spec) in enumerate(zip(kinds, signature)):
    if spec is None:
      continue
    if 'value' in spec:
      parts.append(f'{position}={spec["value"]}')
    else:
      parts.append(f'{position}:{spec["dtype"]}{spec["shape"]}')
  return ' '.join(parts) or '(static)'


def _index_files(cache_dir):
  index = persistent.SignatureIndex(cache_dir)
  for path in index.files():
    try:
      yield path, persistent.read_index_file(path), None
    except persistent.IndexFileError as e:
      yield path, None, str(e)


def cmd_list(cache_dir) -> int:
  for path, entry, error in _index_files(cache_dir):
    name = os.path.basename(path)
    if error:
      print(f'{name}: UNUSABLE ({error})')
      continue
    updated = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(entry.updated))
    print(f'{name}: {len(entry.signatures)} signatures, torch_xla '
          f'{entry.parts.get("torch_xla_version", "?")} on '
          f'{entry.parts.get("device_kind", "?")}, updated {updated}')
    for signature in entry.signatures:
      print(f'  {_describe_signature(entry.kinds, signature)}')
  return 0


def _tree_size(path) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      total += os.path.getsize(os.path.join(root, name))
  return total


def cmd_stats(cache_dir) -> int:
  graphs = signatures = unusable = 0
  for _, entry, error in _index_files(cache_dir):
    if error:
      unusable += 1
    else:
      graphs += 1
      signatures += len(entry.signatures)
  executables = os.path.join(cache_dir, 'xla')
  print(f'graphs: {graphs}')
  print(f'signatures: {signatures}')
  print(f'unusable index files: {unusable}')
  print(f'index bytes: {_tree_size(os.path.join(cache_dir, "signatures"))}')
  print(f'persisted executable bytes: {_tree_size(executables)} (torch_xla 2.9 '
        'writes these but cannot load them back)')
  return 0


def cmd_verify(cache_dir) -> int:
  bad = 0
  for path, entry, error in _index_files(cache_dir):
    name = os.path.basename(path)
    if error is None and name != f'{entry.fingerprint}.json':
      error = f'file name does not match fingerprint {entry.fingerprint}'
    if error:
      bad += 1
      print(f'BAD {name}: {error}')
    else:
      print(f'ok  {name}: {len(entry.signatures)} signatures')
  return 1 if bad else 0


def cmd_clear(cache_dir) -> int:
  for sub in (persistent.SIGNATURES_DIR, 'xla'):
    path = os.path.join(cache_dir, sub)
    if os.path.isdir(path):
      shutil.rmtree(path)
      print(f'removed {path}')
  return 0


COMMANDS = {
    'list': cmd_list,
    'stats': cmd_stats,
    'verify': cmd_verify,
    'clear': cmd_clear
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('command', choices=sorted(COMMANDS))
  parser.add_argument('cache_dir')
  args = parser.parse_args(argv)
  if not os.path.isdir(args.cache_dir):
    print(f'{args.cache_dir} is not a directory', file=sys.stderr)
    return 2
  return COMMANDS[args.command](args.cache_dir)


if __name__ == '__main__':
  sys.exit(main())
