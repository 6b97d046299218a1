//! A small pool of tokio-postgres connections for questions hooks ask
//! PostgreSQL (`usher.query`, the role graph). Never a client's server
//! connection. tokio-postgres pipelines concurrent queries over one
//! connection, so a few connections serve many hooks at once.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::types::Type;

/// A column value returned to hooks.
#[derive(Debug, Clone, PartialEq)]
pub enum QueryValue {
    Null,
    Bool(bool),
    Int(i64),
    Num(f64),
    Text(String),
}

/// One row: (column name, value) in column order.
pub type QueryRow = Vec<(String, QueryValue)>;

/// Why a hook's query failed: what `usher.query` raises in Lua, and why the
/// role graph could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HookQueryError {
    #[error("usher.query is not configured (set hooks.query.database and hooks.query.user)")]
    NotConfigured,
    #[error("usher.query could not connect: {0}")]
    Connect(tokio_postgres::Error),
    /// The server refused the statement.
    #[error("{code}: {message}")]
    Server { code: String, message: String },
    /// The connection failed under the statement.
    #[error(transparent)]
    Failed(tokio_postgres::Error),
    #[error("usher.query timed out after {} ms", .0.as_millis())]
    Timeout(Duration),
    #[error("column \"{column}\": {source}")]
    Column {
        column: String,
        source: tokio_postgres::Error,
    },
    #[error("column \"{column}\" has type {type_name}; cast it to text in the query")]
    ColumnType { column: String, type_name: String },
}

/// Lazily connected tokio-postgres clients, used round-robin.
pub struct QueryPool {
    config: Option<tokio_postgres::Config>,
    slots: Vec<Mutex<Option<Arc<tokio_postgres::Client>>>>,
    next: AtomicUsize,
    timeout: Duration,
}

impl std::fmt::Debug for QueryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryPool")
            .field("configured", &self.config.is_some())
            .finish_non_exhaustive()
    }
}

impl QueryPool {
    /// `config` is `None` when `hooks.query` is not configured: queries then
    /// fail with a clear message.
    pub fn new(config: Option<tokio_postgres::Config>, size: usize, timeout: Duration) -> Self {
        QueryPool {
            config,
            slots: (0..size.max(1)).map(|_| Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            timeout,
        }
    }

    pub fn configured(&self) -> bool {
        self.config.is_some()
    }

    async fn client(&self) -> Result<Arc<tokio_postgres::Client>, HookQueryError> {
        let config = self.config.as_ref().ok_or(HookQueryError::NotConfigured)?;
        let slot = &self.slots[self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len()];
        if let Some(c) = slot.lock().as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let (client, connection) = config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(HookQueryError::Connect)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "hook query connection closed");
            }
        });
        let client = Arc::new(client);
        *slot.lock() = Some(client.clone());
        Ok(client)
    }

    /// Runs `sql` with text parameters (cast them in SQL: `$1::int`), within
    /// the pool's timeout.
    pub async fn query(
        &self,
        sql: &str,
        params: &[Option<String>],
    ) -> Result<Vec<QueryRow>, HookQueryError> {
        let run = async {
            let client = self.client().await?;
            let typed: Vec<(&(dyn tokio_postgres::types::ToSql + Sync), Type)> = params
                .iter()
                .map(|p| (p as &(dyn tokio_postgres::types::ToSql + Sync), Type::TEXT))
                .collect();
            let rows =
                client
                    .query_typed(sql, &typed)
                    .await
                    .map_err(|e| match e.as_db_error() {
                        Some(db) => HookQueryError::Server {
                            code: db.code().code().to_string(),
                            message: db.message().to_string(),
                        },
                        None => HookQueryError::Failed(e),
                    })?;
            rows.iter().map(convert_row).collect()
        };
        match tokio::time::timeout(self.timeout, run).await {
            Ok(r) => r,
            Err(_) => Err(HookQueryError::Timeout(self.timeout)),
        }
    }
}

fn convert_row(row: &tokio_postgres::Row) -> Result<QueryRow, HookQueryError> {
    row.columns()
        .iter()
        .enumerate()
        .map(|(i, col)| {
            let err = |source| HookQueryError::Column {
                column: col.name().to_string(),
                source,
            };
            let value = match *col.type_() {
                Type::BOOL => row
                    .try_get::<_, Option<bool>>(i)
                    .map_err(err)?
                    .map(QueryValue::Bool),
                Type::INT2 => row
                    .try_get::<_, Option<i16>>(i)
                    .map_err(err)?
                    .map(|v| QueryValue::Int(v.into())),
                Type::INT4 => row
                    .try_get::<_, Option<i32>>(i)
                    .map_err(err)?
                    .map(|v| QueryValue::Int(v.into())),
                Type::INT8 => row
                    .try_get::<_, Option<i64>>(i)
                    .map_err(err)?
                    .map(QueryValue::Int),
                Type::OID => row
                    .try_get::<_, Option<u32>>(i)
                    .map_err(err)?
                    .map(|v| QueryValue::Int(v.into())),
                Type::FLOAT4 => row
                    .try_get::<_, Option<f32>>(i)
                    .map_err(err)?
                    .map(|v| QueryValue::Num(v.into())),
                Type::FLOAT8 => row
                    .try_get::<_, Option<f64>>(i)
                    .map_err(err)?
                    .map(QueryValue::Num),
                Type::TEXT | Type::VARCHAR | Type::NAME | Type::BPCHAR | Type::UNKNOWN => row
                    .try_get::<_, Option<String>>(i)
                    .map_err(err)?
                    .map(QueryValue::Text),
                ref other => {
                    return Err(HookQueryError::ColumnType {
                        column: col.name().to_string(),
                        type_name: other.to_string(),
                    })
                }
            };
            Ok((col.name().to_string(), value.unwrap_or(QueryValue::Null)))
        })
        .collect()
}
