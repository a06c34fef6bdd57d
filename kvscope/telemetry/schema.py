"""The capture schema (SQLAlchemy Core). Every row carries run_id, so one database holds
many runs; by default one capture = one SQLite file under runs/.

NOTE: tables and what one row is
    kvscope_meta     key/value; 'schema_version' says which schema wrote the file
    runs             one run: status, times, config fingerprint (JSON), host, pid, heartbeat
    events           one memory event (level full): seq, step, time, kind, pool, rid, node,
                     tokens, aux, reason, slots as int32 little-endian bytes
    usage            one scheduler step: per pool total/available/evictable/protected,
                     running/waiting requests, cumulative hit/prompt/evicted/retracted counters
    tree_snapshots   one node of the cache tree at a step (the flat node table)
    leak_checks      one pool's idle invariant at a step: every term and the verdict
    census_blocks    one block a probe's census names at a step, under one term (leak_checks.pool)
    requests         one request's life: principal, lengths, times and steps
    reports          a derived report stored with the run (the leak report, built when the run
                     closes): which events it covers (through_seq), who built it, its JSON
    event_retention  one run's retention (version 9): its bounds and the events it dropped, oldest
                     whole chunks first (first_seq: the first event still kept)
    ledger_checkpoints  one run's slot ledger as of an event (through_seq), so a replay starts there
                     when the events before it were dropped (debug/checkpoint.py writes and reads it)
    run_summaries    one run's chunk summaries folded into one (version 14): through which chunk, and
                     how many chunks and events it folds

NOTE: versions. A reader reads every version from OLDEST_READABLE_VERSION to SCHEMA_VERSION
and refuses a newer file (it cannot know what it would miss). A column added after version 1
names its version in `info["since"]`; a reader of an older file selects NULL in its place
(`columns_as_of`), and a writer brings an older file up to date (adds the columns and stores
the new version): every older row stays valid, with NULL in the added columns.
    1  the first schema
    2  events.principal: an insert event names the new node's owner, so a tree rebuilt from a
       snapshot and later events knows the owner of every node. NULL there means no owner was
       recorded (none, or an event written under version 1); a reader of a version-1 file sees
       NULL too, as a version-1 reader would have shown it.
    3  tree_snapshots.visibility: private / public / pinned (the scoped radix cache). Every cache
       before version 3 shared globally, so a reader shows NULL read from an older file as
       "public" (Capture fills it in); events gained the kinds promote, demote and cross_hit,
       and match events name their requester in principal.
    4  the host tier (hiradix): usage.host_total / host_available / host_evictable /
       host_protected and the cumulative cum_host_hit_tokens / cum_written_tokens /
       cum_loaded_tokens (NULL: the run had no host tier), tree_snapshots.tier (device,
       device+host or host; NULL read from an older file is "device", every older cache had
       one tier); events gained the kinds write, load, ack and host_evict, and the evict
       reasons to-host and drop.
    5  attached engines (`kvscope attach`): usage.full_used, the device tokens in use as the
       source counts them (engine runs write total - available - evictable; NULL read from an
       older file is that same difference, as Capture computes it). In a file created at version 5
       the usage columns an attached engine may not report are nullable (full_available,
       full_evictable, full_protected, req_total, req_available, num_running, num_waiting and
       the cum_* counters): NULL there means "the source does not say". A file upgraded from an
       older version keeps NOT NULL on them (SQLite cannot relax a column), so an attached run
       is refused there (attach_ready tells); engine runs write every one of them, as before;
       the evict reason reset (the engine's cache was cleared).
    6  events packed by column (telemetry/packed.py): a run's events are chunks
       (event_chunks, event_columns, event_strings) instead of one `events` row each. A run
       written before version 6 keeps its rows, and readers read either (EventSource); a file
       upgraded to 6 can hold runs of both layouts. `kvscope upgrade` packs an older file's rows.
       A file of version 6 without the packed tables has lost its events: readers refuse it.
    7  a fleet's routing (`kvscope serve --dp-size N`): requests.dispatch (the dispatch method
       that chose this replica), requests.routed_cached_tokens (prompt tokens the router saw cached
       on the chosen replica when the request arrived) and requests.elsewhere_cached_tokens (the
       most prompt tokens cached on any other replica then). NULL: the request was not routed
       among replicas (one engine, or a file written before version 7). tree_snapshots.page_hashes:
       the node's full pages' chained hashes, 8 bytes each (telemetry/page_hash.py; a vLLM block:
       its own block hash's first 8 bytes), so a fleet's replicas can be compared page by page
       (duplicated prefixes). NULL: not known (a source that does not hash, a node whose parent
       chain breaks, or a file written before version 7).
    8  census_blocks: every block (page) a probe's census names, one row per block and term, with its
       ref count, the references accounted for, and who last took and released it. A leak check's
       message names at most a few blocks; these rows name all. A file older than version 8 has no
       such table: its readers fall back on the messages (a writer adds it to the file). A leak check
       or a census block repeated at the same (step, pool/term), two censuses in one step (a live poll
       and the idle census), keeps its first row, except that a failing leak check replaces a passing
       one (store.upsert_statement): a failure is never lost to a duplicate, and never a write error.
       leak_checks.census: which census a probe's check row belongs to (busy: periodic, between
       steps while the engine works; idle: at a busy -> idle edge; drain: the last one, as the
       engine shuts down; crash: the last one after an engine error, reading what the error left;
       poll: a live GET /kvscope/census). NULL: not a probe's census (kvscope's
       own engines check at idle points) or a file written before version 8.
    9  retention (docs/captures.md): event_retention (a run's bounds, and which events it dropped:
       events before first_seq are gone, in whole chunks, oldest first), ledger_checkpoints (the
       ledger's state as of through_seq, from which a replay resumes), event_chunks.num_bytes (the
       chunk's packed bytes, so a run's size is a sum; NULL: a chunk written before version 9).
       A run without an event_retention row dropped nothing: its chunks start at seq 0.
   10  summaries a page reads instead of scanning events (the dashboard at 100 M events):
       event_chunks.kind_counts (the chunk's events per kind) and event_chunks.groups (its match
       and cross-hit tokens per principal, its evictions per reason and pool, its lookups per
       stop reason: packed.summaries), JSON, so a run's event counts, principals, reuse, eviction
       summary and lookup stops are sums over its chunk rows; retention drops them with their
       chunk, so they always describe the events kept. NULL: a chunk written before version 10
       (readers compute its summaries from its columns; `kvscope upgrade` stores them).
       ix_requests_principal: a run's request principals, one index seek per principal.
   11  what a chunk carries to a read at one step (telemetry/carry.py), so the Evictions page's chart
       and the Radix tree page's lock holders read one value per chunk at 100 M events:
       event_chunks.evict_steps (its evictions per step: step, evictions, tokens, first t_mono) and
       event_chunks.lock_carry (per node and holder, the unlocks that release locks taken before the
       chunk and the chunk's locks still held at its end) and event_chunks.request_carry (each
       request's latest match, where the chunk leaves it running, and the requests it ends), so the
       Memory page's running requests do too. NULL: a chunk written before 11 (readers compute them
       from its columns; `kvscope upgrade` stores them).
   12  a run's request sums, kept by the writer as it writes the request rows (request_sums.py), so the
       Requests page reads a few hundred rows at 100 M events: request_sums (per principal and status:
       requests, prompt and cached tokens, retractions) and request_latencies (per principal, latency and
       bucket: requests, least and greatest latency), and runs.request_sums, true for a run whose every
       request row is summed there (its writer kept them, or `kvscope upgrade` stored them). NULL: a run
       written before 12 (readers read its request rows). Request rows are never dropped (retention), and
       neither are these sums.
   13  event_chunks.miss_nodes (carry.py): the distinct nodes at which the chunk's matches stopped
       having missed tokens, so the Evictions page's log finds each evicted node's first later miss
       in the few chunks that name it, not in every match of the run. NULL: a chunk written before
       13 (readers compute it from its columns; `kvscope upgrade` stores it). ix_requests_arrive_t:
       a run's first arrival (Capture.first_arrival, the pages' clock without a config anchor) in one
       index seek, not a pass over every request row (3.6-4.7 s at 100 M events).
   14  run_summaries: a run's chunk summaries (version 10's kind_counts and groups) folded into one row
       (packed.SummaryFold: counts and sums added, least and greatest kept, per key), which the writer
       updates in a transaction that writes chunks it folds (every one, or every few chunks for a fold
       of many keys: writer.FOLD_ROWS_PER_CHUNK; and the closing one), so a run's event counts, principals,
       reuse, eviction summary and lookup stops read one row and the chunks written after it (a few at
       most), not every chunk (1 s of the Memory page's 2.6 s at 100 M events). It folds the
       run's chunks numbered up to through_chunk: num_chunks of them, num_events events. A reader uses
       it only where the chunks kept up to there still count that many (retention drops whole chunks and
       the row cannot take them out: their least and greatest steps are lost in it), and otherwise reads
       every chunk; after a drop the writer stores an empty fold (through_chunk -1). No row: a run
       written before 14 (`kvscope upgrade` stores it).
On PostgreSQL every integer column is BIGINT (SQLite's integers are 64-bit already); a server
database is versioned and upgraded as a file is, under an advisory lock (store._ensure_schema).
`reports` came after version 1 without a bump: it is an additive table (older readers never
look at it), a reader treats it as optional, and a writer adds it to an older file. A column
got a bump because a version-1 reader cannot see it and would show an owner as missing.

NOTE: this module is the one declaration of every table's columns; the recorder (its row
tuples), the readers, the tree replay and the ledger take their column names from the tuples
below (EVENT_COLUMNS, TREE_NODE_COLUMNS, ...), never from a list of their own.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    ColumnElement,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    null,
)
from sqlalchemy.ext.compiler import compiles


@compiles(Integer, "postgresql")
def _bigint_on_postgresql(_type: Integer, _compiler: Any, **_kw: Any) -> str:
    """NOTE: every integer column is 64-bit on PostgreSQL, as SQLite's are: seqs, steps and token counters
    of a long run pass 2**31 (the primary key runs.id stays SERIAL); a SQLite file is unchanged."""
    return "BIGINT"


SCHEMA_VERSION = 14
OLDEST_READABLE_VERSION = 1
metadata = MetaData()

meta = Table(
    "kvscope_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

runs = Table(
    "runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("label", String(200), nullable=False, default=""),
    Column("status", String(16), nullable=False),  # running / finished / crashed
    Column("started_at", Float, nullable=False),  # unix seconds
    Column("ended_at", Float),
    Column("heartbeat_at", Float),
    Column("host", String(200)),
    Column("pid", Integer),
    Column("level", String(16), nullable=False),
    Column("config", Text, nullable=False),  # JSON fingerprint
    Column("error", Text),
    Column("request_sums", Boolean, info={"since": 12}),  # every request row is summed in request_sums
)

events = Table(
    "events",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("step", Integer, nullable=False),
    Column("t_mono", Float, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("pool", String(8)),
    Column("rid", String(64)),
    Column("node_id", Integer),
    Column("num_tokens", Integer, nullable=False),
    Column("aux", Integer, nullable=False),
    Column("reason", String(16)),
    Column("principal", String(64), info={"since": 2}),  # insert: the new node's owner
    Column("slots", LargeBinary),  # NOTE: last: the recorder converts the last field of a buffered event
)
EVENT_COLUMNS = tuple(c.name for c in events.columns)
ix_events_step = Index("ix_events_step", events.c.run_id, events.c.step)
ix_events_kind = Index("ix_events_kind", events.c.run_id, events.c.kind, events.c.step)
# NOTE: rid and node_id keys are scattered, so maintaining these two while recording costs
# ~2.6x the insert rate (bench_recorder); the recorder builds them when a run closes.
# A run that was killed has none until the next run into the same file closes.
ix_events_rid = Index("ix_events_rid", events.c.run_id, events.c.rid)
ix_events_node = Index("ix_events_node", events.c.run_id, events.c.node_id)
DEFERRED_INDEXES = (ix_events_rid, ix_events_node)
for _index in DEFERRED_INDEXES:
    events.indexes.discard(_index)  # not made by create_all

POOL_COLUMNS = ("total", "available", "evictable", "protected")
usage = Table(
    "usage",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("t_mono", Float, nullable=False),
    Column("full_total", Integer, nullable=False),
    # NOTE: nullable since version 5 (an attached engine may not report them; see the version notes)
    *(Column(f"full_{c}", Integer) for c in POOL_COLUMNS[1:]),
    *(Column(f"swa_{c}", Integer) for c in POOL_COLUMNS),
    Column("req_total", Integer),
    Column("req_available", Integer),
    Column("num_running", Integer),
    Column("num_waiting", Integer),
    Column("cum_prompt_tokens", Integer),
    Column("cum_hit_tokens", Integer),
    Column("cum_requests", Integer),
    Column("cum_hit_requests", Integer),
    Column("cum_evicted_tokens", Integer),
    Column("cum_retractions", Integer),
    *(Column(f"host_{c}", Integer, info={"since": 4}) for c in POOL_COLUMNS),
    Column("cum_host_hit_tokens", Integer, info={"since": 4}),  # of cum_hit_tokens, loaded back from the host
    Column("cum_written_tokens", Integer, info={"since": 4}),  # device -> host copies started
    Column("cum_loaded_tokens", Integer, info={"since": 4}),  # host -> device copies started
    Column("full_used", Integer, info={"since": 5}),  # device tokens in use (engine runs: total - avail. - evictable)
)
# NOTE: usage columns NOT NULL in files created before version 5; an attached run needs them nullable
ATTACH_NULLABLE_USAGE = (
    "full_available",
    "full_evictable",
    "full_protected",
    "req_total",
    "req_available",
    "num_running",
    "num_waiting",
    "cum_prompt_tokens",
    "cum_hit_tokens",
    "cum_requests",
    "cum_hit_requests",
    "cum_evicted_tokens",
    "cum_retractions",
)

tree_snapshots = Table(
    "tree_snapshots",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("node_id", Integer, primary_key=True),
    Column("parent_id", Integer),
    Column("num_tokens", Integer, nullable=False),
    Column("token_preview", String(200), nullable=False),
    Column("lock_ref", Integer, nullable=False),
    Column("last_access_time", Float, nullable=False),
    Column("hit_count", Integer, nullable=False),
    Column("owner", String(64)),
    Column("tombstone", Boolean, nullable=False),
    Column("depth_tokens", Integer, nullable=False),
    Column("visibility", String(8), info={"since": 3}),  # private / public / pinned
    Column("tier", String(12), info={"since": 4}),  # device / device+host / host
    Column("page_hashes", LargeBinary, info={"since": 7}),  # 8 bytes per full page, chained from the root
)
TREE_SNAPSHOT_COLUMNS = tuple(c.name for c in tree_snapshots.columns)
TREE_NODE_COLUMNS = TREE_SNAPSHOT_COLUMNS[2:]  # a node's fields: a snapshot row after run_id, step

leak_checks = Table(
    "leak_checks",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("pool", String(8), primary_key=True),
    Column("t_mono", Float, nullable=False),
    Column("total", Integer, nullable=False),
    Column("available", Integer, nullable=False),
    Column("evictable", Integer, nullable=False),
    Column("protected", Integer, nullable=False),
    Column("held", Integer, nullable=False),
    Column("uncached", Integer, nullable=False),
    Column("ok", Boolean, nullable=False),
    Column("message", Text),
    Column("census", String(8), info={"since": 8}),  # busy / idle / drain / crash / poll; NULL: not a probe's census
)
LEAK_CHECK_COLUMNS = tuple(c.name for c in leak_checks.columns)
LEAK_CHECK_KEY = ("run_id", "step", "pool")

# NOTE: version 8: every block a census names (census.census_blocks); a term's failing leak check at the same
# step names them in its message too, cut after a few
census_blocks = Table(
    "census_blocks",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("term", String(8), primary_key=True),  # the leak check's pool: leaked, lostref, unqueued, ...
    Column("block", Integer, primary_key=True),  # the block (vLLM) or page (SGLang) id
    Column("ref", Integer),  # its ref count then; NULL: the term reads none
    Column("accounted", Integer),  # the references its holders account for; NULL: the term counts none
    Column("taker_rid", String(64)),  # who last took it (alloc or touch), at which step, by which event
    Column("taker_step", Integer),
    Column("taker_event", String(16)),
    Column("releaser_rid", String(64)),  # who last released it (a free), at which step, by which event
    Column("releaser_step", Integer),
    Column("releaser_event", String(16)),
)
CENSUS_BLOCK_COLUMNS = tuple(c.name for c in census_blocks.columns)
CENSUS_BLOCK_KEY = ("run_id", "step", "term", "block")
CENSUS_SINCE = 8

REQUEST_MOMENTS = ("arrive", "admit", "first_token", "finish", "retract")
requests = Table(
    "requests",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("rid", String(64), primary_key=True),
    Column("principal", String(64)),
    Column("status", String(16), nullable=False),  # running / finished / aborted / unfinished
    Column("prompt_len", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("output_len", Integer, nullable=False),
    Column("num_retractions", Integer, nullable=False),
    *(Column(f"{m}_t", Float) for m in REQUEST_MOMENTS),
    *(Column(f"{m}_step", Integer) for m in REQUEST_MOMENTS),
    Column("dispatch", String(24), info={"since": 7}),  # the fleet's dispatch method; NULL: not routed
    Column("routed_cached_tokens", Integer, info={"since": 7}),  # cached on the chosen replica at arrival
    Column("elsewhere_cached_tokens", Integer, info={"since": 7}),  # most cached on any other replica then
)
Index("ix_tree_step", tree_snapshots.c.run_id, tree_snapshots.c.step)
# NOTE: version 6: the Requests page reads a page of a run's requests in arrival order (files made
# before it have no such index and sort instead)
Index("ix_requests_arrival", requests.c.run_id, requests.c.arrive_step, requests.c.rid)
# NOTE: version 10: a run's principals, hopped through (store.distinct_in_key); a writer adds it to an older file
ix_requests_principal = Index("ix_requests_principal", requests.c.run_id, requests.c.principal)
# NOTE: version 13: a run's first arrival (the pages' clock when the config has no anchor), one seek
ix_requests_arrive_t = Index("ix_requests_arrive_t", requests.c.run_id, requests.c.arrive_t)
INDEXES_SINCE = {
    10: (ix_requests_principal,),
    13: (ix_requests_arrive_t,),
}  # NOTE: the indexes of existing tables a version added

# NOTE: version 12, the writer's sums of a run's requests (request_sums.py); principal '' for none
request_sums = Table(
    "request_sums",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("principal", String(64), primary_key=True),
    Column("status", String(16), primary_key=True),
    Column("num_requests", Integer, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("retractions", Integer, nullable=False),
)
request_latencies = Table(
    "request_latencies",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("principal", String(64), primary_key=True),
    Column("latency", String(24), primary_key=True),  # a name of request_sums.REQUEST_LATENCIES
    Column("bucket", Integer, primary_key=True),
    Column("num_requests", Integer, nullable=False),
    Column("min_ms", Float, nullable=False),
    Column("max_ms", Float, nullable=False),
)
REQUEST_SUM_TABLES = (request_sums, request_latencies)
REQUEST_SUMS_SINCE = 12

reports = Table(
    "reports",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("kind", String(16), primary_key=True),  # 'leaks'
    Column("through_seq", Integer, nullable=False),  # the last event it covers; -1 = none
    Column("built_at", Float, nullable=False),  # unix seconds
    Column("producer", String(64), nullable=False),  # what built it (kvscope version, report format)
    Column("body", Text, nullable=False),
)
# NOTE: version 6, events packed by column (packed.py): a chunk's row, its columns, the run's strings
event_chunks = Table(
    "event_chunks",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("chunk", Integer, primary_key=True),
    Column("first_seq", Integer, nullable=False),
    Column("num_events", Integer, nullable=False),
    Column("first_step", Integer, nullable=False),
    Column("last_step", Integer, nullable=False),
    Column("kinds", Text, nullable=False),  # the distinct kinds, comma-separated
    Column("num_bytes", Integer, info={"since": 9}),  # its columns' packed bytes; NULL: written before 9
    Column("kind_counts", Text, info={"since": 10}),  # {kind: events}, JSON; NULL: written before 10
    Column("groups", Text, info={"since": 10}),  # its events grouped for the pages' sums (packed.summaries), JSON
    Column("evict_steps", LargeBinary, info={"since": 11}),  # its evictions per step (carry.py); NULL: before 11
    Column("lock_carry", LargeBinary, info={"since": 11}),  # its net change to the locks held (carry.py)
    Column("request_carry", LargeBinary, info={"since": 11}),  # the requests it leaves running or ends (carry.py)
    Column("miss_nodes", LargeBinary, info={"since": 13}),  # the nodes its matches missed at (carry.py)
)
CHUNK_SUMMARY_SINCE = 10
CARRY_SINCE = 11
MISS_NODES_SINCE = 13
event_columns = Table(
    "event_columns",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("chunk", Integer, primary_key=True),
    Column("name", String(16), primary_key=True),
    Column("dtype", String(8), nullable=False),  # NOTE: the stored type of `data` (packed.narrow)
    Column("data", LargeBinary, nullable=False),
)
event_strings = Table(
    "event_strings",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("code", Integer, primary_key=True),
    Column("text", Text, nullable=False),
)
# NOTE: a read by kind or request looks its strings' codes up by text (the dictionary of a long run holds
# hundreds of thousands of request ids)
Index("ix_event_strings_text", event_strings.c.run_id, event_strings.c.text)
PACKED_TABLES = (event_chunks, event_columns, event_strings)
PACKED_SINCE = 6
# NOTE: version 9, retention: what a run keeps of its events, and the ledger's state where they start
event_retention = Table(
    "event_retention",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("keep_events_s", Float),  # the window set by the user; NULL: no time bound
    Column("max_bytes", Integer),  # the size bound; NULL: none
    Column("first_seq", Integer, nullable=False),  # the first event kept: every event before it was dropped
    Column("first_step", Integer, nullable=False),  # that event's step (-1: nothing dropped yet)
    Column("dropped_chunks", Integer, nullable=False),
    Column("dropped_bytes", Integer, nullable=False),  # the dropped chunks' packed bytes
    Column("dropped_at", Float),  # unix seconds of the last drop
)
ledger_checkpoints = Table(
    "ledger_checkpoints",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("through_seq", Integer, nullable=False),  # the last event the state covers
    Column("step", Integer, nullable=False),  # that event's step
    Column("producer", String(64), nullable=False),  # what wrote it (a state of another format is not read)
    Column("built_at", Float, nullable=False),
    Column("body", LargeBinary, nullable=False),
)
RETENTION_TABLES = (event_retention, ledger_checkpoints)
RETENTION_SINCE = 9
# NOTE: version 14, a run's chunk summaries folded (packed.SummaryFold), written with the chunks it folds
run_summaries = Table(
    "run_summaries",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("through_chunk", Integer, nullable=False),  # the last chunk folded (-1: none)
    Column("num_chunks", Integer, nullable=False),  # the chunks folded: every chunk numbered up to through_chunk
    Column("num_events", Integer, nullable=False),  # their events
    Column("kind_counts", Text, nullable=False),  # {kind: events}, JSON, as a chunk's
    Column("groups", Text, nullable=False),  # a chunk's groups (packed.summaries), merged by key, JSON
)
RUN_SUMMARY_COLUMNS = tuple(c.name for c in run_summaries.columns)
RUN_SUMMARIES_SINCE = 14
OPTIONAL_TABLES = (
    reports,
    census_blocks,
    *PACKED_TABLES,
    *RETENTION_TABLES,
    *REQUEST_SUM_TABLES,
    run_summaries,
)  # NOTE: older files lack the packed tables (< 6), census_blocks (< 8), the retention tables (< 9), the request
# sums (< 12), run_summaries (< 14)
USAGE_COLUMNS = tuple(c.name for c in usage.columns)
REQUEST_COLUMNS = tuple(c.name for c in requests.columns)


def optional_tables(version: int) -> tuple[Table, ...]:
    """The tables a file of `version` may lack: from version 6 on the packed tables hold its
    events (a writer creates them when it brings an older file up to date), so a file without
    them has lost its events; census_blocks came with version 8, the retention tables with 9, the
    request sums with 12, run_summaries with 14."""
    census = (census_blocks,) if version < CENSUS_SINCE else ()
    retention = RETENTION_TABLES if version < RETENTION_SINCE else ()
    sums = REQUEST_SUM_TABLES if version < REQUEST_SUMS_SINCE else ()
    folds = (run_summaries,) if version < RUN_SUMMARIES_SINCE else ()
    return (reports, *census, *retention, *sums, *folds) if version >= PACKED_SINCE else OPTIONAL_TABLES


def since_version(column: Column) -> int:
    """The schema version that added `column`."""
    return int(column.info.get("since", 1))


def added_after(version: int) -> list[Column]:
    """Columns a file of `version` lacks (a writer adds them when it upgrades the file)."""
    return [c for table in metadata.sorted_tables for c in table.columns if since_version(c) > version]


def columns_as_of(table: Table, version: int) -> list[ColumnElement]:
    """`table`'s columns as a reader selects them from a file of `version`: a column added
    later reads as NULL under its own name."""
    return [c if since_version(c) <= version else null().label(c.name) for c in table.columns]
