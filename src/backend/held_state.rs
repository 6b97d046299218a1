//! Asking a server connection's session which state it holds that could
//! not move to another connection: after a client's statement may have
//! ended such state (UNLISTEN, an advisory unlock, DROP, CLOSE, DEALLOCATE,
//! DISCARD) the session asks, instead of tracking names from the SQL.

use super::{QueryError, ServerConn, WireError};
use bytes::{BufMut, BytesMut};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;

/// One row of booleans, in [`HeldState`]'s order. Outside a transaction
/// block: no transaction-level advisory lock or cursor is left then.
/// usher's own statements (`usher_<n>`, which carried SQL PREPAREs make
/// with SQL too) are the pool's, not the client's: they do not pin.
const HELD_STATE: &str = "SELECT \
     EXISTS (SELECT FROM pg_catalog.pg_listening_channels()), \
     EXISTS (SELECT FROM pg_catalog.pg_locks WHERE locktype = 'advisory' \
             AND pid = pg_catalog.pg_backend_pid()), \
     EXISTS (SELECT FROM pg_catalog.pg_class WHERE relnamespace = pg_catalog.pg_my_temp_schema()) \
     OR EXISTS (SELECT FROM pg_catalog.pg_proc WHERE pronamespace = pg_catalog.pg_my_temp_schema()) \
     OR EXISTS (SELECT FROM pg_catalog.pg_type WHERE typnamespace = pg_catalog.pg_my_temp_schema()), \
     EXISTS (SELECT FROM pg_catalog.pg_cursors WHERE is_holdable), \
     EXISTS (SELECT FROM pg_catalog.pg_prepared_statements WHERE from_sql \
             AND name !~ '^usher_[0-9]+$')";

/// The state a session holds on its server connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldState {
    /// LISTEN on some channel.
    pub listening: bool,
    /// A session-level advisory lock.
    pub advisory_locks: bool,
    /// A table, view, sequence, function or type in its temporary schema.
    pub temp_objects: bool,
    /// A cursor declared WITH HOLD.
    pub hold_cursors: bool,
    /// A statement prepared with SQL PREPARE.
    pub sql_prepared: bool,
}

impl ServerConn {
    /// Which state the session holds, in one round trip (call it outside a
    /// transaction block). Notifications that arrive meanwhile are
    /// returned as they came (NotificationResponse messages), for the
    /// client they belong to; ParameterStatus updates [`ServerConn::params`].
    pub async fn held_state(&mut self) -> Result<(HeldState, BytesMut), QueryError> {
        let mut out = BytesMut::new();
        frontend::query(HELD_STATE, &mut out).map_err(|e| QueryError::Encode(e.to_string()))?;
        let mut state = None;
        let mut notifications = BytesMut::new();
        self.exchange(&out, 1, |m| match m {
            Message::DataRow(row) => {
                let buffer = row.buffer();
                let mut values = [false; 5];
                let mut fields = fallible_iterator::FallibleIterator::iterator(row.ranges());
                for v in values.iter_mut() {
                    *v = matches!(fields.next(), Some(Ok(Some(r))) if buffer.get(r.start..r.end) == Some(b"t"));
                }
                state = Some(HeldState {
                    listening: values[0],
                    advisory_locks: values[1],
                    temp_objects: values[2],
                    hold_cursors: values[3],
                    sql_prepared: values[4],
                });
            }
            Message::NotificationResponse(n) => {
                if let (Ok(channel), Ok(payload)) = (n.channel(), n.message()) {
                    notification(&mut notifications, n.process_id(), channel, payload);
                }
            }
            _ => {}
        })
        .await?;
        state.map(|state| (state, notifications)).ok_or_else(|| {
            QueryError::Wire(WireError::Malformed(
                "the held-state query returned no row".into(),
            ))
        })
    }
}

/// A NotificationResponse message.
fn notification(out: &mut BytesMut, pid: i32, channel: &str, payload: &str) {
    out.put_u8(crate::protocol::tags::backend::NOTIFICATION_RESPONSE);
    out.put_u32((4 + 4 + channel.len() + 1 + payload.len() + 1) as u32);
    out.put_i32(pid);
    out.put_slice(channel.as_bytes());
    out.put_u8(0);
    out.put_slice(payload.as_bytes());
    out.put_u8(0);
}
