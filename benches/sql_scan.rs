//! The cost of reading a client's SQL for what it does to its session
//! (`frontend::sql_scan`): settings, and state that pins the server
//! connection. Every Query and Parse up to 64 KiB is scanned, so typical
//! OLTP statements must cost well under 1 µs (issue 13).
//!
//!     cargo bench --bench sql_scan

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use usher::frontend::sql_scan::scan;

const STATEMENTS: &[(&str, &str)] = &[
    ("select_by_key", "SELECT abalance FROM pgbench_accounts WHERE aid = $1"),
    (
        "update",
        "UPDATE pgbench_accounts SET abalance = abalance + $1 WHERE aid = $2",
    ),
    (
        "insert",
        "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES ($1, $2, $3, $4, CURRENT_TIMESTAMP)",
    ),
    (
        "orm_select",
        "SELECT \"users\".\"id\", \"users\".\"email\", \"users\".\"created_at\" FROM \"users\" \
         WHERE \"users\".\"tenant_id\" = $1 AND \"users\".\"deleted_at\" IS NULL \
         ORDER BY \"users\".\"created_at\" DESC LIMIT 20 /* app:web */",
    ),
    ("begin", "BEGIN"),
    ("set", "SET statement_timeout = '5s'"),
    ("listen", "LISTEN jobs"),
    ("advisory_lock", "SELECT pg_advisory_lock($1)"),
    (
        "create_temp",
        "CREATE TEMP TABLE staging (id bigint, payload jsonb) ON COMMIT DROP",
    ),
];

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("sql_scan");
    for (name, sql) in STATEMENTS {
        group.bench_function(*name, |b| b.iter(|| scan(black_box(sql.as_bytes()))));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
