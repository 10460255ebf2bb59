"""Runs a pytorch/xla checkout's test/dynamo tests without and with the patch.

  python tools/run_upstream_tests.py --xla-src /path/to/pytorch-xla-checkout
      [--automatic-dynamic both|on|off] [--rendered] [--files A.py,B.py]
      [--columns upstream,rendered]
      [--timeout 900] [--logs DIR] [--json FILE] [--strict]
      [--upstream-results FILE] [--retries 1]

Each test/dynamo/*.py file runs as its own process, `python dynamo/FILE.py`
from the checkout's test/ directory, with the checkout's examples/ and test/
on PYTHONPATH, once per column:
  upstream          torch_xla as installed
  patched           torch_xla_patches.apply() at interpreter start (a
                    sitecustomize.py in a temporary directory; see
                    test/upstream_mode.py), XLA_PATCHES_AUTOMATIC_DYNAMIC=1
  patched, no auto  the same with XLA_PATCHES_AUTOMATIC_DYNAMIC=0: dynamo's
                    automatic dynamic shapes stay off, as torch_xla sets them
  rendered          (--rendered) the files tools/make_upstream_patch.py
                    renders, loaded in place of torch_xla's bridge and config

then prints a table with one row per file, and the regressions: a test
that fails in a column and passes upstream (tests are named by class and
method in unittest's FAIL/ERROR lines), or a file that passes upstream and
not in that column, or runs fewer tests; but the by-design failure below
(BY_DESIGN). A file that regresses is run again (--retries, 1 by default),
since two upstream tests depend on timing. Exit status 1 for regressions
with --strict. The upstream column can come from a stored --json file
(--upstream-results; tools/upstream_results_v2.9.0.json holds one) instead
of being run: .ci/run runs the patched and rendered columns against it. A
cell reads `ok 12` (12 tests
ran, all passed; `s1`: 1 skipped), `FAIL f1 e8 /20` (failures, errors, of
tests run), or, when no unittest summary was printed, `ok, no summary` or the
exit status. test_dynamo_graph_dump.py gets a fresh XLA_SAVE_TENSORS_FILE,
as upstream's run_tests.sh gives it. Logs go to --logs.

Known differences, on torch_xla 2.9.0 and the CPU device:
  * test_dynamo_dynamic_shape.py test_dynamic_shape_mix_with_non_dynamic
    counts graphs under torch_xla's default (automatic dynamic shapes off);
    apply() turns them on, so it fails in the `patched` column and passes in
    `patched, no auto`.
  * test_dynamo.py: the cases parametrized with
    torch_xla._dynamo.dynamo_backend2 (a JAX/torchax backend) error in every
    column when jax or torchax is missing.
  * test_dynamo.py test_all_cpu_tensor fails in `patched` and `patched, no
    auto`: a full gc collection inside it frees XLA constants that
    test_fallback_multiple_submodules' (cyclic) GraphModule reached, and
    DestroyXlaTensor/DestroyLtcTensor appear. Upstream frees more, but its
    fallback collector clears every counter during the compile; the patch
    clears none. `rendered` passes only because its collection falls before
    the test (docs/upstream-tests.md, "The differences").
  * test_dynamo.py test_resnet18 ('openxla') can count 9 ExecuteTime instead
    of 10, in any column: torch_xla records ExecuteTime in the execution's
    on-ready callback, which can run after output.cpu() returned. Rerun a
    single file with --files.
torchvision is needed by test_dynamo.py and test_dynamo_dynamic_shape.py; it
is not a dependency of this project (pip install torchvision==0.24.0 for
torch 2.9.0, torchvision==0.23.0 for torch 2.8.0).

Other releases: run the tool with that release's venv and the tests of the
same pytorch/xla tag, e.g. `make upstream-tests TORCH_XLA=2.8.1
XLA_SRC=<v2.8.1 checkout>`. --rendered needs torch_xla 2.9.0 (the renderer
refuses other releases).
"""
import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, 'test'))
sys.path.insert(0, os.path.join(REPO_ROOT, 'tools'))
sys.path.insert(0, REPO_ROOT)

import upstream_mode  # noqa: E402  (test/upstream_mode.py)

# Files upstream's test/run_tests.sh runs with extra settings.
# test_dynamo_graph_dump.py: run_save_tensor_ir, a fresh IR dump file.
SAVE_TENSORS_FILES = ('test_dynamo_graph_dump.py',)

_RAN = re.compile(r'^Ran (\d+) tests? in', re.MULTILINE)
# unittest's "FAIL: test_x (__main__.Class.test_x)" or, for a parametrized
# case, "ERROR: test_x1 (<function f at 0x...>) (__main__.Class)".
_FAILED_TEST = re.compile(r'^(?:FAIL|ERROR): (\S+) .*\(([^()]*)\)\s*$',
                          re.MULTILINE)
_FAILED = re.compile(r'^FAILED \(([^)]*)\)', re.MULTILINE)
_OK = re.compile(r'^OK\b', re.MULTILINE)


@dataclasses.dataclass
class Column:
  title: str
  # upstream_mode mode: '' (none), 'patched' or 'rendered'.
  mode: str
  env: Dict[str, str]


@dataclasses.dataclass
class Outcome:
  returncode: Optional[int]  # None: timed out
  ran: Optional[int]
  failures: int
  errors: int
  skipped: int
  seconds: float
  log: str
  # The tests that failed or errored, as Class.test_name.
  failed_tests: List[str] = dataclasses.field(default_factory=list)

  @property
  def passed(self) -> bool:
    return self.returncode == 0

  def cell(self) -> str:
    if self.returncode is None:
      return 'TIMEOUT'
    if self.ran is None:
      return 'ok, no summary' if self.passed else f'exit {self.returncode}'
    if self.passed and not (self.failures or self.errors):
      return f'ok {self.ran}' + (f' s{self.skipped}' if self.skipped else '')
    return f'FAIL f{self.failures} e{self.errors} /{self.ran}'


def failed_tests(output: str) -> List[str]:
  """The tests unittest reported as failed or errored, as Class.test_name
  (no addresses: they change from run to run)."""
  names = []
  for name, where in _FAILED_TEST.findall(output):
    where = where.replace('__main__.', '')
    names.append(where if where.endswith('.' + name) else f'{where}.{name}')
  return sorted(set(names))


def parse_unittest(output: str) -> Dict[str, Optional[int]]:
  """Counts from the last unittest summary in `output`."""
  counts = {'ran': None, 'failures': 0, 'errors': 0, 'skipped': 0}
  ran = _RAN.findall(output)
  if ran:
    counts['ran'] = sum(int(n) for n in ran)
  for summary in _FAILED.findall(output):
    for part in summary.split(','):
      key, _, value = part.strip().partition('=')
      if key in counts and value.isdigit():
        counts[key] += int(value)
  for match in re.finditer(r'^OK \(([^)]*)\)', output, re.MULTILINE):
    for part in match.group(1).split(','):
      key, _, value = part.strip().partition('=')
      if key == 'skipped' and value.isdigit():
        counts['skipped'] += int(value)
  return counts


def run_file(xla_src: str, test_file: str, column: Column, hook_dir: str,
             rendered_dir: Optional[str], timeout: float,
             log_dir: str) -> Outcome:
  test_dir = os.path.join(xla_src, 'test')
  base = dict(os.environ)
  # torch's test harness reads CI (any non-empty value) as "running in
  # pytorch's CI" and then writes XML reports through xmlrunner, which is no
  # dependency here: test_bridge.py (the file that calls torch's run_tests)
  # would exit at start in every column. The stored upstream column was run
  # without it; the columns compare the bridge, not the harness.
  base.pop('CI', None)
  base.setdefault('PJRT_DEVICE', 'CPU')
  base['PYTHONPATH'] = os.pathsep.join(
      [os.path.join(xla_src, 'examples'), test_dir] +
      [p for p in base.get('PYTHONPATH', '').split(os.pathsep) if p])
  base.update(column.env)
  if test_file in SAVE_TENSORS_FILES:
    dump_dir = tempfile.mkdtemp(prefix='xla-save-ir-')
    base['XLA_SAVE_TENSORS_FILE'] = os.path.join(dump_dir, 'save_ir.txt')
    base['XLA_SAVE_TENSORS_FMT'] = 'text'
  env = upstream_mode.subprocess_env(column.mode, hook_dir, rendered_dir, base)
  start = time.monotonic()
  try:
    proc = subprocess.run(
        [sys.executable, os.path.join('dynamo', test_file)],
        cwd=test_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout)
    output, returncode = proc.stdout, proc.returncode
  except subprocess.TimeoutExpired as e:
    output = e.stdout if isinstance(
        e.stdout, str) else (e.stdout or b'').decode(errors='replace')
    returncode = None
  seconds = time.monotonic() - start
  log = os.path.join(log_dir, _slug(column.title), test_file + '.log')
  os.makedirs(os.path.dirname(log), exist_ok=True)
  with open(log, 'w', encoding='utf-8') as f:
    f.write(output)
  counts = parse_unittest(output)
  return Outcome(returncode, counts['ran'], counts['failures'],
                 counts['errors'], counts['skipped'], seconds, log,
                 failed_tests(output))


def _slug(title: str) -> str:
  return re.sub(r'[^a-z0-9]+', '-', title.lower()).strip('-')


def columns_for(automatic_dynamic: str, rendered: bool) -> List[Column]:
  columns = [Column('upstream', '', {})]
  if automatic_dynamic in ('on', 'both'):
    columns.append(
        Column('patched', 'patched', {'XLA_PATCHES_AUTOMATIC_DYNAMIC': '1'}))
  if automatic_dynamic in ('off', 'both'):
    columns.append(
        Column('patched, no auto', 'patched',
               {'XLA_PATCHES_AUTOMATIC_DYNAMIC': '0'}))
  if rendered:
    columns.append(Column('rendered', 'rendered', {}))
  return columns


def format_table(files: List[str], columns: List[Column],
                 results: Dict[str, Dict[str, Outcome]]) -> str:
  header = ['file'] + [c.title for c in columns]
  rows = [[f] + [results[c.title][f].cell() for c in columns] for f in files]
  totals = ['files passed'] + [
      f'{sum(results[c.title][f].passed for f in files)}/{len(files)}'
      for c in columns
  ]
  widths = [
      max(len(r[i])
          for r in [header] + rows + [totals])
      for i in range(len(header))
  ]

  def line(cells):
    return '  '.join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

  rule = '  '.join('-' * w for w in widths)
  return '\n'.join([line(header), rule] + [line(r) for r in rows] +
                   [rule, line(totals)])


def environment_notes() -> List[str]:
  from torch_xla_patches import versions
  installed = versions.installed()
  notes = [
      f'installed: {installed.describe()}; run the tests of the same '
      'pytorch/xla tag'
  ]
  if importlib.util.find_spec('torchvision') is None:
    torchvision = versions.TORCHVISION_FOR_TORCH.get(installed.torch, '?')
    notes.append('torchvision is NOT installed: test_dynamo.py and '
                 'test_dynamo_dynamic_shape.py import it and fail in every '
                 'column. It is not a project dependency; install it with '
                 f'`pip install torchvision=={torchvision}` (for torch '
                 f'{installed.torch}).')
  missing = [
      m for m in ('jax', 'torchax') if importlib.util.find_spec(m) is None
  ]
  if missing:
    notes.append(f'{" and ".join(missing)} not installed: test_dynamo.py\'s '
                 'cases parametrized with dynamo_backend2 error in every '
                 'column.')
  return notes


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--xla-src',
                      required=True,
                      help='pytorch/xla checkout (needs test/ and examples/)')
  parser.add_argument('--automatic-dynamic',
                      choices=('on', 'off', 'both'),
                      default='both',
                      help='patched columns: with XLA_PATCHES_AUTOMATIC_DYNAMIC'
                      ' 1, 0 or both')
  parser.add_argument('--rendered',
                      action='store_true',
                      help='add a column for the rendered upstream patch')
  parser.add_argument('--columns',
                      default='',
                      help='comma-separated columns to run, out of those the '
                      'other options select: upstream, patched, '
                      'patched-no-auto, rendered (default: all of them); '
                      'regressions need the upstream column')
  parser.add_argument('--files',
                      default='',
                      help='comma-separated test/dynamo file names (default: '
                      'all test_*.py)')
  parser.add_argument('--timeout',
                      type=float,
                      default=900,
                      help='seconds per file and column')
  parser.add_argument('--logs',
                      default=os.path.join(REPO_ROOT, 'build',
                                           'upstream-tests'),
                      help='directory for the per-file logs')
  parser.add_argument('--json', help='also write the results here')
  parser.add_argument('--upstream-results',
                      help='a --json file whose upstream column stands for '
                      'the upstream column when it is not run')
  parser.add_argument('--retries',
                      type=int,
                      default=1,
                      help='runs of a file again when it regresses')
  parser.add_argument('--strict',
                      action='store_true',
                      help='exit 1 when a file that passes upstream fails in '
                      'another column')
  args = parser.parse_args(argv)

  xla_src = os.path.abspath(args.xla_src)
  dynamo_dir = os.path.join(xla_src, 'test', 'dynamo')
  if not os.path.isdir(dynamo_dir):
    print(
        f'run_upstream_tests: {dynamo_dir} does not exist; pass a '
        'pytorch/xla checkout with XLA_SRC=...',
        file=sys.stderr)
    return 2
  if args.files:
    files = [f.strip() for f in args.files.split(',') if f.strip()]
  else:
    files = sorted(
        os.path.basename(p)
        for p in glob.glob(os.path.join(dynamo_dir, 'test_*.py')))
  unknown = [
      f for f in files if not os.path.exists(os.path.join(dynamo_dir, f))
  ]
  if unknown:
    print(f'run_upstream_tests: no such files in {dynamo_dir}: {unknown}',
          file=sys.stderr)
    return 2
  notes = environment_notes()
  for note in notes:
    print(f'NOTE: {note}', flush=True)

  columns = columns_for(args.automatic_dynamic, args.rendered)
  if args.columns:
    wanted = {_slug(c) for c in args.columns.split(',') if c.strip()}
    known = [_slug(c.title) for c in columns]
    if wanted - set(known):
      print(
          f'run_upstream_tests: no such columns: {sorted(wanted - set(known))}'
          f'; choose from {known}',
          file=sys.stderr)
      return 2
    columns = [c for c in columns if _slug(c.title) in wanted]
  with tempfile.TemporaryDirectory(prefix='xla-upstream-tests-') as tmp:
    hook_dir = os.path.join(tmp, 'hook')
    upstream_mode.write_sitecustomize(hook_dir)
    rendered_dir = None
    if args.rendered:
      import make_upstream_patch
      rendered_dir = os.path.join(tmp, 'rendered')
      try:
        make_upstream_patch.render(rendered_dir)
      except make_upstream_patch.RefusedError as e:
        print(f'run_upstream_tests: cannot render the patch: {e}',
              file=sys.stderr)
        return 2
    results: Dict[str, Dict[str, Outcome]] = {c.title: {} for c in columns}
    for test_file in files:
      for column in columns:
        outcome = run_file(xla_src, test_file, column, hook_dir, rendered_dir,
                           args.timeout, args.logs)
        results[column.title][test_file] = outcome
        print(
            f'{test_file:40s} {column.title:18s} {outcome.cell():20s} '
            f'{outcome.seconds:6.1f}s',
            flush=True)

  print()
  print(format_table(files, columns, results))
  for note in notes:
    print(f'NOTE: {note}')
  print(f'logs: {args.logs}')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(
          {
              c.title: {
                  name: dataclasses.asdict(o)
                  for name, o in results[c.title].items()
              } for c in columns
          },
          f,
          indent=2)
  baseline = results.get('upstream')
  if baseline is None and args.upstream_results:
    baseline = load_upstream_results(args.upstream_results)
    print(f'upstream column: stored in {args.upstream_results}')
  regressions = []
  regressed = []
  for column in (c for c in columns if c.title != 'upstream'):
    for test_file in files:
      if baseline is None or test_file not in baseline:
        continue
      outcome = results[column.title][test_file]
      found = regressions_of(baseline[test_file], outcome, column.title,
                             test_file)
      for attempt in range(args.retries):
        if not found:
          break
        # Timing-dependent upstream tests (see above): run the file again.
        print(
            f'{test_file} regressed in "{column.title}"; run again '
            f'({attempt + 1} of {args.retries})',
            flush=True)
        outcome = run_file(xla_src, test_file, column, hook_dir, rendered_dir,
                           args.timeout, args.logs)
        found = regressions_of(baseline[test_file], outcome, column.title,
                               test_file)
      regressions.extend(found)
      if found:
        regressed.append((column.title, test_file, outcome))
  for regression in regressions:
    print(f'regression: {regression}')
  for title, test_file, outcome in regressed:
    print_log_tail(outcome, f'{test_file} "{title}"')
  if baseline is not None:
    print(f'regressions against upstream: {len(regressions)}')
  return 1 if regressions and args.strict else 0


# Tests whose failure in a column is the patch's design, by column title
# and file: automatic dynamic shapes (apply() turns them on) replace the
# re-trace this test asserts.
BY_DESIGN = {
    ('patched', 'test_dynamo_dynamic_shape.py'): {
        'DynamoDynamicShapeBasicTest.test_dynamic_shape_mix_with_non_dynamic'
    },
}


def print_log_tail(outcome: Outcome, title: str, lines: int = 15) -> None:
  """The end of a failing file's log, so that a CI log alone says why."""
  try:
    with open(outcome.log, encoding='utf-8', errors='replace') as f:
      tail = f.read().splitlines()[-lines:]
  except OSError:
    return
  print(f'--- {title}: last {len(tail)} lines of {outcome.log}')
  for line in tail:
    print(f'    {line}')


def regressions_of(before: Outcome, after: Outcome, column: str,
                   test_file: str) -> List[str]:
  """What `after` (a file's outcome in `column`) does worse than `before`
  (upstream's): a test that fails only here, but by design, or, where no
  test is named, a file that passes upstream and not here."""
  allowed = set(before.failed_tests) | BY_DESIGN.get((column, test_file), set())
  new = [name for name in after.failed_tests if name not in allowed]
  if new:
    return [
        f'{test_file} "{column}": {name} fails, passes upstream' for name in new
    ]
  if before.passed and not after.passed and not after.failed_tests:
    return [f'{test_file} passes upstream, not in "{column}" ({after.cell()})']
  if after.ran is not None and before.ran is not None and after.ran < before.ran:
    return [
        f'{test_file} "{column}": ran {after.ran} tests, {before.ran} '
        'upstream'
    ]
  return []


def load_upstream_results(path: str) -> Dict[str, Outcome]:
  """The upstream column of a --json file."""
  with open(path, encoding='utf-8') as f:
    stored = json.load(f)['upstream']
  return {name: Outcome(**fields) for name, fields in stored.items()}


if __name__ == '__main__':
  sys.exit(main())
