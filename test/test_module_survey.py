"""Module survey: standard modules under torch.compile(dynamic=True) on XLA.

Each case (test/module_cases.py) runs with torch_xla_patches applied over at
least three input shapes and is compared with eager CPU, forward and backward;
see [Note: What a survey case checks]. tools/module_survey.py runs the same
cases without the patch to produce docs/module_survey.md.
"""
import os
import re
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import torch_xla

import module_cases

CASES = module_cases.cases()


@pytest.fixture(scope='module')
def patched():
  description = module_cases.enable(module_cases.PATCHED)
  if description != 'torch_xla_patches.apply()':
    import warnings
    warnings.warn(f'module survey ran with {description}')
  yield description
  module_cases.disable(module_cases.PATCHED)


def _param(case):
  # A torch_xla bug that aborts the process on 2.8 cannot be asserted there.
  marks = ([pytest.mark.requires('xla_errors_are_exceptions')]
           if case.known_failure is not None and
           case.known_failure.aborts_on_fatal_xla_errors else [])
  return pytest.param(case, marks=marks, id=case.name)


@pytest.mark.parametrize('case', [_param(c) for c in CASES])
def test_module(patched, case):
  result = module_cases.run_case(case, torch_xla.device())
  if case.known_failure is not None:
    # A torch_xla bug that breaks eager XLA too (see the repro); fail loudly
    # if it starts passing or fails differently.
    assert not result.ok, (f'{case.name} passes now: drop its known failure '
                           f'({case.known_failure.repro})')
    assert re.search(case.known_failure.match, result.error), result.details
    return
  assert result.ok, result.details
  assert result.graphs <= case.max_graphs, (
      f'{case.name}: {result.graphs} dynamo graphs for {len(case.shapes)} '
      f'shapes (at most {case.max_graphs} expected): dynamo specialized')


def test_cases_cover_three_shapes():
  for case in CASES:
    assert len(set(case.shapes)) >= 3, case.name


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))
