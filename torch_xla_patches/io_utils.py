"""File and tensor helpers shared by the index, warm-up and serialization.

Tensors are described in records by a tensor spec, {"shape": [...],
"dtype": "float32"}; `canonical_json` is the one way a record is frozen to a
string (for identities and de-duplication).
"""
import contextlib
import json
import os
import tempfile
from typing import Any, Dict, Sequence

import torch


def dtype_name(dtype: torch.dtype) -> str:
  return str(dtype).replace('torch.', '')


def dtype_from_name(name: Any) -> torch.dtype:
  dtype = getattr(torch, name, None) if isinstance(name, str) else None
  if not isinstance(dtype, torch.dtype):
    raise ValueError(f'unknown dtype {name!r}')
  return dtype


def tensor_spec(tensor: torch.Tensor) -> Dict[str, Any]:
  """A tensor's sizes and dtype, as records and artifacts hold them."""
  return {
      'shape': [int(s) for s in tensor.shape],
      'dtype': dtype_name(tensor.dtype)
  }


def describe_tensor_spec(spec: Dict[str, Any]) -> str:
  return f'{spec["dtype"]}{list(spec["shape"])}'


def arg_spec(arg: Any) -> Dict[str, Any]:
  """How records hold an argument: a tensor spec, or {"value": number}."""
  if isinstance(arg, torch.Tensor):
    return tensor_spec(arg)
  return {'value': arg}


def arg_from_spec(spec: Dict[str, Any], device: Any) -> Any:
  """The argument `arg_spec` described: zeros of its sizes, or the number."""
  if 'value' in spec:
    return spec['value']
  return tensor_from_spec(spec, device)


def describe_arg_spec(spec: Dict[str, Any]) -> str:
  if 'value' in spec:
    return repr(spec['value'])
  return describe_tensor_spec(spec)


def zeros_on_device(shape: Sequence[int], dtype: torch.dtype,
                    device: Any) -> torch.Tensor:
  """Zeros made on the host and copied: zeros made on the device would be a
  small XLA program of their own, compiled once per shape."""
  return torch.zeros(tuple(shape), dtype=dtype).to(device)


def tensor_from_spec(spec: Dict[str, Any], device: Any) -> torch.Tensor:
  return zeros_on_device(spec['shape'], dtype_from_name(spec['dtype']), device)


def canonical_json(value: Any) -> str:
  return json.dumps(value, sort_keys=True, separators=(',', ':'))


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


def atomic_write_json(path: str, payload: Any) -> None:
  atomic_write_bytes(path,
                     json.dumps(payload, indent=1, sort_keys=True).encode())
