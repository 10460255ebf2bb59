"""The on-disk signature index: which shape signatures each graph has seen.

Layout: <cache_dir>/signatures/<fingerprint key>.json, one file per graph
fingerprint (see [Note: Graph fingerprint]):
  {"format_version": 1, "fingerprint": key, "parts": {name: value},
   "kinds": [arg kinds], "signatures": [[input spec per position], ...]}
An input spec is null (a parameter or static tensor, taken from the live
call), {"value": v} for a number, or {"shape": [...], "dtype": "float32"} for
a tensor with symbolic sizes.

[Note: Index file safety]
Writers take an exclusive flock on <file>.lock, read the current file, add
their signatures (a set union), write a temp file in the same directory,
fsync it and rename it over the old one. Readers never see a partial file,
and concurrent writers never lose each other's signatures. A file that does
not parse, has another format version, or names another fingerprint is
ignored with a warning: the index only ever chooses which signatures to
compile from the live graph, so ignoring it costs time, never correctness.
"""
import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches.fingerprint import GraphFingerprint
from torch_xla_patches.signature import ArgKind, ArgLayout

FORMAT_VERSION = 1
SIGNATURES_DIR = 'signatures'

InputSpec = Optional[Dict[str, Any]]


def _dtype_name(dtype: torch.dtype) -> str:
  return str(dtype).replace('torch.', '')


def _dtype_from_name(name: str) -> torch.dtype:
  dtype = getattr(torch, name, None)
  if not isinstance(dtype, torch.dtype):
    raise ValueError(f'unknown dtype {name!r}')
  return dtype


def tensor_spec(tensor: torch.Tensor) -> Dict[str, Any]:
  """A tensor's sizes and dtype, as recorded in index files and artifacts."""
  return {
      'shape': [int(s) for s in tensor.shape],
      'dtype': _dtype_name(tensor.dtype)
  }


def zeros_on_device(shape: Sequence[int], dtype: torch.dtype,
                    device: Any) -> torch.Tensor:
  """Zeros made on the host and copied: zeros made on the device would be a
  small XLA program of their own, compiled once per shape."""
  return torch.zeros(tuple(shape), dtype=dtype).to(device)


def tensor_from_spec(spec: Dict[str, Any], device: Any) -> torch.Tensor:
  return zeros_on_device(spec['shape'], _dtype_from_name(spec['dtype']), device)


def input_specs(layout: ArgLayout,
                args: Sequence[Any]) -> Tuple[InputSpec, ...]:
  """What must be recorded to rebuild `args` for a later trace."""
  specs: List[InputSpec] = []
  for kind, arg in zip(layout.kinds, args):
    if kind in (ArgKind.SHAPE, ArgKind.SCALAR):
      specs.append({'value': arg})
    elif kind == ArgKind.DYNAMIC_TENSOR:
      specs.append(tensor_spec(arg))
    else:
      specs.append(None)
  return tuple(specs)


def rebuild_args(layout: ArgLayout, specs: Sequence[InputSpec],
                 live_args: Sequence[Any], device: Any) -> List[Any]:
  """Arguments for tracing a recorded signature: live parameters and static
  tensors, zero tensors of the recorded sizes, recorded numbers."""
  if len(specs) != len(layout.kinds):
    raise ValueError(f'recorded signature has {len(specs)} inputs, the graph '
                     f'has {len(layout.kinds)}')
  args = []
  for kind, spec, live in zip(layout.kinds, specs, live_args):
    if kind in (ArgKind.SHAPE, ArgKind.SCALAR):
      args.append(spec['value'])
    elif kind == ArgKind.DYNAMIC_TENSOR:
      args.append(tensor_from_spec(spec, device))
    else:
      args.append(live)
  return args


def _freeze(specs: Sequence[InputSpec]) -> str:
  return json.dumps(list(specs), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class IndexFile:
  """One graph's entry as read from disk."""
  path: str
  fingerprint: str
  parts: Dict[str, str]
  kinds: Tuple[str, ...]
  signatures: Tuple[Tuple[InputSpec, ...], ...]
  updated: float


class IndexFileError(ValueError):
  """An index file that cannot be used; the message says why."""


def _parse(path: str, data: Any) -> IndexFile:
  if not isinstance(data, dict):
    raise IndexFileError('not a JSON object')
  if data.get('format_version') != FORMAT_VERSION:
    raise IndexFileError(f'format version {data.get("format_version")!r}, '
                         f'expected {FORMAT_VERSION}')
  try:
    signatures = tuple(tuple(sig) for sig in data['signatures'])
    kinds = tuple(data['kinds'])
    parts = dict(data['parts'])
    fingerprint = str(data['fingerprint'])
  except (KeyError, TypeError, ValueError) as e:
    raise IndexFileError(f'missing or malformed field: {e}') from None
  for sig in signatures:
    if len(sig) != len(kinds):
      raise IndexFileError('a signature does not match the input kinds')
  return IndexFile(path, fingerprint, parts, kinds, signatures,
                   float(data.get('updated', 0)))


def read_index_file(path: str) -> IndexFile:
  try:
    with open(path, 'r') as f:
      data = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise IndexFileError(f'unreadable: {e}') from None
  return _parse(path, data)


class SignatureIndex:
  """The signature index under one cache directory."""

  def __init__(self, cache_dir: str):
    self.cache_dir = cache_dir
    self.directory = os.path.join(cache_dir, SIGNATURES_DIR)

  def path_for(self, fingerprint_key: str) -> str:
    return os.path.join(self.directory, f'{fingerprint_key}.json')

  def files(self) -> Iterator[str]:
    if not os.path.isdir(self.directory):
      return iter(())
    return (os.path.join(self.directory, name)
            for name in sorted(os.listdir(self.directory))
            if name.endswith('.json'))

  def load(self, fingerprint: GraphFingerprint,
           layout: ArgLayout) -> List[Tuple[InputSpec, ...]]:
    """Recorded signatures of this graph; [] with a warning if unusable."""
    path = self.path_for(fingerprint.key)
    if not os.path.exists(path):
      return []
    try:
      entry = read_index_file(path)
      if entry.fingerprint != fingerprint.key:
        raise IndexFileError(f'names fingerprint {entry.fingerprint}')
      kinds = tuple(kind.value for kind in layout.kinds)
      if entry.kinds != kinds:
        raise IndexFileError('input kinds differ from the live graph')
    except IndexFileError as e:
      warnings.warn(f'torch_xla_patches: ignoring signature index {path}: {e}')
      return []
    return list(entry.signatures)

  @contextlib.contextmanager
  def _locked(self, path: str):
    os.makedirs(self.directory, exist_ok=True)
    with open(path + '.lock', 'a') as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)

  def record(self, fingerprint: GraphFingerprint, layout: ArgLayout,
             signatures: Sequence[Sequence[InputSpec]]) -> None:
    """Adds signatures to this graph's file; see [Note: Index file safety]."""
    path = self.path_for(fingerprint.key)
    kinds = [kind.value for kind in layout.kinds]
    try:
      with self._locked(path):
        known: List[Sequence[InputSpec]] = []
        if os.path.exists(path):
          try:
            entry = read_index_file(path)
            if entry.fingerprint == fingerprint.key and list(
                entry.kinds) == kinds:
              known = list(entry.signatures)
            else:
              warnings.warn(f'torch_xla_patches: replacing signature index '
                            f'{path}: it describes another graph')
          except IndexFileError as e:
            warnings.warn(
                f'torch_xla_patches: replacing signature index {path}: {e}')
        seen = {_freeze(sig) for sig in known}
        merged = list(known)
        for sig in signatures:
          if _freeze(sig) not in seen:
            seen.add(_freeze(sig))
            merged.append(list(sig))
        payload = {
            'format_version': FORMAT_VERSION,
            'fingerprint': fingerprint.key,
            'parts': fingerprint.as_dict(),
            'kinds': kinds,
            'signatures': [list(sig) for sig in merged],
            'updated': time.time(),
        }
        _atomic_write_json(path, payload)
    except OSError as e:
      warnings.warn(f'torch_xla_patches: could not write signature index '
                    f'{path}: {e}')

  def explain_miss(self, fingerprint: GraphFingerprint) -> str:
    """Why no file matches: the closest stored graph and its differing parts."""
    best: Optional[Tuple[List[str], str]] = None
    for path in self.files():
      try:
        entry = read_index_file(path)
      except IndexFileError:
        continue
      differing = fingerprint.differing_parts(entry.parts)
      if best is None or len(differing) < len(best[0]):
        best = (differing, path)
    if best is None:
      return 'no graph is recorded in this cache directory yet'
    return (f'closest recorded graph {os.path.basename(best[1])} differs in: ' +
            ', '.join(best[0]))


def atomic_write_bytes(path: str, data: bytes, prefix: str = '.tmp-') -> None:
  """Writes `data` to a temp file beside `path`, fsyncs it, renames it over
  `path`: readers see the old file or the new one, never a part."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=prefix)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp_path, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp_path)
    raise


def _atomic_write_json(path: str, payload: Dict[str, Any]) -> None:
  atomic_write_bytes(path,
                     json.dumps(payload, indent=1, sort_keys=True).encode())
