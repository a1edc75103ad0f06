"""The SQL of ``PostgresLifecycleSaver`` (``postgres/saver.py``): its advisory locks, the keep-checkpoints
prune, thread copies, deletes by run, and the reads of what the policy deleted.
"""

from reducing_saver.service.storage.lifecycle import EXT_DELTA_SNAPSHOT

# Two-key advisory locks live apart from one-key ones (the service's set-up lock is one key).
COPY_LOCK_CLASS = 0x72736374  # "rsct"
COPY_LOCK_SQL = "SELECT pg_advisory_xact_lock(%s, hashtext(%s))"

# Puts that keep the last K checkpoints of a thread take this lock before they prune it, so two replicas
# never prune one thread at once, and each prune sees what the one before it left.
KEEP_LOCK_CLASS = 0x72736B6B  # "rskk"
KEEP_LOCK_SQL = "SELECT pg_advisory_xact_lock(%s, hashtext(%s))"

# One statement: what keeping the last K checkpoints of one namespace drops (lifecycle.checkpoints_to_drop:
# the newest K, the branch heads and the ancestors their DeltaChannels are rebuilt from stay), with their
# writes, the blobs no kept checkpoint references, the kept children's parent link, and (for the root
# namespace) the subgraph calls that started from a deleted root checkpoint.
KEEP_LAST_SQL = """
WITH RECURSIVE cps AS (
    SELECT checkpoint_id, parent_checkpoint_id, checkpoint -> 'channel_versions' AS versions,
           CASE WHEN metadata ? 'delta_writes_versioned' THEN ARRAY['*']
                WHEN jsonb_typeof(metadata -> 'counters_since_delta_snapshot') = 'object'
                THEN ARRAY(SELECT jsonb_object_keys(metadata -> 'counters_since_delta_snapshot'))
                ELSE ARRAY[]::text[] END AS needs
    FROM checkpoints WHERE thread_id = %(thread)s AND checkpoint_ns = %(ns)s
), newest AS (
    SELECT checkpoint_id FROM cps ORDER BY checkpoint_id DESC LIMIT %(keep)s
), kept (checkpoint_id, missing) AS (
    SELECT checkpoint_id, needs FROM cps
    WHERE checkpoint_id IN (SELECT checkpoint_id FROM newest)
       OR checkpoint_id NOT IN (SELECT parent_checkpoint_id FROM cps WHERE parent_checkpoint_id IS NOT NULL)
    UNION
    -- A kept checkpoint missing a DeltaChannel's value keeps its parent, itself read back: so on, back to
    -- one holding every channel.
    SELECT parent.checkpoint_id, parent.needs
    FROM kept
    JOIN cps AS child ON child.checkpoint_id = kept.checkpoint_id
    JOIN cps AS parent ON parent.checkpoint_id = child.parent_checkpoint_id
    WHERE cardinality(kept.missing) > 0
), doomed AS (
    SELECT checkpoint_id, versions FROM cps WHERE checkpoint_id NOT IN (SELECT checkpoint_id FROM kept)
), freed AS (
    SELECT v.key AS channel, v.value AS version
    FROM doomed CROSS JOIN LATERAL jsonb_each_text(doomed.versions) AS v
    EXCEPT
    SELECT v.key, v.value
    FROM cps CROSS JOIN LATERAL jsonb_each_text(cps.versions) AS v
    WHERE cps.checkpoint_id NOT IN (SELECT checkpoint_id FROM doomed)
), blobs AS (
    DELETE FROM checkpoint_blobs AS b USING freed
    WHERE b.thread_id = %(thread)s AND b.checkpoint_ns = %(ns)s
      AND b.channel = freed.channel AND b.version = freed.version
    RETURNING 1
), writes AS (
    DELETE FROM checkpoint_writes AS w USING doomed
    WHERE w.thread_id = %(thread)s AND w.checkpoint_ns = %(ns)s AND w.checkpoint_id = doomed.checkpoint_id
    RETURNING 1
), gone AS (
    DELETE FROM checkpoints AS c USING doomed
    WHERE c.thread_id = %(thread)s AND c.checkpoint_ns = %(ns)s AND c.checkpoint_id = doomed.checkpoint_id
    RETURNING 1
), detached AS (
    UPDATE checkpoints AS c SET parent_checkpoint_id = NULL
    WHERE c.thread_id = %(thread)s AND c.checkpoint_ns = %(ns)s
      AND c.parent_checkpoint_id IN (SELECT checkpoint_id FROM doomed)
      AND c.checkpoint_id NOT IN (SELECT checkpoint_id FROM doomed)
    RETURNING 1
), calls AS (
    -- Pruning the root namespace: subgraph calls whose newest checkpoint started from a deleted root one.
    SELECT checkpoint_ns FROM (
        SELECT DISTINCT ON (checkpoint_ns) checkpoint_ns, metadata -> 'parents' ->> '' AS root
        FROM checkpoints
        WHERE thread_id = %(thread)s AND %(ns)s = '' AND position(':' in checkpoint_ns) > 0
        ORDER BY checkpoint_ns, checkpoint_id DESC
    ) AS heads
    WHERE root IN (SELECT checkpoint_id FROM doomed)
), call_checkpoints AS (
    DELETE FROM checkpoints AS c USING calls
    WHERE c.thread_id = %(thread)s AND c.checkpoint_ns = calls.checkpoint_ns
    RETURNING 1
), call_blobs AS (
    DELETE FROM checkpoint_blobs AS b USING calls
    WHERE b.thread_id = %(thread)s AND b.checkpoint_ns = calls.checkpoint_ns
    RETURNING 1
), call_writes AS (
    DELETE FROM checkpoint_writes AS w USING calls
    WHERE w.thread_id = %(thread)s AND w.checkpoint_ns = calls.checkpoint_ns
    RETURNING 1
)
{recorded}SELECT (SELECT count(*) FROM gone) AS checkpoints, (SELECT count(*) FROM blobs) AS blobs,
       (SELECT count(*) FROM writes) AS writes, (SELECT count(*) FROM detached) AS detached,
       (SELECT count(*) FROM call_checkpoints) + (SELECT count(*) FROM call_blobs)
       + (SELECT count(*) FROM call_writes) AS subgraph_call_rows
"""
KEEP_LAST_SQL, KEEP_LAST_RECORDING_SQL = (
    KEEP_LAST_SQL.format(recorded=""),
    # With the service's table of what the policy deleted (lifecycle.PRUNED_TABLE): the newest id deleted
    # in the namespace, and in each subgraph call's namespace deleted with its root checkpoint.
    KEEP_LAST_SQL.format(
        recorded=""", recorded AS (
    INSERT INTO {table} AS p (thread_id, checkpoint_ns, pruned_through)
    SELECT %(thread)s, %(ns)s, max(checkpoint_id COLLATE "C") FROM doomed HAVING count(*) > 0
    UNION ALL
    SELECT %(thread)s, c.checkpoint_ns, max(c.checkpoint_id COLLATE "C") FROM checkpoints AS c
    WHERE c.thread_id = %(thread)s AND c.checkpoint_ns IN (SELECT checkpoint_ns FROM calls)
    GROUP BY c.checkpoint_ns
    ON CONFLICT (thread_id, checkpoint_ns) DO UPDATE SET pruned_through = CASE
        WHEN EXCLUDED.pruned_through COLLATE "C" > p.pruned_through COLLATE "C" THEN EXCLUDED.pruned_through
        ELSE p.pruned_through END
    RETURNING 1
)
"""
    ),
)

# What the keep-checkpoints policy deleted (the service's table, named by the saver's ``pruned_table``).
PRUNED_THROUGH_SQL = """
SELECT p.pruned_through FROM {table} AS p WHERE p.thread_id = %s AND p.checkpoint_ns = %s
  AND NOT EXISTS (SELECT 1 FROM checkpoints c
                  WHERE c.thread_id = p.thread_id AND c.checkpoint_ns = p.checkpoint_ns AND c.checkpoint_id = %s)
"""
# reducing_saver_refuse_pruned_parent (a migration defines it) raises SQLSTATE RSP01 (detail: the newest
# deleted id) for a parent the policy deleted, so the whole put rolls back.
PRUNED_PARENT_SQLSTATE = "RSP01"

THREAD_IN_USE_SQL = """
SELECT EXISTS (SELECT 1 FROM checkpoints WHERE thread_id = %s)
    OR EXISTS (SELECT 1 FROM checkpoint_blobs WHERE thread_id = %s)
    OR EXISTS (SELECT 1 FROM checkpoint_writes WHERE thread_id = %s) AS in_use
"""

# One statement, so the three tables are read on one snapshot of the source thread.
COPY_THREAD_SQL = """
WITH c AS (
    INSERT INTO checkpoints
        (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata)
    SELECT %(target)s, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata
    FROM checkpoints WHERE thread_id = %(source)s
    RETURNING 1
), b AS (
    INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob)
    SELECT %(target)s, checkpoint_ns, channel, version, type, blob
    FROM checkpoint_blobs WHERE thread_id = %(source)s
    RETURNING 1
), w AS (
    INSERT INTO checkpoint_writes
        (thread_id, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob)
    SELECT %(target)s, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob
    FROM checkpoint_writes WHERE thread_id = %(source)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM c) AS checkpoints,
       (SELECT count(*) FROM b) AS blobs,
       (SELECT count(*) FROM w) AS writes
"""

DELETE_RUN_CHECKPOINTS_SQL = """
DELETE FROM checkpoints
WHERE jsonb_typeof(metadata -> 'run_id') = 'string' AND metadata ->> 'run_id' = ANY(%s)
  AND (%s::text IS NULL OR thread_id LIKE %s ESCAPE '\\')
RETURNING thread_id, checkpoint_ns, checkpoint_id, checkpoint -> 'channel_versions' AS versions
"""

DELETE_WRITES_SQL = """
DELETE FROM checkpoint_writes
WHERE thread_id = %s AND checkpoint_ns = %s AND checkpoint_id = ANY(%s)
"""

DETACH_CHILDREN_SQL = """
UPDATE checkpoints SET parent_checkpoint_id = NULL
WHERE thread_id = %s AND checkpoint_ns = %s AND parent_checkpoint_id = ANY(%s)
"""

REFERENCED_BLOBS_SQL = """
SELECT DISTINCT v.key AS channel, v.value AS version
FROM checkpoints c
CROSS JOIN LATERAL jsonb_each_text(c.checkpoint -> 'channel_versions') AS v
WHERE c.thread_id = %s AND c.checkpoint_ns = %s
"""

DELETE_BLOBS_SQL = """
DELETE FROM checkpoint_blobs
WHERE thread_id = %s AND checkpoint_ns = %s AND channel = %s AND version = ANY(%s)
"""

# The running-summary steps (the service's table, named by the saver's ``summaries_table``) of namespaces
# left without a checkpoint: of one namespace (delete_for_runs), of every namespace of threads (prune).
FORGET_NAMESPACE_SUMMARIES_SQL = """
DELETE FROM {table} AS s WHERE s.thread_id = %s AND s.checkpoint_ns = %s
  AND NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.thread_id = s.thread_id AND c.checkpoint_ns = s.checkpoint_ns)
"""
FORGET_THREAD_SUMMARIES_SQL = """
DELETE FROM {table} AS s WHERE s.thread_id = ANY(%s)
  AND NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.thread_id = s.thread_id AND c.checkpoint_ns = s.checkpoint_ns)
"""

# PostgresSaver marks a `_DeltaSnapshot` with an inline `true`; a snapshot stored verbatim from a client
# blob has no such marker, only its bytes: msgpack extension 7 as the whole value. CASE keeps the reads
# inside the value.
SNAPSHOT_BLOB_THREADS_SQL = f"""
SELECT DISTINCT thread_id FROM checkpoint_blobs
WHERE thread_id = ANY(%s) AND type = 'msgpack' AND CASE
    WHEN length(blob) < 2 THEN false
    WHEN get_byte(blob, 0) BETWEEN 212 AND 216 THEN get_byte(blob, 1) = {EXT_DELTA_SNAPSHOT}
    WHEN length(blob) < 3 THEN false
    WHEN get_byte(blob, 0) = 199 THEN get_byte(blob, 2) = {EXT_DELTA_SNAPSHOT}
    WHEN length(blob) < 4 THEN false
    WHEN get_byte(blob, 0) = 200 THEN get_byte(blob, 3) = {EXT_DELTA_SNAPSHOT}
    WHEN length(blob) < 6 THEN false
    WHEN get_byte(blob, 0) = 201 THEN get_byte(blob, 5) = {EXT_DELTA_SNAPSHOT}
    ELSE false
END
"""
