//! TLS under load, in session and transaction mode: large results, COPY TO
//! STDOUT and COPY FROM STDIN of varied sizes (around the 8 KB and 16 KB
//! record sizes too), many rounds, from tokio-postgres (async) and from the
//! blocking libpq-style client of common::libpq at once. usher speaks TLS to
//! the clients and to PostgreSQL. Every result is checked byte for byte, and
//! a hang fails the test (the libpq-style client's waits are bounded, and
//! the whole run is under a timeout).

use crate::common::libpq::LibpqClient;
use crate::common::tls::{tls_connect, write_file, TestCa};
use crate::common::{PgCluster, Usher};
use bytes::Bytes;
use futures_util::{SinkExt, TryStreamExt};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// Result value sizes: small, around one and two TLS records, and larger.
const SIZES: [usize; 12] = [
    0, 1, 100, 4395, 8187, 8192, 8193, 16379, 16384, 16389, 40000, 100000,
];
/// Rounds per client; each round runs every size once, one COPY each way.
const ROUNDS: usize = 6;
/// Rows of the COPY tables; row `i` holds `(i * 7919) % COPY_WIDTH` letters.
const COPY_ROWS: usize = 400;
const COPY_WIDTH: usize = 6000;
/// The whole run; a hang ends the test here at the latest.
const LIMIT: Duration = Duration::from_secs(120);

struct Env {
    pg: &'static PgCluster,
    ca: TestCa,
    cert: PathBuf,
    key: PathBuf,
    _dir: tempfile::TempDir,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        // A cluster of its own: its server certificate is this module's.
        let pg = PgCluster::own(module_path!());
        let ca = TestCa::new("usher stress CA");
        pg.enable_tls(&ca.server(&["localhost"]));
        let dir = tempfile::tempdir().unwrap();
        let usher = ca.server(&["127.0.0.1"]);
        let cert = write_file(dir.path(), "usher.crt", &usher.cert_pem);
        let key = write_file(dir.path(), "usher.key", &usher.key_pem);
        Env {
            pg,
            ca,
            cert,
            key,
            _dir: dir,
        }
    })
}

async fn start_usher(mode: &str) -> Usher {
    let e = env();
    let extra = format!(
        "tls:\n  mode: require\n  cert: {}\n  key: {}\nauth:\n  method: trust\npool_mode: {mode}\n",
        e.cert.display(),
        e.key.display()
    );
    Usher::start(e.pg, &extra).await
}

/// tokio-postgres over usher's TLS (the handshake done by the harness).
async fn connect_async(usher: &Usher) -> tokio_postgres::Client {
    let tls = tls_connect(usher.addr, &env().ca.cert_pem).await;
    let mut config = tokio_postgres::Config::new();
    config
        .user("alice")
        .dbname("app")
        .ssl_mode(tokio_postgres::config::SslMode::Disable);
    let (client, conn) = config
        .connect_raw(tls, tokio_postgres::NoTls)
        .await
        .expect("alice connects over TLS");
    tokio::spawn(conn);
    client
}

/// Rows for a result of about 300 KB with values of `size` bytes.
fn rows_for(size: usize) -> usize {
    (300_000 / (size + 1)).clamp(3, 2000)
}

fn result_sql(size: usize) -> String {
    format!(
        "select repeat(chr(65 + i % 26), {size}) from generate_series(1, {}) i",
        rows_for(size)
    )
}

fn letter(i: usize) -> char {
    (b'A' + (i % 26) as u8) as char
}

/// COPY's text for the rows `1..=COPY_ROWS` (`id`, then the letters).
fn copy_text() -> Vec<u8> {
    let mut out = Vec::new();
    for i in 1..=COPY_ROWS {
        let data: String = std::iter::repeat_n(letter(i), (i * 7919) % COPY_WIDTH).collect();
        out.extend_from_slice(format!("{i}\t{data}\n").as_bytes());
    }
    out
}

fn copy_out_sql() -> String {
    format!(
        "copy (select i, repeat(chr(65 + i % 26), (i * 7919) % {COPY_WIDTH}) \
         from generate_series(1, {COPY_ROWS}) i) to stdout"
    )
}

/// Counts the rows of `table` that hold what copy_text() wrote, and all.
fn check_sql(table: &str) -> String {
    format!(
        "select count(*) filter (where data = repeat(chr(65 + id % 26), (id * 7919) % {COPY_WIDTH})), \
         count(*) from {table}"
    )
}

/// Pieces of `data` of varied sizes (CopyData messages as a client sends).
fn pieces(data: &[u8], round: usize) -> Vec<Vec<u8>> {
    let cuts = [7, 1000, 8192, 8193, 16384, 70000, 200000];
    let mut out = Vec::new();
    let mut rest = data;
    let mut k = round;
    while !rest.is_empty() {
        let n = cuts[k % cuts.len()].min(rest.len());
        out.push(rest[..n].to_vec());
        rest = &rest[n..];
        k += 1;
    }
    out
}

/// The async client's rounds. In transaction mode each round also runs
/// inside an explicit transaction, so the server connection stays attached
/// across statements as in session mode.
async fn async_rounds(client: tokio_postgres::Client, table: String, in_transaction: bool) {
    let expected_copy = copy_text();
    client
        .batch_execute(&format!(
            "drop table if exists {table}; create table {table} (id int, data text)"
        ))
        .await
        .unwrap();
    for round in 0..ROUNDS {
        let explicit = in_transaction && round % 2 == 1;
        if explicit {
            client.batch_execute("begin").await.unwrap();
        }
        for (k, size) in SIZES.into_iter().enumerate() {
            let sql = result_sql(size);
            let lengths: Vec<usize> = if (k + round) % 2 == 0 {
                // Extended protocol.
                let rows = client.query(&sql, &[]).await.unwrap();
                rows.iter().map(|r| r.get::<_, String>(0).len()).collect()
            } else {
                client
                    .simple_query(&sql)
                    .await
                    .unwrap()
                    .into_iter()
                    .filter_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap().len()),
                        _ => None,
                    })
                    .collect()
            };
            assert_eq!(
                lengths,
                vec![size; rows_for(size)],
                "round {round}, size {size}"
            );
        }
        let copied: Vec<Bytes> = client
            .copy_out(&copy_out_sql())
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        assert!(
            copied.concat() == expected_copy,
            "round {round}: COPY TO STDOUT differs"
        );
        client
            .batch_execute(&format!("truncate {table}"))
            .await
            .unwrap();
        let sink = client
            .copy_in::<_, Bytes>(&format!("copy {table} from stdin"))
            .await
            .unwrap();
        futures_util::pin_mut!(sink);
        for piece in pieces(&expected_copy, round) {
            sink.send(Bytes::from(piece)).await.unwrap();
        }
        assert_eq!(sink.finish().await.unwrap(), COPY_ROWS as u64);
        let row = client.query_one(&check_sql(&table), &[]).await.unwrap();
        let (right, all): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(
            (right, all),
            (COPY_ROWS as i64, COPY_ROWS as i64),
            "round {round}"
        );
        if explicit {
            client.batch_execute("commit").await.unwrap();
        }
    }
    client
        .batch_execute(&format!("drop table {table}"))
        .await
        .unwrap();
}

/// The same rounds from the blocking libpq-style client.
fn sync_rounds(mut client: LibpqClient, table: &str, in_transaction: bool) {
    let expected_copy = copy_text();
    client.query(&format!(
        "drop table if exists {table}; create table {table} (id int, data text)"
    ));
    for round in 0..ROUNDS {
        let explicit = in_transaction && round % 2 == 0;
        if explicit {
            client.query("begin");
        }
        for size in SIZES {
            let out = client.query(&result_sql(size));
            let rows = rows_for(size);
            assert_eq!(out.rows, rows, "round {round}, size {size}");
            // A DataRow of one text column: column count, length, value.
            assert_eq!(
                out.bytes,
                rows * (2 + 4 + size),
                "round {round}, size {size}"
            );
        }
        let out = client.copy_out(&copy_out_sql());
        assert!(
            out.copied == expected_copy,
            "round {round}: COPY TO STDOUT differs"
        );
        client.query(&format!("truncate {table}"));
        let out = client.copy_in(
            &format!("copy {table} from stdin"),
            &pieces(&expected_copy, round + 3),
        );
        assert_eq!(out.tag, format!("COPY {COPY_ROWS}"));
        let out = client.query(&check_sql(table));
        assert_eq!(out.rows, 1);
        // The row is "400" twice: 2 + (4 + 3) * 2 bytes.
        assert_eq!(out.bytes, 2 + 2 * (4 + COPY_ROWS.to_string().len()));
        if explicit {
            client.query("commit");
        }
    }
    client.query(&format!("drop table {table}"));
    client.close();
}

/// Two async clients and one libpq-style client at once, all checked.
async fn stress(mode: &str) {
    let usher = start_usher(mode).await;
    let in_transaction = mode == "transaction";
    let mut tasks = Vec::new();
    for n in 0..2 {
        let client = connect_async(&usher).await;
        let table = format!("stress_{mode}_async_{n}");
        tasks.push(tokio::spawn(async_rounds(client, table, in_transaction)));
    }
    let client = LibpqClient::connect(usher.addr, &env().ca.cert_pem, "alice").await;
    let table = format!("stress_{mode}_sync");
    tasks.push(tokio::task::spawn_blocking(move || {
        sync_rounds(client, &table, in_transaction)
    }));
    tokio::time::timeout(LIMIT, async {
        for t in tasks {
            t.await.expect("a client's rounds");
        }
    })
    .await
    .expect("the clients finished: none hung");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_results_and_copy_both_ways_over_tls_in_session_mode() {
    stress("session").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_results_and_copy_both_ways_over_tls_in_transaction_mode() {
    stress("transaction").await;
}
