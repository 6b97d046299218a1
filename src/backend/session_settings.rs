//! Reading back what a session has set on its server connection: after a
//! client's statements may have changed settings, the session asks the
//! server instead of parsing the SQL (SET, RESET, SET ROLE, set_config()
//! and rolled-back transactions all come out right).

use super::{QueryError, ServerConn};
use bytes::BytesMut;
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;

/// Every setting changed at session level (SET, set_config), with the
/// value SHOW gives; `role` and `session_authorization`, which pg_settings
/// does not list, always (`role` is `none` when not set).
const READ_BACK: &str =
    "SELECT name, pg_catalog.current_setting(name) FROM pg_catalog.pg_settings \
     WHERE source = 'session' AND name <> 'session_authorization' \
     UNION ALL SELECT 'role', pg_catalog.current_setting('role') \
     UNION ALL SELECT 'session_authorization', pg_catalog.current_setting('session_authorization')";

impl ServerConn {
    /// The settings this connection's session has changed from its
    /// defaults, as (name, value), in one round trip; custom settings
    /// (`myapp.tenant`), which the server does not list, are asked for by
    /// name (`custom`: names of letters, digits, `_`, `$` and `.` only).
    /// The connection's record of its unreported settings becomes what
    /// was read; ParameterStatus messages on the way update the reported.
    pub async fn session_settings(
        &mut self,
        custom: &[String],
    ) -> Result<Vec<(String, String)>, QueryError> {
        let mut sql = READ_BACK.to_string();
        for name in custom {
            debug_assert!(name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_$.".contains(&b)));
            if name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_$.".contains(&b))
            {
                sql.push_str(&format!(
                    " UNION ALL SELECT '{name}', pg_catalog.current_setting('{name}', true)"
                ));
            }
        }
        // As usher's own statement, so the client's unnamed statement and
        // portal outlive the read-back.
        let mut out = BytesMut::new();
        super::own_statement(&sql, &mut out).map_err(|e| QueryError::Encode(e.to_string()))?;
        frontend::sync(&mut out);
        let mut rows = Vec::new();
        self.exchange(&out, 1, |m| {
            if let Message::DataRow(row) = m {
                let mut fields = row.ranges();
                let buffer = row.buffer();
                let text = |r: Option<std::ops::Range<usize>>| {
                    r.map(|r| String::from_utf8_lossy(&buffer[r]).into_owned())
                };
                if let (Ok(Some(name)), Ok(Some(value))) = (fields.next(), fields.next()) {
                    if let (Some(name), Some(value)) = (text(name), text(value)) {
                        rows.push((name, value));
                    }
                }
            }
        })
        .await?;
        self.params.read_back(&rows);
        Ok(rows)
    }
}
