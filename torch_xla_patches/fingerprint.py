"""The fingerprint of a graph for the persistent signature index.

[Note: Graph fingerprint]
A fingerprint is a SHA-256 over an ordered list of named parts, each hashed
on its own so a miss can be explained part by part:
  graph_code       FX code of the graph the bridge received
  input_metadata   kind, dtype and (symbolic) sizes of every graph input
  torch_version, torch_xla_version, python_version
  device_kind, device_count
  xla_flags        XLA_FLAGS, LIBTPU_INIT_ARGS and the XLA_* variables that
                   can change programs (see [Note: Flags that change programs])
  spmd             whether SPMD is on
Left out on purpose: parameter values (they are graph inputs, not part of the
program) and anything that differs between runs of the same program (object
ids, temp paths). The index never supplies a compiled program, only the list
of signatures to compile from the live graph, so a stale entry can cost
compile time but can never run the wrong program.
"""
import dataclasses
import hashlib
import os
from typing import Any, Dict, List, Optional

import torch

from torch_xla_patches import config
from torch_xla_patches.runtime import runtime_versions
from torch_xla_patches.signature import ArgLayout, placeholder_values


@dataclasses.dataclass(frozen=True)
class FingerprintPart:
  name: str
  # Human-readable value (kept in the index file, shown when explaining).
  value: str

  @property
  def digest(self) -> str:
    return hashlib.sha256(self.value.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class GraphFingerprint:
  parts: tuple  # Tuple[FingerprintPart, ...], in a fixed order

  @property
  def key(self) -> str:
    combined = hashlib.sha256()
    for part in self.parts:
      combined.update(part.name.encode())
      combined.update(part.digest.encode())
    return combined.hexdigest()[:32]

  def as_dict(self) -> Dict[str, str]:
    return {part.name: part.value for part in self.parts}

  def differing_parts(self, other: Dict[str, str]) -> List[str]:
    """Names of the parts whose values differ from `other` (a stored dict)."""
    mine = self.as_dict()
    return [
        name for name in list(mine) + [n for n in other if n not in mine]
        if mine.get(name) != other.get(name)
    ]


def _describe_value(value: Any) -> str:
  if isinstance(value, torch.Tensor):
    sizes = ','.join(str(s) for s in value.shape)
    return f'tensor({value.dtype};[{sizes}])'
  if value is None:
    return 'unknown'
  return type(value).__name__


def _input_metadata(xla_model: Optional[torch.fx.GraphModule],
                    layout: ArgLayout) -> str:
  values = placeholder_values(xla_model, len(layout.kinds))
  return ';'.join(f'{kind.value}:{_describe_value(value)}'
                  for kind, value in zip(layout.kinds, values))


def _changes_program(name: str) -> bool:
  """Whether environment variable `name` can change a compiled program."""
  if name == 'LIBTPU_INIT_ARGS':
    return True
  if not name.startswith('XLA_'):
    return False
  flag = config.FLAGS.get(name)
  if flag is not None:
    return flag.changes_program
  if name.startswith('XLA_PATCHES_'):
    # Read by nothing in the package (tests and tools use a few).
    return False
  return name not in config.XLA_ENV_NOT_IN_PROGRAM


def _xla_flags() -> str:
  items = sorted((name, value)
                 for name, value in os.environ.items()
                 if _changes_program(name))
  return ';'.join(f'{name}={value}' for name, value in items)


def runtime_parts() -> List[FingerprintPart]:
  """The parts that describe the process rather than the graph."""
  import torch_xla.runtime as xr
  found = runtime_versions()
  return [
      FingerprintPart('torch_version', found.torch),
      FingerprintPart('torch_xla_version', found.torch_xla),
      FingerprintPart('python_version', found.python),
      FingerprintPart('device_kind', str(xr.device_type())),
      FingerprintPart('device_count', str(xr.global_runtime_device_count())),
      FingerprintPart('xla_flags', _xla_flags()),
      FingerprintPart('spmd', str(xr.is_spmd())),
  ]


def graph_fingerprint(xla_model: Optional[torch.fx.GraphModule],
                      layout: ArgLayout) -> GraphFingerprint:
  code = xla_model.code if xla_model is not None else ''
  parts = [
      FingerprintPart('graph_code', code.strip()),
      FingerprintPart('input_metadata', _input_metadata(xla_model, layout)),
  ]
  return GraphFingerprint(tuple(parts + runtime_parts()))
