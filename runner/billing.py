"""Billing: the wall-clock time of every attempt of a run, kept so that no second goes uncounted.

`<run_dir>/billing.json` is an append-only journal (JSON lines), `billing.copy.json` a second
copy written the same way. A line is `{"attempt": N, ...}`; the lines of one attempt merge:
`start` is the earliest given, `last_seen` and every measured cost (startup_s, step_s,
checkpoint_s, shutdown_s) the largest, so the runner and rank 0 may append in any order.

- The runner opens an attempt before it launches or prepares anything, with the start time of
  its own process (from /proc: interpreter start-up and imports are machine time too), and a
  heartbeat thread appends `last_seen` every HEARTBEAT_S seconds through data preparation,
  start-up and training; the attempt is closed at exit. A SIGKILL at any moment loses at most
  one heartbeat of billed time.
- A line torn by a kill (the last one) is skipped; a damaged or missing copy is recovered from
  the other (one line says so); if both are lost, the run bills the upper bound its files' times
  prove, plus UPPER_BOUND_MARGIN_S per attempt, and says so in one line.
- The format before the journal (one JSON object `{"attempts": [...]}`) is still read.

Several nodes: each node's runner keeps its own time (node R > 0 in `billing.nodeRR.json`, on
the run directory every node shares); node 0 reads those journals whenever it reads its own and
copies their attempts into `billing.json` as lines `{"node": R, "attempt": N, ...}` (when it
opens and closes an attempt), so one file holds the whole cluster's bill even if a node's own
journal is lost later. The bill of a cluster (`Billing.total_seconds`, in seconds of the whole
cluster, so that money = price x nnodes x seconds as everywhere) counts node 0's time and, for
every other node of the plan, the time its own runner ran or node 0's did: a node whose runner
was not running while node 0 ran is taken as rented all the same (the plan prices whole
clusters), and a node that ran alone (restarted first, waiting for its peers) adds its time.

Attempts that launched and trained nothing (a rerun that found the budget spent, flagged
`budget_check`; a rerun of a finished run, flagged `idle` when it starts) are kept with their
seconds but not billed: the ceiling holds through any number of reruns (docs/faults.md). A
rerun that does work (an export retried, flagged `work` when it starts it) is billed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

from gptplan.diskspace import guard_disk_writes
from gptplan.tomlconf import write_text_atomic

JOURNAL = "billing.json"
COPY = "billing.copy.json"
DAMAGED_DIR = "damaged"
HEARTBEAT_S = 1.0
# Bound on the start-up of one attempt before its first file write (interpreter, imports,
# checks): added per attempt when the journal is lost and the bill comes from file times.
UPPER_BOUND_MARGIN_S = 60.0
# A node's files carry its rank (runner.node01.lock, launcher.node01.json, result.node01.json,
# logs/node_01): any name stamped with a rank other than 0 was written by another node.
NODE_STAMP = re.compile(r"(?:^|[._])node_?(\d+)(?=[._]|$)")


def written_by_another_node(name: str) -> bool:
    """True for a file or folder name stamped with a node rank other than 0."""
    stamp = NODE_STAMP.search(name)
    return stamp is not None and int(stamp.group(1)) != 0


TIME_KEYS = ("start", "last_seen")


def process_start_time(pid: int | str = "self") -> float:
    """time.time() at which process `pid` started (from /proc; now if unavailable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def billable(attempt: dict) -> bool:
    """Attempts that launched and trained nothing are kept, not billed (module docstring): a
    budget check, and a rerun of a finished run (`idle`) unless it did work (`work`: an
    export retried)."""
    if attempt.get("budget_check"):
        return False
    return not attempt.get("idle") or bool(attempt.get("work"))


def billed_seconds_of(attempts: list[dict]) -> float:
    """Billed seconds of one node's attempts (those that launched or did work)."""
    return sum(a["last_seen"] - a["start"] for a in attempts if billable(a))


def _merge_nodes(records: list[dict]) -> dict[int, list[dict]]:
    """Lines -> {node rank: attempts}; lines without `node` are the journal's own node's."""
    by_node: dict[int, list[dict]] = {}
    for rec in records:
        by_node.setdefault(int(rec.get("node", 0)), []).append(rec)
    return {node: _merge(recs) for node, recs in sorted(by_node.items())}


def _merge(records: list[dict]) -> list[dict]:
    """Lines -> attempts (numbered from 1), each the merge of its lines."""
    by_number: dict[int, dict] = {}
    for rec in records:
        n = rec["attempt"]
        cur = by_number.setdefault(n, {})
        for key, value in rec.items():
            if key in ("attempt", "node"):
                continue
            if key == "start":
                cur[key] = min(value, cur.get(key, value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                cur[key] = max(value, cur.get(key, value))
            else:
                cur[key] = value
    attempts = [by_number[n] for n in sorted(by_number)]
    for a in attempts:
        a.setdefault("last_seen", a.get("start"))
    return [a for a in attempts if _valid_attempt(a)]


def _valid_attempt(a: object) -> bool:

    return isinstance(a, dict) and all(
        isinstance(a.get(k), (int, float)) and not isinstance(a.get(k), bool) for k in TIME_KEYS
    )


def parse(text: str) -> list[dict] | None:
    """The journal's own node's attempts in its text (either format); None when damaged."""
    nodes = parse_nodes(text)
    return None if nodes is None else nodes.get(0, [])


def parse_nodes(text: str) -> dict[int, list[dict]] | None:
    """{node rank: attempts} in a journal's text (either format); None when damaged."""
    if not text.strip():
        return {}
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict):  # the format before the journal
        attempts = whole.get("attempts")
        if isinstance(attempts, list) and all(_valid_attempt(a) for a in attempts):
            return {0: [dict(a) for a in attempts]}
        if "attempt" not in whole:
            return None
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if (
                not isinstance(rec, dict)
                or not isinstance(rec.get("attempt"), int)
                or rec["attempt"] < 1
                or not isinstance(rec.get("node", 0), int)
                or isinstance(rec.get("node", 0), bool)
                or rec.get("node", 0) < 0
            ):
                raise ValueError(line)
        except ValueError:
            if i == len(lines) - 1:  # torn by a kill mid-write: the last line only
                continue
            return None
        records.append(rec)
    return _merge_nodes(records)


def _read(path: Path) -> dict[int, list[dict]] | None:
    """{node: attempts} in one file; {} if it does not exist; None if damaged (or not a
    file)."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        return parse_nodes(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def _old_format(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8")).get("attempts"), list)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def move_damaged(path: Path, run_dir: Path) -> Path:
    """Move a damaged run file (or folder) into <run_dir>/damaged/, never deleting it."""
    folder = Path(run_dir) / DAMAGED_DIR
    folder.mkdir(exist_ok=True)
    target = folder / f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while target.exists():
        n += 1
        target = folder / f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}.{n}"
    shutil.move(str(path), str(target))
    return target


def journal_paths(run_dir: Path, node_rank: int = 0) -> tuple[Path, Path]:
    """The journal and its copy: node 0's bill the cluster; a node R > 0 keeps its own time
    in `billing.nodeRR.json` (and its copy), so the time of a node that ran without node 0
    (a peer that never came, or went away) is on record too."""
    if node_rank == 0:
        return Path(run_dir) / JOURNAL, Path(run_dir) / COPY
    stem = f"billing.node{node_rank:02d}"
    return Path(run_dir) / f"{stem}.json", Path(run_dir) / f"{stem}.copy.json"


NODE_JOURNAL = re.compile(r"^billing\.node(\d+)\.json$")


def peer_journals(run_dir: Path) -> dict[int, tuple[Path, Path]]:
    """The journals nodes R > 0 keep in a shared run directory, by node rank."""
    found = {}
    try:
        names = [p.name for p in Path(run_dir).iterdir()]
    except OSError:
        return {}
    for name in names:
        match = NODE_JOURNAL.match(name)
        if match and int(match.group(1)) > 0:
            found[int(match.group(1))] = journal_paths(run_dir, int(match.group(1)))
    return dict(sorted(found.items()))


class Billing:
    """The run's billing journal. `repair=True` (the runner of node 0, holding the run
    directory's lock) may rewrite damaged copies; everyone may append. `nnodes`: the plan's
    node count, for the cluster's bill (module docstring)."""

    def __init__(self, run_dir: Path, *, repair: bool = False, node_rank: int = 0, nnodes: int = 1):
        self.run_dir = Path(run_dir)
        self.paths = journal_paths(self.run_dir, node_rank)
        self.node_rank = node_rank
        self.nnodes = max(1, int(nnodes))
        self.repair = repair
        self.attempts: list[dict] = []
        self.peers: dict[int, list[dict]] = {}  # node R > 0 -> its attempts (node 0 only)
        self.notice: str | None = None  # the one line a recovery printed
        self._lock = threading.Lock()
        self.reload()

    # ---- reading -------------------------------------------------------------------------
    def reload(self) -> None:
        read = {p: _read(p) for p in self.paths if p.exists() or p.is_symlink()}
        usable = {p: a for p, a in read.items() if a is not None}
        own = {p: nodes.get(0, []) for p, nodes in usable.items()}
        merged = _merge([{"attempt": i + 1, **a} for g in own.values() for i, a in enumerate(g)])
        if merged:
            self.attempts = merged
            damaged = [p for p in self.paths if not own.get(p)]
        else:  # both damaged, empty or missing: the upper bound (nothing for a new run dir)
            # (file times are node 0's: a node R > 0 with no journal has billed nothing)
            self.attempts = upper_bound_attempts(self.run_dir) if self.node_rank == 0 else []
            damaged = list(self.paths) if self.attempts or read else []
        if self.node_rank == 0:
            self.reload_peers(copied=list(usable.values()))
        if damaged == [self.paths[1]] and not self.paths[1].exists() and _old_format(self.paths[0]):
            damaged = []  # a run billed before the journal: its copy is written from now on
            if self.repair:
                self.compact()
        if damaged and self.repair:
            self._recover(damaged)

    def reload_peers(self, copied: list[dict[int, list[dict]]] | None = None) -> None:
        """Nodes R > 0: their own journals merged with what node 0 copied of them."""
        if copied is None:
            copied = [n for n in (_read(p) for p in self.paths) if n is not None]
        records: list[dict] = []
        for nodes in copied:
            for node, attempts in nodes.items():
                if node > 0:
                    records += [
                        {"node": node, "attempt": i + 1, **a} for i, a in enumerate(attempts)
                    ]
        for node, paths in peer_journals(self.run_dir).items():
            for path in paths:
                own = _read(path)
                if own:
                    records += [
                        {"node": node, "attempt": i + 1, **a} for i, a in enumerate(own.get(0, []))
                    ]
        self.peers = {n: a for n, a in _merge_nodes(records).items() if n > 0 and a}

    def _recover(self, damaged: list[Path]) -> None:
        existed = [p for p in damaged if p.exists() or p.is_symlink()]
        for path in existed:
            move_damaged(path, self.run_dir)
        self.compact()
        if not self.attempts:
            return
        if len(damaged) == 2:
            a = self.attempts[0]
            self.notice = (
                f"billing: {self.paths[0]} and {self.paths[1].name} are both damaged or lost; "
                f"billing the upper bound the run directory's file times prove: "
                f"{self.total_seconds():.1f} s (first file {time.ctime(a['first_file'])}, last "
                f"{time.ctime(a['last_seen'])}, + {UPPER_BOUND_MARGIN_S:.0f} s per attempt for "
                f"start-up before its first write; {a['attempts_seen']} attempt(s) seen)"
            )
        else:
            good = next(p for p in self.paths if p not in damaged)
            self.notice = (
                f"billing: {damaged[0]} was damaged or lost; recovered from "
                f"{good.name} ({len(self.attempts)} attempt(s), "
                f"{self.total_seconds():.1f} s billed, measured)"
            )

    def _cluster_seconds(self, current: bool) -> float:
        """The cluster's bill in seconds of the whole cluster (module docstring): node 0's
        attempts, and for every other node of the plan the time its own runner ran or node 0's
        did (the union of both). Without `current`, node 0's current attempt is left out, and
        the other nodes' time from its start on (the caller counts that attempt's seconds for
        every node)."""
        own = [a for a in (self.attempts if current else self.attempts[:-1]) if billable(a)]
        seconds = billed_seconds_of(own)
        if self.node_rank != 0:
            return seconds
        cut = self.attempts[-1]["start"] if self.attempts and not current else float("inf")
        own_spans = [(a["start"], a["last_seen"]) for a in own]
        for node in sorted(set(range(1, self.nnodes)) | set(self.peers)):
            spans = [
                (a["start"], min(a["last_seen"], cut))
                for a in self.peers.get(node, [])
                if billable(a) and a["start"] < cut
            ]
            seconds += _union_seconds(spans + own_spans if node < self.nnodes else spans)
        return seconds / self.nnodes

    def previous_seconds(self) -> float:
        """Billed seconds of the cluster, all attempts but this node's current (last) one
        (the other nodes' as far as their journals go)."""
        return self._cluster_seconds(current=False)

    def total_seconds(self) -> float:
        """Billed seconds of the cluster (node 0's journal) or of this node (R > 0)."""
        return self._cluster_seconds(current=True)

    def unbilled(self) -> tuple[int, float]:
        """Attempts of this node that launched and trained nothing, and their seconds."""
        idle = [a for a in self.attempts if not billable(a)]
        return len(idle), sum(a["last_seen"] - a["start"] for a in idle)

    # ---- writing -------------------------------------------------------------------------
    def _peer_lines(self) -> str:
        return "".join(
            json.dumps({"node": node, "attempt": i + 1, **a}) + "\n"
            for node, attempts in self.peers.items()
            for i, a in enumerate(attempts)
        )

    def compact(self) -> None:
        """Rewrite both copies with one line per attempt (atomically, the journal first)."""
        text = "".join(
            json.dumps({"attempt": i + 1, **a}) + "\n" for i, a in enumerate(self.attempts)
        )
        text += self._peer_lines()
        for path in self.paths:
            write_text_atomic(path, text)

    def _append(self, record: dict | str) -> None:
        line = (record if isinstance(record, str) else json.dumps(record) + "\n").encode()
        with self._lock, guard_disk_writes(self.run_dir, needed_bytes=len(line)):
            for path in self.paths:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    os.write(fd, line)
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def open_attempt(self, start: float, now: float | None = None) -> float:
        """A new attempt that began at `start` (time.time()); compacts the journal first."""
        now = time.time() if now is None else now
        self.attempts.append({"start": start, "last_seen": now})
        self.compact()
        return start

    def touch(self, now: float | None = None, **measured: float) -> None:
        """The current attempt is still running (and what it measured, if anything)."""
        if not self.attempts:
            return
        now = time.time() if now is None else now
        current = self.attempts[-1]
        current["last_seen"] = max(now, current["last_seen"])
        for key, value in measured.items():
            current[key] = max(value, current.get(key, value))
        self._append({"attempt": len(self.attempts), "last_seen": current["last_seen"], **measured})

    def note(self, **measured: float) -> None:
        """Keep measured costs (start-up, step, checkpoint, shutdown seconds) on the current
        attempt: the largest value of each kind counts (runner.budget)."""
        self.touch(**measured)

    def close(self, now: float | None = None) -> None:
        self.touch(now, closed=1)
        if self.node_rank == 0:  # the other nodes' time, as far as it goes, in this journal
            self.reload_peers()
            if self.peers:
                self._append(self._peer_lines())


def _union_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of time spans."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def upper_bound_attempts(run_dir: Path) -> list[dict]:
    """With both copies lost: one attempt spanning the run directory's file times, plus a
    margin per attempt seen in logs/ ([] for a run directory with nothing in it yet)."""
    times, attempts_seen = [], 0
    # on several nodes every node writes the effective plan.toml when it starts, and nodes > 0
    # their own rank-stamped files (written_by_another_node): only node 0's own files
    # (logs/node_00, checkpoints, metrics, reports) prove that node 0 billed
    shared = {"plan.toml"} if any(Path(run_dir).glob("runner.node*.lock")) else set()
    for root, dirs, files in os.walk(run_dir):
        here = Path(root)
        # node 0 bills; other nodes of a run sharing this directory write their locks and
        # logs (logs/node_RR, RR > 0) whenever they start, before node 0 has billed anything
        dirs[:] = [
            d
            for d in dirs
            if not ((d == DAMAGED_DIR and here == Path(run_dir)) or written_by_another_node(d))
        ]
        attempts_seen += sum(1 for d in dirs if d.startswith("attempt_"))
        for name in files:
            if name in (JOURNAL, COPY) or (name.startswith("runner") and name.endswith(".lock")):
                continue
            if (here == Path(run_dir) and name in shared) or written_by_another_node(name):
                continue
            try:
                times.append(os.stat(os.path.join(root, name)).st_mtime)
            except OSError:
                continue
    if not times:
        return []
    attempts_seen = max(1, attempts_seen)
    first, last = min(times), max(times)
    return [
        {
            "start": first - UPPER_BOUND_MARGIN_S * attempts_seen,
            "last_seen": last,
            "first_file": first,
            "attempts_seen": attempts_seen,
            "recovered": "upper bound from file times",
        }
    ]


class Heartbeat:
    """Appends `last_seen` every HEARTBEAT_S seconds from a daemon thread until stopped.
    A write that fails (full or read-only disk) ends the heartbeat quietly: the run's own
    error says what happened; the bill then ends at the last line written."""

    def __init__(self, billing: Billing, interval_s: float = HEARTBEAT_S):
        self.billing = billing
        self.interval_s = interval_s
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="billing-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.billing.touch()
            except Exception as exc:  # noqa: BLE001 - see the class docstring
                self.error = exc
                return

    def stop(self) -> None:
        """Stop the thread and close the attempt (the final `last_seen`)."""
        self._stop.set()
        self._thread.join()
        if self.error is None:
            try:
                self.billing.close()
                _CLOSED.append(self.billing)
            except Exception as exc:  # noqa: BLE001
                self.error = exc


_CLOSED: list[Billing] = []  # attempts closed in this process, for the last word at exit


def last_word() -> None:
    """Bring the attempts this process closed up to now: called by `runner`'s entry point as
    the very last thing before the process exits (without the interpreter's slow teardown),
    so the bill ends where the process does."""
    while _CLOSED:
        billing = _CLOSED.pop()
        try:
            billing.touch()
        except Exception:  # noqa: BLE001 - a full disk: the bill ends at the close
            pass


def billed_seconds(run_dir: Path, nnodes: int = 1) -> float:
    """Total billed seconds of a run (read-only; for reports and tests)."""
    return Billing(run_dir, nnodes=nnodes).total_seconds()
