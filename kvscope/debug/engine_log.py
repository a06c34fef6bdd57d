"""`kvscope report engine-log`: find SGLang's leak messages in a server log and explain each
in the words of kvscope's own leak report (`[full] total=…, …: 59 tokens missing`).

SGLang's idle check tests the conservation law per pool,
`available + evictable + protected + session_held + uncached == total`, and prints only the
terms when it fails. The printed text changed across releases. Families, named by the
releases they were read from (releases in between print the same text or the older one); terms
are `name=value`:

- 0.1: `Warning: available_size=…, max_total_num_token=…`, then `KV cache pool leak detected!`
  on the next line; available_size is free + evictable.
- 0.4.6: `token_to_kv_pool_allocator memory leak detected! available_size=…, protected_size=…,
  self.max_total_num_tokens=…`, where available_size is free + evictable; two more lines split it.
- 0.4.10: `… detected! self.max_total_num_tokens=…, available_size=…, evictable_size=…,
  protected_size=…`; hybrid SWA prints a line per pool (`self.full_tokens_per_layer=…, …`).
- 0.5.6–0.5.10: as 0.4.10 plus `session_held`; SWA `full_leaked=…, swa_leaked=…` then a line
  per pool; mamba `full_*` and `mamba_*` lines ending in `leaked_full_pages` /
  `leaked_mamba_pages`; the busy check's `AssertionError: Mem Leak Detected! total_tokens=… vs
  self.max_total_num_tokens=…` and `Full Pool Mem Leak Detected! full_total=… vs …`.
- 0.5.14–0.5.23: `pool memory leak detected! ` then newline-joined `[full] total=…,
  available=…, evictable=…, protected=…, session_held=…, uncached=…` lines (`[swa]`,
  `[mamba]`, `[mamba-active]`, `[mamba-int8]`); `pool-bytes memory leak detected! …`;
  `KV page use-after-free: N owner page refs are in the free pool, sample pages=[…]`;
  `KV double free: sub-pool I has N duplicate pages.`; busy `Full Pool Mem Leak Detected! [full] …`.
- every release: `req_to_token_pool memory leak detected!available_size=…[, session_held=…],
  total_size=…` (no space after the `!`).

A message may sit in a traceback (`ValueError: …`, after `Scheduler hit an exception`), in a
warning (`UserWarning: …`, or a plain log line when strict mode is off), and its pool lines
may carry a log prefix (`[2026-01-02 10:00:00 TP0] `) or not. The log is read line by line
(any size, bad UTF-8 replaced), never whole.

NOTE: pure Python, no torch and no pandas: the dashboard and the CLI read logs on a laptop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

PARTS = ("available", "evictable", "protected", "held", "uncached")  # kvscope's names, LeakCheck's order
UNITS = {"full": "tokens", "swa": "tokens", "req": "rows"}  # mamba pools count slots, pool-bytes bytes
F01, F046, F0410, F056, F0514 = "0.1", "0.4.6", "0.4.10", "0.5.6–0.5.10", "0.5.14–0.5.23"
Kind = Literal["pool-leak", "req-pool-leak", "use-after-free", "double-free"]
Check = Literal["idle", "busy"]
Raised = Literal["ValueError", "AssertionError", "UserWarning", "log"]
MAX_CRASH_LINES = 20
BINARY_PROBE_BYTES = 8192

_ANCHOR = re.compile(
    r"(?P<pool>token_to_kv_pool_allocator|req_to_token_pool|pool-bytes|pool) memory leak detected!"
    r"|(?P<busy>Full Pool |SWA Pool )?Mem Leak Detected!"
    r"|(?P<uaf>KV page use-after-free:)|(?P<dfree>KV double free:)"
    r"|(?P<old>KV cache pool leak detected!)"
)  # 0.1: the terms are on the line before
_TERM = re.compile(r"([A-Za-z_][\w.]*(?:\(\))?)=(-?\d+|None|True|False|\{[^}]*\}|\[[^\]]*\]|set\(\))")
_TAG = re.compile(r"^\s*\[([\w.\-]+)\]\s*")
_LEFTOVER = re.compile(r"^[\s,.]*$")
_SGLANG_PREFIX = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:\s+([^\]]*))?\]\s?")
_ISO_PREFIX = re.compile(r"^(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)\s+")
_RAISED: tuple[tuple[str, Raised], ...] = (
    ("ValueError:", "ValueError"),
    ("AssertionError:", "AssertionError"),
    ("UserWarning:", "UserWarning"),
)
_CRASH = ("Scheduler hit an exception", "SIGQUIT received", "Received sigquit from a child process")
_UAF = re.compile(r"(\d+) owner page refs .*?sample pages=(\[[^\]]*\])")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PAGE_SIZE = re.compile(r"\bpage_size=(\d+)")
_DFREE = re.compile(r"sub-pool (\d+) has (\d+) duplicate pages")
# NOTE: the line kvscope's SGLang probe prints into the same log when its page census fails (probe/sglang_census.py)
_PROBE_CENSUS = re.compile(
    r"kvscope probe: page census \((?P<why>[^)]*)\) at step (?P<step>\d+), "
    r"capture (?P<capture>.+?)(?: run (?P<run>\d+))?: (?P<text>\[[\w-]+\] .*)$"
)
# NOTE: full names whose meaning their last part does not carry (0.4.6's split of available_size)
_SPECIAL_ROLES = {
    "self.token_to_kv_pool_allocator.available_size()": ("full", "free_detail"),
    "self.tree_cache.evictable_size()": ("full", "evictable_detail"),
}
_ROLES = {
    "max_total_num_tokens": "total",
    "tokens_per_layer": "total",
    "size": "total",
    "total_size": "total",
    "total": "total",
    "available_size": "available",
    "available": "available",
    "evictable_size": "evictable",
    "evictable": "evictable",
    "protected_size": "protected",
    "protected": "protected",
    "session_held": "held",
    "held": "held",
    "uncached_size": "uncached",
    "uncached": "uncached",
    "leaked": "engine_missing",
    "total_tokens": "sum",
    "max_total_num_token": "total",
}


@dataclass
class PoolTerms:
    """One pool's invariant terms as a message printed them, under kvscope's names."""

    pool: str  # full, swa, mamba, mamba-active, mamba-int8, req, …
    total: int | None
    terms: dict[str, int] = field(default_factory=dict)  # the parts: PARTS, extra terms a build printed, or sum
    printed: dict[str, str] = field(default_factory=dict)  # name=value exactly as the log has them
    leaked_pages: dict[str, str] = field(default_factory=dict)  # only mamba checks list page ids
    idle: bool = True  # an idle check (not the busy one): nothing may stay locked
    unit: str = ""  # tokens, slots (mamba), rows (req), bytes (pool-bytes); '' = from the pool's name

    def __post_init__(self) -> None:
        self.unit = self.unit or UNITS.get(self.pool, "slots")

    @property
    def missing(self) -> int | None:
        """total − Σ parts: positive when slots are missing, negative when counted twice."""
        return None if self.total is None or not self.terms else self.total - sum(self.terms.values())

    @property
    def locked(self) -> int:
        """Tokens still locked at an idle point (kvscope counts them; SGLang's equation does not,
        and streaming sessions may hold locks on purpose, so only without session-held tokens)."""
        held = self.terms.get("held", 0)
        return self.terms.get("protected", 0) if self.idle and self.missing == 0 and not held else 0

    def words(self) -> str:
        """The verdict in kvscope's words; '' when the pool balances."""
        gap = self.missing
        if gap is None:
            return "not enough terms printed to check"
        if gap:
            return f"{abs(gap)} {self.unit} {'missing' if gap > 0 else 'counted twice'}"
        return f"{self.locked} {self.unit} still locked at an idle point" if self.locked else ""

    def line(self) -> str:
        terms = ", ".join(f"{name}={value}" for name, value in self.terms.items())
        text = f"[{self.pool}] total={self.total}" + (f", {terms}" if terms else "")
        return f"{text}: {self.words()}" if self.words() else text


@dataclass
class EngineLeak:
    """One leak message of the log."""

    line: int  # 1-based, where the message starts
    end_line: int
    anchor: str  # the text it was found by, e.g. 'pool memory leak detected!'
    kind: Kind
    check: Check
    version_family: str  # F046, F0410, F056, F0514, or for the request pool the span its text lived
    raised_as: Raised  # ValueError: the scheduler died; AssertionError: the busy check; log: strict mode off
    timestamp: str | None = None
    timestamp_line: int | None = None  # the line the time comes from (this one, or the traceback's header)
    rank: str | None = None  # e.g. 'TP0', 'PP1 TP1', from the same prefix as the time
    pools: list[PoolTerms] = field(default_factory=list)
    pages: dict[str, Any] = field(default_factory=dict)  # use-after-free / double-free counts and samples
    notes: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # the message's lines, prefixes removed
    repeat_of: int | None = None  # 1-based index of an earlier message with the same terms

    @property
    def short_pools(self) -> list[PoolTerms]:
        return [pool for pool in self.pools if pool.words()]

    def key(self) -> tuple[Any, ...]:
        return (
            self.anchor,
            self.version_family,
            tuple((p.pool, p.total, tuple(p.terms.items())) for p in self.pools),
            tuple(sorted(self.pages.items())),
        )


@dataclass
class ProbeCensus:
    """A failed page census kvscope's probe printed into the log: the capture that holds it, and its
    violation (the pages, the requests that held them, when)."""

    line: int
    step: int
    capture: str
    run_id: int | None
    text: str
    capture_exists: bool

    def command(self) -> str:
        run = f" --run {self.run_id}" if self.run_id is not None else ""
        return f"kvscope report leaks {self.capture}{run}"


@dataclass
class EngineLogReport:
    log: str
    lines_read: int = 0
    leaks: list[EngineLeak] = field(default_factory=list)
    crash_lines: list[tuple[int, str]] = field(default_factory=list)  # (line, text), the first MAX_CRASH_LINES
    page_size: int | None = None  # from the server's `server_args=ServerArgs(…)` line, when the log has it
    probe: list[ProbeCensus] = field(default_factory=list)  # the probe's failed censuses, when it ran

    def to_dict(self) -> dict[str, Any]:
        messages = []
        for index, leak in enumerate(self.leaks, 1):
            entry = asdict(leak)
            entry["pools"] = [
                {**asdict(pool), "missing": pool.missing, "locked": pool.locked, "words": pool.words() or "balanced"}
                for pool in leak.pools
            ]
            messages.append(
                {
                    "index": index,
                    **entry,
                    "cannot_tell": cannot_tell(leak),
                    "next_step": next_step(leak, self.page_size),
                }
            )
        shape = {
            "log": self.log,
            "lines_read": self.lines_read,
            "page_size": self.page_size,
            "messages": messages,
            "crash_lines": [{"line": line, "text": text} for line, text in self.crash_lines],
            "verdict": "leak" if self.leaks or self.probe else "none",
        }
        if self.probe:  # NOTE: only a log kvscope's probe wrote into has the key
            shape["probe"] = [{**asdict(found), "command": found.command()} for found in self.probe]
        return shape


# -- reading ---------------------------------------------------------------------------------


def read_engine_log(path: str | Path) -> EngineLogReport:
    """Scan a server log; ValueError with one line when it cannot be read as a text log."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{path}: is a directory, not a log file")
    try:
        with open(target, "rb") as probe:
            head = probe.read(BINARY_PROBE_BYTES)
        if _looks_binary(head):
            raise ValueError(f"{path}: not a text log (binary data in its first {len(head):,} bytes)")
        with open(target, encoding="utf-8", errors="replace", newline=None) as lines:
            return scan(lines, str(path))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except PermissionError:
        raise ValueError(f"{path}: permission denied") from None


def _looks_binary(head: bytes) -> bool:
    if b"\0" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    return bool(text) and text.count("\ufffd") > len(text) * 3 // 10  # random bytes: about half


@dataclass
class _Prefix:
    timestamp: str | None
    rank: str | None
    body: str


def split_prefix(line: str) -> _Prefix:
    """The line's time and rank from an ISO stamp (docker, kubectl --timestamps) and SGLang's
    `[2026-01-02 10:00:00 TP0] ` prefix, either or both; the rest is the body. Colour codes go."""
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if not line[:1].isdigit() and line[:1] != "[":
        return _Prefix(None, None, line)
    timestamp = rank = None
    iso = _ISO_PREFIX.match(line)
    if iso:
        timestamp, line = iso.group(1), line[iso.end() :]
    own = _SGLANG_PREFIX.match(line)
    if own:
        timestamp, rank, line = own.group(1), (own.group(2) or None), line[own.end() :]
    return _Prefix(timestamp, rank, line)


def term_line(body: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """A continuation line of a message: `[pool] ` and/or only `name=value` terms; else None."""
    tag = _TAG.match(body)
    rest = body[tag.end() :] if tag else body
    terms = _TERM.findall(rest)
    if not terms or not _LEFTOVER.match(_TERM.sub("", rest)):
        return None
    return (tag.group(1) if tag else None), terms


@dataclass
class _Open:
    """A message being read: where it began and its lines of terms."""

    leak: EngineLeak
    head: str  # the anchor line's text after the anchor
    lines: list[tuple[str | None, list[tuple[str, str]]]] = field(default_factory=list)


def scan(lines: Iterable[str], log: str = "-") -> EngineLogReport:
    """Find and explain every leak message in `lines` (an open file streams)."""
    report = EngineLogReport(log)
    stamped: tuple[int, str] | None = None  # the last line that may carry a time, parsed only when used
    previous = ""
    current: _Open | None = None
    number = 0
    for number, raw in enumerate(lines, 1):
        if current is not None:
            if _extend(current, raw, number):
                continue
            _close(report, current)
            current = None
        if _maybe_stamped(raw):
            stamped = (number, raw)
        if "server_args=" in raw and report.page_size is None:
            found = _PAGE_SIZE.search(raw)
            report.page_size = int(found.group(1)) if found else None
        if "kvscope probe: page census" in raw:
            _probe_line(report, raw, number)
        current = _open(raw, number, stamped, previous) if "etected!" in raw or "KV " in raw else None
        if current is None and len(report.crash_lines) < MAX_CRASH_LINES and _crash(raw):
            report.crash_lines.append((number, split_prefix(raw.rstrip("\r\n")).body.strip()))
        previous = raw
    report.lines_read = number
    if current is not None:
        _close(report, current)
    return report


def _probe_line(report: EngineLogReport, raw: str, number: int) -> None:
    found = _PROBE_CENSUS.search(split_prefix(raw.rstrip("\r\n")).body)
    if found is None:
        return
    capture = found.group("capture")
    exists = "://" in capture or Path(capture).is_file()
    report.probe.append(
        ProbeCensus(
            number,
            int(found.group("step")),
            capture,
            int(found.group("run")) if found.group("run") else None,
            found.group("text"),
            exists,
        )
    )


def _crash(raw: str) -> bool:
    """A crash wrapper line (the `in` tests first: most lines fail them at C speed)."""
    return ("xception" in raw or "igquit" in raw or "IGQUIT" in raw) and any(c in raw for c in _CRASH)


def _maybe_stamped(raw: str) -> bool:
    """A cheap first look: could the line begin with a time (`[2026-…` or `2026-…`)?"""
    if raw[:1] == "\x1b":
        return True  # coloured: split_prefix looks after removing the colour codes
    return raw[1:5].isdigit() if raw[:1] == "[" else raw[:4].isdigit() and raw[4:5] == "-"


def _extend(current: _Open, raw: str, number: int) -> bool:
    """Add the line to the open message if it is one of its term lines."""
    body = split_prefix(raw.rstrip("\r\n")).body
    more = term_line(body)
    if more is None:
        return False
    current.lines.append(more)
    current.leak.text.append(body)
    current.leak.end_line = number
    return True


def _open(raw: str, number: int, stamped: tuple[int, str] | None, previous: str = "") -> _Open | None:
    body = split_prefix(raw.rstrip("\r\n")).body
    found = _ANCHOR.search(body)
    if found is None:
        return None
    when = split_prefix(stamped[1]) if stamped else _Prefix(None, None, "")
    when_line = stamped[0] if stamped and when.timestamp else None
    if found.group("old"):
        return _open_01(body, number, previous, when, when_line)
    raised: Raised = next((name for marker, name in _RAISED if marker in body[: found.start()]), "log")
    busy = found.group("busy") is not None or (found.group("pool") is None and "Mem Leak" in found.group(0))
    kind: Kind = (
        "use-after-free"
        if found.group("uaf")
        else "double-free"
        if found.group("dfree")
        else "req-pool-leak"
        if found.group("pool") == "req_to_token_pool"
        else "pool-leak"
    )
    leak = EngineLeak(
        number,
        number,
        found.group(0),
        kind,
        "busy" if busy else "idle",
        "",
        raised,
        timestamp=when.timestamp,
        rank=when.rank,
        timestamp_line=when_line,
        text=[body[found.start() :]],
    )
    head = body[found.end() :]
    opened = _Open(leak, head)
    for segment in head.split("\\n"):  # a JSON log keeps the message's newlines as the two characters \n
        tag = _TAG.match(segment)  # words besides terms (`… vs …`) may sit on this line: take every term
        terms = _TERM.findall(segment[tag.end() :] if tag else segment)
        if terms:
            opened.lines.append((tag.group(1) if tag else None, terms))
    return opened


def _open_01(body: str, number: int, previous: str, when: _Prefix, when_line: int | None) -> _Open | None:
    """0.1 warned `available_size=…, max_total_num_token=…` and said `KV cache pool leak detected!`
    on the next line (available_size there is free + evictable)."""
    head = split_prefix(previous.rstrip("\r\n")).body
    terms = _TERM.findall(head)
    if not terms:
        return None
    raised: Raised = "UserWarning" if "UserWarning:" in head else "log"
    leak = EngineLeak(
        number - 1,
        number,
        "KV cache pool leak detected!",
        "pool-leak",
        "idle",
        F01,
        raised,
        timestamp=when.timestamp,
        rank=when.rank,
        timestamp_line=when_line,
        text=[head, body],
    )
    leak.notes.append("[full]: available is free + evictable here (0.1 prints them as one term)")
    return _Open(leak, head, [(None, terms)])


def _close(report: EngineLogReport, opened: _Open) -> None:
    """Interpret the message and keep it; an anchor with no numbers after it is not one (a
    traceback's source line, a quote)."""
    leak = opened.leak
    _interpret(leak, opened)
    if not leak.pages and not any(pool.total is not None or pool.terms for pool in leak.pools):
        return
    earlier = next((i for i, other in enumerate(report.leaks, 1) if other.key() == leak.key()), None)
    leak.repeat_of = None if earlier is None else (report.leaks[earlier - 1].repeat_of or earlier)
    report.leaks.append(leak)


# -- interpreting each family ----------------------------------------------------------------


def _interpret(leak: EngineLeak, opened: _Open) -> None:
    if leak.kind in ("use-after-free", "double-free"):
        _page_check(leak, opened.head)
    elif leak.kind == "req-pool-leak":
        _req_pool(leak, opened.lines)
    elif any(tag for tag, _ in opened.lines):
        _tagged(leak, opened.lines)
    elif leak.check == "busy":
        _busy_untagged(leak, opened)
    elif leak.version_family == F01:
        _untagged(leak, opened.lines)
    else:
        _untagged(leak, opened.lines)


def _page_check(leak: EngineLeak, head: str) -> None:
    leak.version_family = F0514
    found = _UAF.search(head) if leak.kind == "use-after-free" else _DFREE.search(head)
    if found and leak.kind == "use-after-free":
        leak.pages = {"owner_page_refs": int(found.group(1)), "sample_pages": found.group(2)}
    elif found:
        leak.pages = {"sub_pool": int(found.group(1)), "duplicate_pages": int(found.group(2))}


def _req_pool(leak: EngineLeak, lines: list[tuple[str | None, list[tuple[str, str]]]]) -> None:
    printed = {name: value for _, terms in lines for name, value in terms}
    leak.version_family = "0.5.6–0.5.23" if "session_held" in printed else "0.4.6–0.5.5"
    pool = PoolTerms("req", _int(printed.get("total_size")), printed=printed, idle=False)
    for name, role in (("available_size", "available"), ("session_held", "held")):
        if _int(printed.get(name)) is not None:
            pool.terms[role] = _int(printed[name]) or 0
    leak.pools = [pool]
    if "session_held" in printed:
        leak.notes.append(
            "under PD disaggregation (decode) SGLang also counts pre-allocated rows, which the message does not print"
        )


def _role(name: str) -> tuple[str | None, str]:
    """(pool or None, kvscope role) of a printed name: `self.tree_cache.full_protected_size()` →
    ('full', 'protected'); `leaked_mamba_pages` → ('mamba', 'pages'); unknown roles are kept."""
    if name in _SPECIAL_ROLES:
        return _SPECIAL_ROLES[name]
    base = name.removesuffix("()").rsplit(".", 1)[-1]
    pool = "mamba" if "mamba_pool" in name else None
    if base.startswith("leaked_") and base.endswith("_pages"):
        return base.split("_")[1], "pages"
    for affix in ("full", "swa", "mamba"):
        if base.startswith(f"{affix}_") or base.endswith(f"_{affix}"):
            pool, base = affix, base.removeprefix(f"{affix}_").removesuffix(f"_{affix}")
    return pool, _ROLES.get(base, base)


def _file_terms(
    terms: list[tuple[str, str]], default_pool: str, pools: dict[str, PoolTerms], idle: bool, unit: str = ""
) -> None:
    """File each printed term under its pool (a term may name another pool, e.g. the full pool's
    leaked pages on the mamba line) and role."""
    for name, value in terms:
        owner, role = _role(name)
        key = owner or default_pool
        target = pools.setdefault(key, PoolTerms(key, None, idle=idle, unit=unit if key == default_pool else ""))
        target.printed[name] = value
        number = _int(value)
        if role == "pages":
            target.leaked_pages[name] = value
        elif role == "total" and number is not None:
            target.total = number
        elif number is not None and role not in ("engine_missing", "sum"):
            target.terms[role] = number  # PARTS, or an extra term a build printed (withheld, reserved…)


def _ordered(pool: PoolTerms) -> None:
    known = {role: pool.terms[role] for role in PARTS if role in pool.terms}
    pool.terms = {**known, **{k: v for k, v in pool.terms.items() if k not in known}}


def _tagged(leak: EngineLeak, lines: list[tuple[str | None, list[tuple[str, str]]]]) -> None:
    """0.5.14–0.5.23: one `[pool] total=…, available=…, …` line per pool."""
    leak.version_family = F0514
    pools: dict[str, PoolTerms] = {}
    for tag, terms in lines:
        name = tag or "full"
        unit = "bytes" if leak.anchor.startswith("pool-bytes") else ""
        _file_terms(terms, name, pools, leak.check == "idle", unit)
        if name in pools and pools[name].printed.get("dcp_physical_page_slack_allowed") == "True":
            leak.notes.append(f"[{name}]: SGLang tolerated this pool's page slack (DCP with page size > 1)")
    for pool in pools.values():
        _ordered(pool)
    leak.pools = list(pools.values())
    if any(p.pool.startswith("mamba") for p in leak.pools) and not any(p.leaked_pages for p in leak.pools):
        leak.notes.append("mamba checks list leaked page ids only on some allocators; none here")


def _untagged(leak: EngineLeak, lines: list[tuple[str | None, list[tuple[str, str]]]]) -> None:
    """0.4.6, 0.4.10 and 0.5.6–0.5.10: terms named after the scheduler's variables."""
    names = [name for _, terms in lines for name, _ in terms]
    pools: dict[str, PoolTerms] = {}
    for _, terms in lines:
        _file_terms(terms, "full", pools, idle=True)
    first = [name for name, _ in lines[0][1]] if lines else []
    if leak.version_family == F01:
        pass  # found by its own anchor
    elif "available_size" in first and "evictable_size" not in first and "self.max_total_num_tokens" in first:
        leak.version_family = F046
        _split_046(leak, pools["full"])
    elif any(n.endswith("leaked") for n in names) or "mamba" in pools or "session_held" in names:
        leak.version_family = F056
    else:
        leak.version_family = F0410
    if "mamba" in pools and "full" in pools and "held" not in pools["full"].terms:
        leak.notes.append(
            "[full]: SGLang also subtracts session-held tokens, which this text does not print (taken as 0)"
        )
    for pool in pools.values():
        _ordered(pool)
    leak.pools = [pools[name] for name in sorted(pools, key=_pool_order)]


def _pool_order(name: str) -> tuple[int, str]:
    return ({"full": 0, "swa": 1}.get(name, 2), name)


def _split_046(leak: EngineLeak, pool: PoolTerms) -> None:
    """0.4.6 prints `available_size` = free + evictable, then the two on lines of their own."""
    combined = pool.terms.pop("available", 0)
    free, evictable = pool.terms.pop("free_detail", None), pool.terms.pop("evictable_detail", None)
    if free is not None and evictable is not None and free + evictable == combined:
        pool.terms = {"available": free, "evictable": evictable, **pool.terms}
        return
    pool.terms = {"available": combined, **pool.terms}
    leak.notes.append("[full]: available is free + evictable here (0.4.6 prints them as one term)")


def _busy_untagged(leak: EngineLeak, opened: _Open) -> None:
    """The busy check before 0.5.14: `total_tokens=… vs self.max_total_num_tokens=…` (the sum
    only), or for SWA `full_total=… vs self.full_tokens_per_layer=…, full_available=…, …`."""
    leak.version_family = F056
    printed = [(name, value) for _, terms in opened.lines for name, value in terms]
    name = "swa" if leak.anchor.startswith("SWA") else "full"
    pool = PoolTerms(name, None, idle=False)
    for term, value in printed:
        pool.printed[term] = value
        role = _role(term)[1]
        number = _int(value)
        if number is None:
            continue
        if "tokens_per_layer" in term or "max_total_num_tokens" in term:
            pool.total = number
        elif role in ("total", "sum"):
            pool.terms.setdefault("sum", number)
        else:
            pool.terms[role] = number
    if len(pool.terms) > 1:
        pool.terms.pop("sum", None)
    _ordered(pool)
    leak.pools = [pool]
    if list(pool.terms) == ["sum"]:
        leak.notes.append(
            "the busy check prints only the sum of the terms; with "
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=2 the `[Mem Check (BUSY)]` lines before it "
            "hold each term"
        )


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


# -- explaining ------------------------------------------------------------------------------


def cannot_tell(leak: EngineLeak) -> str:
    """What the message cannot say, in one sentence."""
    pages = [f"{name}={value}" for pool in leak.pools for name, value in pool.leaked_pages.items() if value != "None"]
    if leak.kind == "use-after-free":
        return (
            "which owner still reads the freed pages, which request freed them, and when: SGLang checks the "
            "free list against the owners at an idle point only"
        )
    if pages:
        return (
            f"it names the leaked pages ({', '.join(pages)}) but not the request that held them or the free "
            "that never came"
        )
    what = "request rows" if leak.kind == "req-pool-leak" else "slots"
    return (
        f"which request leaked, which {what}, and when the leak began: SGLang's check prints totals only, "
        f"at the first {'busy step' if leak.check == 'busy' else 'idle point'} after the leak"
    )


def next_step(leak: EngineLeak, page_size: int | None = None) -> str:
    """The kvscope command that would name the culprit (the server's page size when known)."""
    model = " --model tiny-swa" if any(p.pool == "swa" for p in leak.pools) else ""
    command = (
        f"kvscope run --trace TRACE.jsonl{model} --page-size {page_size or 'PAGE_SIZE'} --debug "
        "--capture leak.db; "
        "kvscope report leaks leak.db"
    )
    mamba = (
        " (kvscope has no mamba pool: the full pool's leaks only)"
        if any(p.pool.startswith("mamba") for p in leak.pools)
        else ""
    )
    return (
        f"replay the same requests through kvscope's engine with the slot ledger on{mamba}: {command} "
        "(it names the pool, slots, request and the free that never came)"
    )


def _when(leak: EngineLeak) -> str:
    if leak.timestamp is None:
        return "no timestamp"
    rank = f" {leak.rank}" if leak.rank else ""
    source = "" if leak.timestamp_line in (None, leak.line) else f" (time of line {leak.timestamp_line})"
    return f"{leak.timestamp}{rank}{source}"


def _raised(leak: EngineLeak) -> str:
    return {
        "ValueError": "raised as ValueError: the scheduler died",
        "AssertionError": "raised as AssertionError by the busy check: the scheduler died",
        "UserWarning": "a warning: the server went on",
        "log": "logged: strict mode was off, so the server went on",
    }[leak.raised_as]


def leak_lines(
    index: int, leak: EngineLeak, page_size: int | None = None, probe: list[ProbeCensus] | None = None
) -> list[str]:
    lines = [
        f"  {index}. line {leak.line}, {_when(leak)}: {leak.anchor} — SGLang {leak.version_family} text, "
        f"{leak.check} check; {_raised(leak)}"
    ]
    lines += [f"       {pool.line()}" for pool in leak.pools]
    for pool in leak.short_pools:
        lines.append(f"     short: pool {pool.pool}: {pool.words()}{_why(pool)}")
    if leak.pages:
        lines.append("     " + ", ".join(f"{name}={value}" for name, value in leak.pages.items()))
    lines += [f"     note: {note}" for note in leak.notes]
    named = _probe_for(leak, probe or [])
    if named is None:
        lines.append(f"     cannot tell: {cannot_tell(leak)}")
        lines.append(f"     to find out: {next_step(leak, page_size)}")
        return lines
    lines.append(f"     kvscope's probe (line {named.line}, step {named.step}): {named.text}")
    where = named.command() if named.capture_exists else f"{named.command()} (the capture is not on this machine)"
    lines.append(f"     culprits: {where}")
    return lines


def _probe_for(leak: EngineLeak, probe: list[ProbeCensus]) -> ProbeCensus | None:
    """The probe's census printed closest before the message (the probe writes it first), else after."""
    before = [found for found in probe if found.line <= leak.line]
    return before[-1] if before else probe[0] if probe else None


def _why(pool: PoolTerms) -> str:
    gap = pool.missing
    if gap is None or pool.total is None:
        return ""
    parts = " + ".join(pool.terms)
    if gap > 0:
        return f" ({parts} = {pool.total - gap} of total {pool.total}: {gap} are owned by no term)"
    if gap < 0:
        return f" ({parts} = {pool.total - gap}, over total {pool.total}: a slot is in two terms at once)"
    return " (protected at an idle point: a lock that was never released)"


def render_text(report: EngineLogReport) -> str:
    count = len(report.leaks)
    lines = [f"engine log {report.log} — {report.lines_read:,} lines read"]
    if not report.leaks:
        lines.append("leak messages: none (no SGLang leak-check text in this log)")
    else:
        repeats = sum(1 for leak in report.leaks if leak.repeat_of)
        same = f" ({repeats} repeat an earlier one: other ranks or later checks)" if repeats else ""
        lines.append(f"leak messages: {count}{same}")
    lines += [f"crash: line {line}: {text[:160]}" for line, text in report.crash_lines[:3]]
    for index, leak in enumerate(report.leaks, 1):
        if leak.repeat_of is None:
            lines += leak_lines(index, leak, report.page_size, report.probe)
            again = [str(other.line) for other in report.leaks if other.repeat_of == index]
            if again:
                lines.append(f"     the same message again on line{'s' if len(again) > 1 else ''} {', '.join(again)}")
    if report.probe and not report.leaks:
        lines.append(
            f"kvscope's probe: {len(report.probe)} failed page census(es) SGLang's own check did not report "
            "(its count identity passed)"
        )
        lines += [
            f"  line {found.line}, step {found.step}: {found.text}; culprits: {found.command()}"
            for found in report.probe[:3]
        ]
    verdict = "leak" if report.leaks or report.probe else "none"
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)
