"""The signature index: the shape signatures each graph has seen, and how
often and how recently each was served, in a cache directory.

Layout (format 2), one directory per graph fingerprint (see [Note: Graph
fingerprint]), under <cache_dir>/signatures/<fingerprint key>/:
  graph.json                the fingerprint's parts and the graph's input kinds
  sig-<id>.json             one recorded signature (see record.py)
  usage-<writer>-<n>.json   what one process served between two flushes
  snapshot-<generation>.json  usage summed over the usage files it covers
  claim-<generation>        taken by the compaction that writes that snapshot

[Note: Index writes without locks]
Shared file systems (NFS without a lock daemon, GCS FUSE) may not support
flock, so no writer locks anything. Every file is written once, to a temp file
renamed into place, and never changed afterwards:
  * sig-<id>.json is named by a digest of its content, so processes recording
    the same signature write the same bytes;
  * a usage file is named by its writer (host, pid, a random token) and a
    sequence number, so no two processes write the same name;
  * a compaction (more than COMPACT_USAGE_FILES usage files, or more records
    than the index's max_signatures) first creates claim-<generation> with
    O_EXCL; if another process holds a fresh claim, or the file system has no
    exclusive create, it does nothing. It writes snapshot-<generation>, which
    names the usage files it summed, then removes those, older snapshots and
    claims, and the records over the cap (least served first).
Readers take the newest snapshot that parses and add the usage files it does
not cover. A reader racing a compaction may undercount usage for that one
read; concurrent writers never lose each other's records, and a record leaves
the index only by the cap.

Every file is read as untrusted data (see [Note: Records are untrusted] and
[Note: Reading a cache directory never blocks]): a file that fails a check is
reported with its path and the reason and skipped, never fatal.
"""
import dataclasses
import errno
import atexit
import collections
import itertools
import json
import logging
import os
import re
import secrets
import socket
import time
import weakref
from typing import (Any, DefaultDict, Dict, Hashable, List, Optional, Sequence,
                    Tuple)

from torch_xla_patches import io_utils
from torch_xla_patches.fingerprint import FingerprintPart, GraphFingerprint
from torch_xla_patches.record import (RecordError, RecordedSignature, is_count,
                                      is_finite_number, parse_specs,
                                      parse_shardings, record_id_of, short)
from torch_xla_patches.signature import ArgKind, ArgLayout

logger = logging.getLogger('torch_xla_patches.index')

FORMAT_VERSION = 2
SIGNATURES_DIR = 'signatures'
GRAPH_FILE = 'graph.json'
RECORD_PREFIX = 'sig-'
USAGE_PREFIX = 'usage-'
SNAPSHOT_PREFIX = 'snapshot-'
CLAIM_PREFIX = 'claim-'
TEMP_PREFIX = '.tmp-'
# A flush that leaves more usage files than this compacts them.
COMPACT_USAGE_FILES = 32
# A claim this old with no snapshot of its generation belongs to a
# compaction that died; the next one may take a later generation.
CLAIM_TIMEOUT_SECONDS = 300.0
# No index file is larger: a record is a few hundred bytes, a snapshot holds
# two numbers per signature.
MAX_FILE_BYTES = 16 << 20
# Temp files this old were left by a writer that died.
STALE_TEMP_SECONDS = 3600.0


@dataclasses.dataclass(frozen=True)
class IndexProblem:
  """A file of the index that was skipped."""
  path: str
  reason: str


@dataclasses.dataclass(frozen=True)
class IndexContents:
  """What the index holds for one graph."""
  # Most served first, then most recently served; at most the cap.
  records: Tuple[RecordedSignature, ...]
  # Record files that failed a check, one per file.
  problems: Tuple[IndexProblem, ...]
  # Records past the index's max_signatures, left for compaction to drop.
  over_cap: int = 0


@dataclasses.dataclass
class _Usage:
  served: int = 0
  last_served: float = 0.0

  def add(self, served: int, last_served: float) -> None:
    self.served += served
    self.last_served = max(self.last_served, last_served)


def _read_json(path: str) -> Any:
  try:
    data = io_utils.read_regular_file(path, MAX_FILE_BYTES)
    if len(data) > MAX_FILE_BYTES:
      raise RecordError(f'larger than {MAX_FILE_BYTES} bytes')
    return json.loads(data)
  except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
    raise RecordError(f'unreadable: {e}') from None


def _check_format(data: Any) -> None:
  if not isinstance(data, dict):
    raise RecordError('not a JSON object')
  if data.get('format_version') != FORMAT_VERSION:
    raise RecordError(f'format version {short(data.get("format_version"))}, '
                      f'expected {FORMAT_VERSION}')


def _parse_usage_map(raw: Any) -> Dict[str, _Usage]:
  if not isinstance(raw, dict):
    raise RecordError('"served" is not an object')
  usage = {}
  for record_id, value in raw.items():
    if not (isinstance(value, list) and len(value) == 2 and
            is_count(value[0]) and is_finite_number(value[1])):
      raise RecordError(f'usage of {short(record_id)} is {short(value)}, '
                        'expected [count, seconds]')
    usage[record_id] = _Usage(value[0], float(value[1]))
  return usage


def _generation(name: str, prefix: str) -> Optional[int]:
  match = re.fullmatch(re.escape(prefix) + r'(\d+)(\.json)?', name)
  return int(match.group(1)) if match else None


def read_record_file(path: str, fingerprint_key: str,
                     kinds: Sequence[ArgKind]) -> RecordedSignature:
  """A record file, checked; RecordError says why it cannot be used."""
  data = _read_json(path)
  _check_format(data)
  if data.get('fingerprint') != fingerprint_key:
    raise RecordError(f'names fingerprint {short(data.get("fingerprint"))}')
  if data.get('kinds') != [kind.value for kind in kinds]:
    raise RecordError('input kinds differ from the live graph')
  specs = parse_specs(kinds, data.get('specs'))
  shardings = parse_shardings(kinds, data.get('shardings'))
  created = data.get('created')
  if not is_finite_number(created):
    raise RecordError(f'"created" is {short(created)}, expected seconds')
  return RecordedSignature(record_id=record_id_of(specs, shardings),
                           specs=specs,
                           shardings=shardings,
                           last_served=float(created),
                           source=path)


_writer_state: Dict[str, Any] = {}


def _writer_token() -> str:
  """Unique per process (and per fork)."""
  if _writer_state.get('pid') != os.getpid():
    host = re.sub(r'[^A-Za-z0-9.-]', '_', socket.gethostname())[:40]
    _writer_state.update(pid=os.getpid(),
                         token=f'{host}-{os.getpid()}-{secrets.token_hex(4)}',
                         sequence=itertools.count())
  return _writer_state['token']


class GraphIndex:
  """The index of one graph: its directory under a cache directory.

  Args:
    cache_dir: the cache directory.
    fingerprint: the graph's fingerprint.
    layout: the graph's argument layout.
    max_signatures: most records kept; compaction drops the least served
      past it, and load() returns at most this many. 0: no cap.
  """

  def __init__(self, cache_dir: str, fingerprint: GraphFingerprint,
               layout: ArgLayout, max_signatures: int):
    self.cache_dir = cache_dir
    self.fingerprint = fingerprint
    self.layout = layout
    self.max_signatures = max_signatures
    self.directory = os.path.join(cache_dir, SIGNATURES_DIR, fingerprint.key)
    self._kinds = [kind.value for kind in layout.kinds]
    self._written: set = set()
    self._warned_write = False

  # -- reading

  def _names(self) -> List[str]:
    try:
      return sorted(os.listdir(self.directory))
    except FileNotFoundError:
      return []

  def _usage(self, names: Sequence[str]) -> Tuple[Dict[str, _Usage], List[str]]:
    """Usage per record id, and the usage files summed."""
    usage: Dict[str, _Usage] = {}
    covered: set = set()
    snapshots = sorted(((_generation(n, SNAPSHOT_PREFIX), n)
                        for n in names
                        if _generation(n, SNAPSHOT_PREFIX) is not None),
                       reverse=True)
    for _, name in snapshots:
      path = os.path.join(self.directory, name)
      try:
        data = _read_json(path)
        _check_format(data)
        covers = data.get('covers')
        if not isinstance(covers, list) or not all(
            isinstance(c, str) for c in covers):
          raise RecordError('"covers" is not a list of file names')
        usage = _parse_usage_map(data.get('served'))
      except RecordError as e:
        if os.path.exists(path):
          logger.warning('torch_xla_patches: ignoring index snapshot %s: %s',
                         path, e)
        continue
      covered = set(covers)
      break
    summed = []
    for name in names:
      if not (name.startswith(USAGE_PREFIX) and
              name.endswith('.json')) or name in covered:
        continue
      path = os.path.join(self.directory, name)
      try:
        data = _read_json(path)
        _check_format(data)
        delta = _parse_usage_map(data.get('served'))
      except RecordError as e:
        if os.path.exists(path):  # Else a compaction covered it meanwhile.
          logger.warning('torch_xla_patches: ignoring usage file %s: %s', path,
                         e)
        continue
      for record_id, item in delta.items():
        usage.setdefault(record_id, _Usage()).add(item.served, item.last_served)
      summed.append(name)
    return usage, summed

  def _records(
      self, names: Sequence[str]
  ) -> Tuple[List[RecordedSignature], List[IndexProblem]]:
    records, problems = [], []
    for name in names:
      if not name.startswith(RECORD_PREFIX):
        continue
      path = os.path.join(self.directory, name)
      try:
        records.append(
            read_record_file(path, self.fingerprint.key, self.layout.kinds))
      except RecordError as e:
        if os.path.lexists(path):  # Else dropped by a compaction meanwhile.
          problems.append(IndexProblem(path, str(e)))
    return records, problems

  @staticmethod
  def _ranked(records: Sequence[RecordedSignature],
              usage: Dict[str, _Usage]) -> List[RecordedSignature]:
    ranked = []
    for record in records:
      item = usage.get(record.record_id)
      if item is not None:
        record = dataclasses.replace(record,
                                     served=item.served,
                                     last_served=max(record.last_served,
                                                     item.last_served))
      ranked.append(record)
    ranked.sort(key=lambda r: (-r.served, -r.last_served, r.record_id))
    return ranked

  def load(self) -> IndexContents:
    """The graph's records, most served first; never raises."""
    try:
      names = self._names()
      records, problems = self._records(names)
      usage, _ = self._usage(names)
    except OSError as e:
      return IndexContents((), (IndexProblem(self.directory, str(e)),))
    ranked = self._ranked(records, usage)
    cap = self.max_signatures
    over = max(0, len(ranked) - cap) if cap > 0 else 0
    return IndexContents(tuple(ranked[:len(ranked) - over]), tuple(problems),
                         over)

  # -- writing

  def _warn_write(self, error: OSError) -> None:
    if not self._warned_write:
      self._warned_write = True
      logger.warning(
          'torch_xla_patches: could not write the signature index %s: %s',
          self.directory, error)

  def _write_once(self, name: str, payload: Dict[str, Any]) -> None:
    path = os.path.join(self.directory, name)
    if name in self._written or os.path.exists(path):
      self._written.add(name)
      return
    os.makedirs(self.directory, exist_ok=True)
    io_utils.atomic_write_json(path, payload)
    self._written.add(name)

  def record(self, record: RecordedSignature) -> None:
    """Writes `record` (and the graph file) unless already there."""
    try:
      self._write_once(
          GRAPH_FILE, {
              'format_version': FORMAT_VERSION,
              'fingerprint': self.fingerprint.key,
              'parts': [[p.name, p.value] for p in self.fingerprint.parts],
              'kinds': self._kinds,
          })
      self._write_once(
          f'{RECORD_PREFIX}{record.record_id}.json', {
              'format_version': FORMAT_VERSION,
              'fingerprint': self.fingerprint.key,
              'kinds': self._kinds,
              'specs': list(record.specs),
              'shardings': (
                  None if record.shardings is None else list(record.shardings)),
              'created': time.time(),
          })
    except OSError as e:
      self._warn_write(e)

  def write_usage(self, served: Dict[str, Tuple[int, float]]) -> None:
    """Writes one usage file ({record id: (calls, last served)}), then
    compacts if the directory needs it."""
    if not served:
      return
    token = _writer_token()
    name = f'{USAGE_PREFIX}{token}-{next(_writer_state["sequence"])}.json'
    try:
      os.makedirs(self.directory, exist_ok=True)
      io_utils.atomic_write_json(
          os.path.join(self.directory, name), {
              'format_version': FORMAT_VERSION,
              'served': {
                  record_id: [count, when]
                  for record_id, (count, when) in served.items()
              },
          })
      self.compact(force=False)
    except OSError as e:
      self._warn_write(e)

  def _claim(self, names: Sequence[str]) -> Optional[int]:
    """Takes the next generation's claim; None if another process holds a
    fresh one or exclusive create is unsupported."""
    snapshots = [_generation(n, SNAPSHOT_PREFIX) for n in names]
    claims = [_generation(n, CLAIM_PREFIX) for n in names]
    newest_snapshot = max((g for g in snapshots if g is not None), default=0)
    newest_claim = max((g for g in claims if g is not None), default=0)
    if newest_claim > newest_snapshot:
      try:
        age = time.time() - os.path.getmtime(
            os.path.join(self.directory, f'{CLAIM_PREFIX}{newest_claim}'))
      except OSError:
        age = 0.0
      if age < CLAIM_TIMEOUT_SECONDS:
        return None
    generation = max(newest_snapshot, newest_claim) + 1
    try:
      fd = os.open(os.path.join(self.directory, f'{CLAIM_PREFIX}{generation}'),
                   os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return None
    except OSError as e:
      if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL,
                     errno.ENOSYS, errno.EPERM, errno.EACCES):
        return None
      raise
    os.close(fd)
    return generation

  def compact(self, force: bool = True) -> bool:
    """Sums usage into a snapshot and drops records over the cap (see
    [Note: Index writes without locks]); True if it compacted. Without
    `force`, only when there is something to gain."""
    names = self._names()
    usage_files = [
        n for n in names if n.startswith(USAGE_PREFIX) and n.endswith('.json')
    ]
    record_files = [n for n in names if n.startswith(RECORD_PREFIX)]
    cap = self.max_signatures
    over_cap = cap > 0 and len(record_files) > cap
    if not force and len(usage_files) <= COMPACT_USAGE_FILES and not over_cap:
      return False
    generation = self._claim(names)
    if generation is None:
      return False
    records, _ = self._records(names)
    usage, summed = self._usage(names)
    ranked = self._ranked(records, usage)
    kept = ranked[:cap] if cap > 0 else ranked
    dropped = ranked[len(kept):]
    kept_ids = {r.record_id for r in kept}
    io_utils.atomic_write_json(
        os.path.join(self.directory, f'{SNAPSHOT_PREFIX}{generation}.json'), {
            'format_version': FORMAT_VERSION,
            'generation': generation,
            'covers': summed,
            'served': {
                record_id: [item.served, item.last_served]
                for record_id, item in usage.items()
                if record_id in kept_ids
            },
        })
    obsolete = list(summed)
    obsolete.extend(f'{RECORD_PREFIX}{r.record_id}.json' for r in dropped)
    for name in names:
      gen = _generation(name, SNAPSHOT_PREFIX)
      if gen is None:
        gen = _generation(name, CLAIM_PREFIX)
      if gen is not None and gen < generation:
        obsolete.append(name)
    obsolete.append(f'{CLAIM_PREFIX}{generation}')
    now = time.time()
    for name in names:
      if name.startswith(TEMP_PREFIX):
        try:
          if now - os.path.getmtime(os.path.join(self.directory,
                                                 name)) > STALE_TEMP_SECONDS:
            obsolete.append(name)
        except OSError:
          pass
    for name in obsolete:
      try:
        os.unlink(os.path.join(self.directory, name))
      except FileNotFoundError:
        pass
    return True

  def explain_miss(self) -> str:
    """Why no records match: the closest recorded graph's differing parts."""
    best: Optional[Tuple[List[str], str]] = None
    for directory in graph_directories(self.cache_dir):
      try:
        stored = read_graph_file(directory).fingerprint.as_dict()
      except RecordError:
        continue
      differing = self.fingerprint.differing_parts(stored)
      if best is None or len(differing) < len(best[0]):
        best = (differing, directory)
    if best is None:
      return 'no graph is recorded in this cache directory yet'
    return (f'closest recorded graph {os.path.basename(best[1])} differs in: ' +
            (', '.join(best[0]) or 'nothing (its records were removed)'))


def graph_directories(cache_dir: str) -> List[str]:
  """The per-graph directories under `cache_dir`."""
  root = os.path.join(cache_dir, SIGNATURES_DIR)
  try:
    names = sorted(os.listdir(root))
  except OSError:
    return []
  return [
      os.path.join(root, n)
      for n in names
      if os.path.isdir(os.path.join(root, n))
  ]


@dataclasses.dataclass(frozen=True)
class GraphFile:
  """A graph directory's graph.json."""
  fingerprint: GraphFingerprint
  kinds: Tuple[ArgKind, ...]


def read_graph_file(directory: str) -> GraphFile:
  """A graph directory's graph.json, checked against the directory name."""
  data = _read_json(os.path.join(directory, GRAPH_FILE))
  _check_format(data)
  parts = data.get('parts')
  kinds = data.get('kinds')
  if not isinstance(parts, list) or not all(
      isinstance(p, list) and len(p) == 2 and all(
          isinstance(s, str) for s in p) for p in parts):
    raise RecordError('"parts" is not a list of [name, value] strings')
  known_kinds = {kind.value for kind in ArgKind}
  if not isinstance(kinds, list) or not all(k in known_kinds for k in kinds):
    raise RecordError(f'"kinds" is {short(kinds)}')
  fingerprint = GraphFingerprint(
      tuple(FingerprintPart(name, value) for name, value in parts))
  if fingerprint.key != os.path.basename(directory):
    raise RecordError(f'its parts hash to {fingerprint.key}, not the '
                      'directory name')
  return GraphFile(fingerprint, tuple(ArgKind(k) for k in kinds))


def open_graph_directory(directory: str, max_signatures: int) -> GraphIndex:
  """The GraphIndex of an existing graph directory, from its graph.json (for
  tools; the bridge builds its GraphIndex from the live graph)."""
  graph = read_graph_file(directory)
  spmd = graph.fingerprint.as_dict().get('spmd') == 'True'
  return GraphIndex(os.path.dirname(os.path.dirname(directory)),
                    graph.fingerprint, ArgLayout(kinds=graph.kinds,
                                                 spmd=spmd), max_signatures)


_live_usage_logs: 'weakref.WeakSet[UsageLog]' = weakref.WeakSet()
_exit_flush_registered = False


class UsageLog:
  """Calls served per signature in this process, written to an index as one
  usage file every `flush_seconds` (checked after served calls) and at exit.

  Args:
    index: the graph's index.
    flush_seconds: seconds between two writes.
  """

  def __init__(self, index: GraphIndex, flush_seconds: float):
    global _exit_flush_registered
    self.index = index
    self.flush_seconds = flush_seconds
    # Calls served per signature key since the last flush; the bridge bumps
    # it on every call, so it is a plain dict.
    self.served: DefaultDict[Hashable, int] = collections.defaultdict(int)
    self.next_flush = time.monotonic() + flush_seconds
    # Record id of each signature key recorded so far.
    self._record_ids: Dict[Hashable, str] = {}
    _live_usage_logs.add(self)
    if not _exit_flush_registered:
      _exit_flush_registered = True
      atexit.register(flush_all_usage)

  def record(self, key: Hashable, record: RecordedSignature) -> None:
    """Writes `record` to the index (once); its calls count from now on."""
    self._record_ids[key] = record.record_id
    self.index.record(record)
    if time.monotonic() >= self.next_flush:
      self.flush()

  def flush(self) -> None:
    """Writes the calls served since the last flush."""
    self.next_flush = time.monotonic() + self.flush_seconds
    if not self.served:
      return
    now = time.time()
    usage: Dict[str, Tuple[int, float]] = {}
    for key, count in list(self.served.items()):
      record_id = self._record_ids.get(key)
      if record_id is not None:
        usage[record_id] = (usage.get(record_id, (0, now))[0] + count, now)
    self.served.clear()
    self.index.write_usage(usage)


def flush_all_usage() -> None:
  """Flushes the usage of every graph alive in this process (at exit)."""
  for usage in list(_live_usage_logs):
    usage.flush()
