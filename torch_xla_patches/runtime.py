"""The versions of this process, read in one place.

[Note: Runtime versions]
`runtime_versions()` is the one reading of torch.__version__,
torch_xla.__version__ and the Python version, used by the signature index's
fingerprint (fingerprint.runtime_parts), the artifact header
(artifact.version_fields) and the supported-release check
(versions.check_supported). The fields keep local build tags
('2.9.0+cu128'): an index entry or an artifact names exactly what ran; the
release check drops them (versions.base_version). This module is small and
imports nothing of the package because the bridge's upstream rendering
carries it along with fingerprint.py.
"""
import dataclasses
import platform


@dataclasses.dataclass(frozen=True)
class RuntimeVersions:
  """The versions of this process, as the modules report them."""
  # torch.__version__, e.g. '2.9.0+cu128'.
  torch: str
  # torch_xla.__version__, e.g. '2.9.0'.
  torch_xla: str
  # platform.python_version(), e.g. '3.11.9'.
  python: str


def runtime_versions() -> RuntimeVersions:
  """The versions of this process; see [Note: Runtime versions]."""
  import torch
  import torch_xla
  return RuntimeVersions(torch=torch.__version__,
                         torch_xla=torch_xla.__version__,
                         python=platform.python_version())
