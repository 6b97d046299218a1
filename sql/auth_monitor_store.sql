-- The tables of usher's shared auth monitor store (auth_monitor.store).
--
-- usher runs this file itself at each connection to the store (with
-- create_tables: true, the default), in the schema auth_monitor.store.schema
-- (search_path is set to it), under an advisory lock so that instances
-- starting together do not race. With create_tables: false, run it once
-- beforehand as a role that may create tables there, e.g.
--
--   psql -d app -c 'SET search_path = usher' -f sql/auth_monitor_store.sql
--
-- and grant the store's user SELECT, INSERT, UPDATE, DELETE on the four
-- tables and USAGE on usher_auth_mon_resets_id_seq.
--
-- Every instance writes what it counted since its last flush (additions,
-- never absolute values) and reads the sums. Timestamps are usher's clock
-- (each instance's), in UTC. docs/security.md ("Auth monitoring", "Sharing
-- the counts between instances") describes how they are used.

-- pg_auth_mon's counters, summed over every instance. A row is keyed by the
-- role's oid when usher knows it (hooks.query; `name` is then ''), else by
-- the user name (`uid` 0); uid 0 with name '' is the row of every unknown
-- user name summed, as in pg_auth_mon.
CREATE TABLE IF NOT EXISTS usher_auth_mon_roles (
    uid oid NOT NULL,
    name text NOT NULL,
    successful_attempts bigint NOT NULL DEFAULT 0,
    last_successful_ts timestamptz,
    total_hba_conflicts bigint NOT NULL DEFAULT 0,
    other_auth_failures bigint NOT NULL DEFAULT 0,
    last_failed_ts timestamptz,
    login_name_at_last_attempt text NOT NULL DEFAULT '',
    blocked_attempts bigint NOT NULL DEFAULT 0,
    last_failed_addr text,
    last_attempt_ts timestamptz NOT NULL,
    PRIMARY KEY (uid, name)
);

-- The lockout's failures (wrong passwords, unknown user names) per user
-- name (scope 'role') or client address ('addr'), per instance and per
-- time slice (a twentieth of lockout.window_s, at least a second, starting
-- at `bucket`). Slices older than the window are deleted; a successful
-- login deletes its user name's rows.
CREATE TABLE IF NOT EXISTS usher_auth_mon_failures (
    scope text NOT NULL CHECK (scope IN ('role', 'addr')),
    key text NOT NULL,
    instance text NOT NULL,
    bucket timestamptz NOT NULL,
    failures bigint NOT NULL,
    PRIMARY KEY (scope, key, instance, bucket)
);
CREATE INDEX IF NOT EXISTS usher_auth_mon_failures_bucket
    ON usher_auth_mon_failures (bucket);

-- Locks in force (and for a minute after they end), whichever instance
-- engaged them.
CREATE TABLE IF NOT EXISTS usher_auth_mon_locks (
    scope text NOT NULL CHECK (scope IN ('role', 'addr')),
    key text NOT NULL,
    locked_until timestamptz NOT NULL,
    instance text NOT NULL,
    PRIMARY KEY (scope, key)
);

-- RESET AUTH_MON as run on one instance's console, for the others to apply
-- to their own tables (kept a day).
CREATE TABLE IF NOT EXISTS usher_auth_mon_resets (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    instance text NOT NULL,
    scope text NOT NULL CHECK (scope IN ('all', 'role', 'addr')),
    key text NOT NULL DEFAULT '',
    uid oid NOT NULL DEFAULT 0
);
