"""The artifact file: what `save` writes and `load` reads.

[Note: Artifact safety]
The file is a magic line, a JSON header and a pickle payload. The header holds
the payload's SHA-256 and size, the torch, torch_xla and Python versions (see
[Note: Runtime versions]), and a digest of the model's source (see
source_digest.py). `load` refuses, with `ArtifactMismatchError` naming expected
and found values, an artifact from other versions or for other source, because
the saved bytecode and graph may then compute something else. A file that is
truncated or does not parse raises `ArtifactCorruptError`. Both are
`ArtifactError`s. The payload is a pickle: load only files you trust.

The payload is torch's AOTCompiledFunction state (dynamo's bytecode, guards
and the backend's serialized callable), written by
serializable_backend.serialize_aot (see [Note: Closures in saved
functions]).
"""
import dataclasses
import hashlib
import importlib
import json
import pickle
import types
from typing import Any, Dict, List, Optional, Tuple

from torch_xla_patches import io_utils
from torch_xla_patches import versions

# 2: modules are captured through their call (module_call), not forward.
FORMAT_VERSION = 2
_MAGIC = b'TORCH_XLA_PATCHES_AOT\n'
# The header is one JSON line; anything longer than this is not our file.
_MAX_HEADER_BYTES = 1 << 20


class ArtifactError(RuntimeError):
  """An artifact that cannot be loaded; the message says why."""


class ArtifactCorruptError(ArtifactError):
  """The file is truncated, altered, or not an artifact at all."""


class ArtifactMismatchError(ArtifactError):
  """The artifact was made for other versions or other model source."""


@dataclasses.dataclass(frozen=True)
class ArtifactHeader:
  """What `load` checks before it unpickles anything but the header."""
  format_version: int
  torch_version: str
  torch_xla_version: str
  python_version: str
  # 'Block', 'DecoderLM', ... or the function's qualified name.
  model_name: str
  # SHA-256 over model_source_parts (see source_digest.source_parts).
  model_source_digest: str
  # {qualified class or function name: SHA-256 of its source}.
  model_source_parts: Dict[str, str]
  # Whether the captured function is serialization.call_module, called as
  # fn(model, args, kwargs) (see [Note: Capturing a module's call]).
  module_call: bool
  # Positional arguments of a call to warm up with: an input spec per
  # argument (see io_utils.arg_spec), or None if they cannot be rebuilt.
  example_args: Optional[List[Any]]
  payload_sha256: str
  payload_size: int
  # serve(): the parts of the ServeKey the artifact was made for (see
  # [Note: Serve key]); None for an artifact `save` wrote directly.
  serve_key: Optional[Dict[str, Any]] = None
  # How many captures of the model the payload holds (see [Note: One capture
  # per guard set] in serving.py): one is the payload itself, more a pickled
  # list of such payloads.
  captures: int = 1

  def saved_versions(self) -> versions.RuntimeVersions:
    """The versions of the process that saved the artifact."""
    return versions.RuntimeVersions(torch=self.torch_version,
                                    torch_xla=self.torch_xla_version,
                                    python=self.python_version)

  def check_runtime(self) -> None:
    saved = self.saved_versions()
    found = versions.runtime_versions()
    differing = [
        f'{label} {getattr(saved, field)} (found {getattr(found, field)})'
        for field, label in _VERSION_LABELS.items()
        if getattr(saved, field) != getattr(found, field)
    ]
    if differing:
      raise ArtifactMismatchError(
          'torch_xla_patches: the artifact was saved with ' +
          ', '.join(differing) + '; refusing to load it. Save it again with '
          'the versions of this process.')


# RuntimeVersions field -> how check_runtime's message names it.
_VERSION_LABELS = {
    'torch': 'torch',
    'torch_xla': 'torch_xla',
    'python': 'Python'
}


def version_fields() -> Dict[str, str]:
  """The ArtifactHeader fields that name this process's versions, as
  keyword arguments: ArtifactHeader(**version_fields(), ...)."""
  found = versions.runtime_versions()
  return {
      'torch_version': found.torch,
      'torch_xla_version': found.torch_xla,
      'python_version': found.python,
  }


class ClosurePickler(pickle.Pickler):
  """Pickles Python modules by name (a closure over `torch` is common; see
  [Note: Closures in saved functions])."""

  def reducer_override(self, obj):
    if isinstance(obj, types.ModuleType):
      return importlib.import_module, (obj.__name__,)
    return NotImplemented


def write(path: str, header: ArtifactHeader, payload: bytes) -> None:
  """Writes the file atomically; `header` holds the payload's digest and
  size (see [Note: Artifact safety])."""
  header_line = json.dumps(dataclasses.asdict(header),
                           sort_keys=True).encode() + b'\n'
  io_utils.atomic_write_bytes(path,
                              _MAGIC + header_line + payload,
                              prefix='.tmp-aot-')


def read_header(path: str) -> Tuple[ArtifactHeader, bytes]:
  """The header and the verified payload; ArtifactCorruptError if unusable."""
  try:
    # See [Note: Reading a cache directory never blocks].
    data = io_utils.read_regular_file(path)
  except OSError as e:
    raise ArtifactError(f'torch_xla_patches: cannot read artifact {path}: '
                        f'{e}') from None
  if not data.startswith(_MAGIC):
    raise ArtifactCorruptError(
        f'torch_xla_patches: {path} is not a torch_xla_patches artifact '
        '(no magic line)')
  end = data.find(b'\n', len(_MAGIC), len(_MAGIC) + _MAX_HEADER_BYTES)
  if end < 0:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} has no complete header')
  try:
    fields = json.loads(data[len(_MAGIC):end])
    header = ArtifactHeader(**fields)
  except (ValueError, TypeError) as e:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} has a malformed header: '
        f'{e}') from None
  if header.format_version != FORMAT_VERSION:
    raise ArtifactMismatchError(
        f'torch_xla_patches: artifact {path} has format version '
        f'{header.format_version}, expected {FORMAT_VERSION}')
  if type(header.captures) is not int or header.captures < 1:
    # Every writer saves at least one capture: a header that says otherwise
    # was made by hand or damaged, and is said as such, not loaded as none.
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} has a malformed header: '
        f'captures is {header.captures!r}, expected a count of at least 1')
  payload = data[end + 1:]
  if len(payload) != header.payload_size:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} is truncated or padded: payload '
        f'of {len(payload)} bytes, expected {header.payload_size}')
  digest = hashlib.sha256(payload).hexdigest()
  if digest != header.payload_sha256:
    raise ArtifactCorruptError(
        f'torch_xla_patches: artifact {path} is corrupt: payload SHA-256 '
        f'{digest}, expected {header.payload_sha256}')
  return header, payload
