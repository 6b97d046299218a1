//! The admin console from tests: run a command as `admin`, read rows.

use super::Usher;
use std::collections::HashMap;
use tokio_postgres::SimpleQueryMessage;

/// One result row: column → value (NULL as `None`).
pub type Row = HashMap<String, Option<String>>;

/// Runs a console command as `admin` on the usher listening on `port`;
/// returns every message (rows, command tags).
pub async fn console_messages(
    port: u16,
    command: &str,
) -> Result<Vec<SimpleQueryMessage>, tokio_postgres::Error> {
    console_messages_in(port, "usher", command).await
}

/// The same through a database name of the console (`usher` or `pgbouncer`).
async fn console_messages_in(
    port: u16,
    database: &str,
    command: &str,
) -> Result<Vec<SimpleQueryMessage>, tokio_postgres::Error> {
    let conn = format!("host=127.0.0.1 port={port} user=admin password=admin-pw dbname={database}");
    let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls).await?;
    tokio::spawn(driver);
    c.simple_query(command).await
}

/// The rows of a console command on the usher listening on `port`.
pub async fn console_at(port: u16, command: &str) -> Result<Vec<Row>, tokio_postgres::Error> {
    Ok(rows(console_messages(port, command).await?))
}

/// The rows among a command's messages.
pub fn rows(messages: Vec<SimpleQueryMessage>) -> Vec<Row> {
    messages
        .into_iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(
                r.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, col)| (col.name().to_string(), r.get(i).map(str::to_string)))
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

/// The rows of a console command; panics if it fails.
pub async fn console(usher: &Usher, command: &str) -> Vec<Row> {
    console_at(usher.addr.port(), command)
        .await
        .unwrap_or_else(|e| panic!("{command}: {e:?}"))
}

/// A console command's column names in wire order, and its rows as text
/// (NULL as the empty string). Goes through the `pgbouncer` name, as
/// PgBouncer's tools do.
pub async fn console_table(usher: &Usher, command: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let mut columns = Vec::new();
    let mut rows = Vec::new();
    let port = usher.addr.port();
    for m in console_messages_in(port, "pgbouncer", command)
        .await
        .unwrap()
    {
        if let SimpleQueryMessage::Row(r) = m {
            columns = r.columns().iter().map(|c| c.name().to_string()).collect();
            rows.push(
                (0..r.len())
                    .map(|i| r.get(i).unwrap_or("").to_string())
                    .collect(),
            );
        }
    }
    (columns, rows)
}

/// The row of `key` = `value` in a console result.
pub fn row<'a>(rows: &'a [Row], key: &str, value: &str) -> &'a Row {
    rows.iter()
        .find(|r| r[key].as_deref() == Some(value))
        .unwrap_or_else(|| panic!("no row with {key} = {value:?} in {rows:#?}"))
}

/// A column of a row; panics if the column does not exist.
pub fn get<'a>(r: &'a Row, column: &str) -> Option<&'a str> {
    r.get(column)
        .unwrap_or_else(|| panic!("no column {column} in {r:?}"))
        .as_deref()
}

/// Waits until SHOW POOLS on the usher listening on `port` shows `value`
/// in `column` for the pool of `user` in database `app`.
pub async fn wait_pool(port: u16, user: &str, column: &str, value: &str) {
    super::wait::wait_for_async(
        super::wait::DEADLINE,
        &format!("SHOW POOLS: {column} = {value} for {user}/app"),
        || async {
            let rows = console_at(port, "SHOW POOLS")
                .await
                .map_err(|e| e.to_string())?;
            let pool = rows.iter().find(|r| {
                r["database"].as_deref() == Some("app") && r["user"].as_deref() == Some(user)
            });
            match pool.map(|r| get(r, column)) {
                Some(Some(v)) if v == value => Ok(()),
                _ => Err(format!("{pool:?}")),
            }
        },
    )
    .await
}

/// Polls `command` on the console until `done` holds for its rows (up to
/// [`super::wait::DEADLINE`]; the last rows are in the failure).
pub async fn wait_for_rows(usher: &Usher, command: &str, done: impl Fn(&[Row]) -> bool) {
    super::wait::wait_for_async(
        super::wait::DEADLINE,
        &format!("{command} gets there"),
        || async {
            let rows = console(usher, command).await;
            if done(&rows) {
                Ok(())
            } else {
                Err(rows)
            }
        },
    )
    .await
}
