"""ServeKey: everything that decides whether a serve() artifact applies.

[Note: Serve key]
An artifact holds dynamo's capture of one model's call: bytecode that reads
the model's parameters by name, guards, and a graph whose shapes and
constants follow the model's configuration. It applies to a model and its
buckets only where all of these match, each one a named part of the key:
  * model: the served class's qualified name (also the file name's prefix);
  * source: the source digest of every module class in the model
    (source_digest.source_parts);
  * versions: torch, torch_xla and Python (runtime.runtime_versions);
  * arguments: the buckets' layout (CallSpec.layout: structure, dtypes,
    ranks, constants), or each of their layouts once where they differ;
  * state: every parameter's and buffer's name, dtype and shape;
  * configuration: every plain value a module of the model holds (bool, int,
    float, str, None and tuples of them, in the module's __dict__), and the
    plain values of any configuration object it holds (Hugging Face's
    PretrainedConfig, through to_dict()), once per object;
  * shardings: under SPMD, each bucket's tensor shardings and each
    parameter's and buffer's sharding spec (dynamo guards neither, and each
    picks other XLA programs);
  * capture: the aot_compile settings (dynamic, size_oblivious, guard
    filter);
  * formats: the artifact's and the compiled graph's format versions.
Left out on purpose: parameter values (the graph takes them as inputs, so a
fine-tuned checkpoint of one configuration reuses the artifact), and the
device kind, device count and XLA flags (the artifact holds no executable:
every program is compiled in the process that loads it).

The key's digest names the artifact file, and its parts are written in the
artifact's header, so a process that finds no artifact of its key can say
which parts the closest other artifact of the model differs in.
"""
import dataclasses
import hashlib
from typing import Any, Dict, List, Optional

import torch

from torch_xla_patches import io_utils
from torch_xla_patches import runtime
from torch_xla_patches import source_digest

# Values of a module's __dict__ that are configuration, and the most items
# of one tuple or list taken as one.
_PLAIN = (bool, int, float, str, type(None))
_MAX_SEQUENCE = 64


@dataclasses.dataclass(frozen=True)
class ServeKey:
  """The parts of [Note: Serve key], each JSON-able."""
  model: str
  source: Dict[str, str]
  versions: Dict[str, str]
  arguments: Any
  state: List[List[Any]]
  configuration: Dict[str, Any]
  shardings: Dict[str, Any]
  capture: Dict[str, Any]
  formats: Dict[str, int]

  @classmethod
  def of(cls, model: torch.nn.Module, arguments: Any, shardings: Dict[str, Any],
         capture: Dict[str, Any], formats: Dict[str, int]) -> 'ServeKey':
    return cls(model=source_digest.model_name(model),
               source=source_digest.source_parts(model),
               versions=dataclasses.asdict(runtime.runtime_versions()),
               arguments=arguments,
               state=state_of(model),
               configuration=configuration_of(model),
               shardings=dict(shardings),
               capture=dict(capture),
               formats=dict(formats))

  def parts(self) -> Dict[str, Any]:
    # Round-tripped through JSON so that it compares equal to a header's.
    return io_utils.json_round_trip(dataclasses.asdict(self))

  def digest(self) -> str:
    return hashlib.sha256(io_utils.canonical_json(
        self.parts()).encode()).hexdigest()[:16]

  def differences(self, other: Optional[Dict[str, Any]]) -> List[str]:
    """How `other` (another artifact's parts) differs from this key, one
    entry per differing part with its first differing items."""
    if not isinstance(other, dict):
      return ['the artifact has no serve key (written by another format)']
    ours = self.parts()
    found = []
    for field in dataclasses.fields(self):
      name, value = field.name, ours[field.name]
      theirs = other.get(name)
      if theirs != value:
        found.append(f'{name}: {_first_differences(theirs, value)}')
    return found


def _first_differences(theirs: Any, ours: Any, limit: int = 3) -> str:
  if isinstance(theirs, dict) and isinstance(ours, dict):
    names = [
        name for name in sorted(set(theirs) | set(ours))
        if theirs.get(name) != ours.get(name)
    ]
    shown = '; '.join(f'{name} {_short(theirs.get(name, "absent"))} -> '
                      f'{_short(ours.get(name, "absent"))}'
                      for name in names[:limit])
    more = f' (and {len(names) - limit} more)' if len(names) > limit else ''
    return shown + more
  if isinstance(theirs, list) and isinstance(ours, list) and all(
      isinstance(item, list) and item for item in theirs + ours):
    # [name, ...] rows (state): compare by name.
    return _first_differences({row[0]: row[1:] for row in theirs},
                              {row[0]: row[1:] for row in ours}, limit)
  return f'{_short(theirs)} -> {_short(ours)}'


def _short(value: Any, width: int = 60) -> str:
  text = io_utils.canonical_json(value) if not isinstance(value, str) else value
  return text if len(text) <= width else text[:width - 3] + '...'


def state_of(model: torch.nn.Module) -> List[List[Any]]:
  """[name, dtype, shape] of every parameter and buffer, in order."""
  rows = []
  for kind, named in (('parameter', model.named_parameters()),
                      ('buffer', model.named_buffers())):
    for name, tensor in named:
      rows.append([
          name, kind,
          io_utils.dtype_name(tensor.dtype),
          [int(size) for size in tensor.shape]
      ])
  return rows


def configuration_of(model: torch.nn.Module) -> Dict[str, Any]:
  """{path: value} of the configuration values the modules of `model` hold
  (see [Note: Serve key])."""
  found: Dict[str, Any] = {}
  seen_objects = set()
  for prefix, module in model.named_modules():
    for name, value in sorted(vars(module).items()):
      if name.startswith('_') or name == 'training':
        continue
      path = f'{prefix}.{name}' if prefix else name
      plain = _plain(value)
      if plain is not _NOT_PLAIN:
        found[path] = plain
      elif callable(getattr(value, 'to_dict',
                            None)) and not isinstance(value, torch.nn.Module):
        if id(value) in seen_objects:
          continue
        seen_objects.add(id(value))
        try:
          items = value.to_dict()
        except Exception:  # pylint: disable=broad-except
          # A to_dict() that fails is no configuration we can key on; the
          # source and state parts still are.
          continue
        if isinstance(items, dict):
          for key, item in sorted(items.items(), key=lambda kv: str(kv[0])):
            plain = _plain(item)
            if plain is not _NOT_PLAIN:
              found[f'{path}.{key}'] = plain
  return found


_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
  if isinstance(value, _PLAIN):
    if isinstance(value, float) and value != value:
      return 'nan'
    return value
  if isinstance(value, (tuple, list)) and len(value) <= _MAX_SEQUENCE:
    items = [_plain(item) for item in value]
    if all(item is not _NOT_PLAIN for item in items):
      return items
  if isinstance(value, dict) and len(value) <= _MAX_SEQUENCE and all(
      isinstance(key, str) for key in value):
    items = {key: _plain(item) for key, item in value.items()}
    if all(item is not _NOT_PLAIN for item in items.values()):
      return items
  if isinstance(value, torch.dtype):
    return io_utils.dtype_name(value)
  return _NOT_PLAIN
