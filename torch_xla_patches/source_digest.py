"""A digest of a model's source: which code an artifact was saved for.

`source_parts(model)` maps the qualified name of every nn.Module class in a
model (or of a function) to the SHA-256 of its source; `digest(parts)` folds
them into one. A class with no source file to read (a REPL, exec) is hashed
by its functions' bytecode, names and constants, which change with the
source too.
"""
import hashlib
import inspect
import json
import types
from typing import Any, Dict

import torch


def _source_of(obj: Any) -> str:
  try:
    return inspect.getsource(obj)
  except (OSError, TypeError):
    # No source file to read (a REPL, exec, a renamed class): fall back to
    # the compiled code of its functions, which changes with the source.
    codes = []
    if inspect.isclass(obj):
      for name, member in sorted(vars(obj).items()):
        if inspect.isfunction(member):
          codes.append(f'{name}:{_code_text(member.__code__)}')
    elif hasattr(obj, '__code__'):
      codes.append(_code_text(obj.__code__))
    return '\n'.join(codes)


def _code_text(code: types.CodeType) -> str:
  """Bytecode, names and constants (nested code too) of a code object."""
  consts = [
      _code_text(c) if isinstance(c, types.CodeType) else repr(c)
      for c in code.co_consts
  ]
  return f'{code.co_code.hex()}|{code.co_names}|{consts}'


def source_parts(model: Any) -> Dict[str, str]:
  """{name: SHA-256 of source} of every module class in `model`, or of the
  function `model`."""
  if isinstance(model, torch.nn.Module):
    objects = {}
    for module in model.modules():
      cls = type(module)
      objects[f'{cls.__module__}.{cls.__qualname__}'] = cls
  else:
    fn = getattr(model, '__func__', model)
    objects = {f'{fn.__module__}.{fn.__qualname__}': fn}
  return {
      name: hashlib.sha256(_source_of(obj).encode()).hexdigest()
      for name, obj in sorted(objects.items())
  }


def digest(parts: Dict[str, str]) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def model_name(model: Any) -> str:
  if isinstance(model, torch.nn.Module):
    return type(model).__qualname__
  return getattr(model, '__qualname__', repr(model))
